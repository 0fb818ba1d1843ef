"""What each mapping reports to /metrics, /healthz and the log: one `MappingStats` per mapping,
written only by that mapping's task and read by the process's listener."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

STATES = ("starting", "snapshot", "streaming", "retrying", "stopped")


class MappingStopped(Exception):
    """A condition a person must act on (a changed primary key, a dropped table, an invalidated
    slot, a 410, a message that does not fit): the mapping stops, the others go on, /healthz says
    which and the message says what to run."""


@dataclass
class MappingStats:
    name: str
    direction: str  # "pg_to_stream" or "stream_to_pg"
    state: str = "starting"
    rows: int = 0  # rows appended to the stream, or messages applied to Postgres
    batches: int = 0  # appends made, or transactions committed
    retries: int = 0  # transient failures retried (Postgres or streamkeep unreachable, 503s ...)
    lag_bytes: int = 0  # WAL not yet confirmed (source); stream bytes not yet applied (sink), when known
    lag_seconds: float = 0.0  # commit-to-append (source) or append-to-apply (sink) of the last batch
    position: str = ""  # the LSN confirmed (source) or the stream offset stored (sink)
    last_error: str | None = None  # the last transient error, cleared once a batch goes through
    stopped: str | None = None  # why the mapping stopped (MappingStopped's message)
    updated_at: float = field(default_factory=time.time)

    def progressed(self, rows: int, position: str) -> None:
        self.rows += rows
        self.batches += 1
        self.position = position
        self.last_error = None
        self.state = "streaming"
        self.updated_at = time.time()
