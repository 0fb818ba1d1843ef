"""Stream -> Postgres (`[[stream_to_pg]]`): a stream's messages applied to a table exactly once,
the offset stored in Postgres in the same transaction as the rows.

- `names`: the mapping's SQL names and replication origin.
- `offsets`: the stored offset, moved only by compare-and-set (fencing).
- `tables`: the tables, created if missing.
- `reading`: the reading task; `batch`: what one transaction applies.
- `state` / `log`: the two modes, planned in Python and written with COPY.
- `commit`: one transaction; `bridge`: the mapping's task (`run`) and `reset`."""

from streamkeep.sync.sink.bridge import reset, run

__all__ = ["reset", "run"]
