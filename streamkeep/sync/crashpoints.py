"""Named places where the tests kill the sync process, as SIGKILL would: with
STREAMKEEP_SYNC_CRASH_AT=NAME (or NAME:N, the Nth time it is reached) the process ends there at once,
with no cleanup, no flushed buffers and no goodbye to Postgres or streamkeep.

The names say where a crash is worth proving: `source.before_append`, `source.after_append`
(appended, checkpoint not yet moved), `source.after_checkpoint` (slot not yet confirmed),
`source.snapshot_append` (after each batch of the snapshot: it starts over behind a `reset`),
`sink.before_commit`, `sink.after_commit`."""

from __future__ import annotations

import os
import signal

VARIABLE = "STREAMKEEP_SYNC_CRASH_AT"
_reached: dict[str, int] = {}


def crash_point(name: str) -> None:
    wanted = os.environ.get(VARIABLE)
    if not wanted:
        return
    where, _, count = wanted.partition(":")
    if where != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] >= int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
