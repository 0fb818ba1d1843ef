"""Compaction of State Protocol streams: by appending a snapshot, never by rewriting.

Bytes at an offset never change, so a stream of change messages is compacted by *adding* to it:

1. a background task folds the stream (protocol/state_fold.py) from its floor up to the tail it
   sees when it starts, reading like any reader, outside the actor;
2. the stream's actor folds the few messages that came meanwhile and appends the snapshot
   (`snapshot-start`, one `insert` per live type/key, `snapshot-end`) as one record starting a new
   segment (the `Compact` message, actors/folding.py `append_snapshot`): nothing can be appended
   between the state it reflects and its position;
3. once that record is durable, the floor moves to the snapshot's start (DiskLog.raise_floor),
   and retention deletes what is below it when no fork reads it.

A reader from the floor materializes exactly what a reader from the old beginning does: the old
messages, then the snapshot's inserts of the same values. Live readers receive the snapshot as
ordinary messages. One compaction per stream runs at a time; a second request joins it. It runs in
the server's nursery, so a client that hangs up does not stop it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import trio

from streamkeep.actors.folding import check_compactable, fold_range, snapshot_log
from streamkeep.actors.messages import Compact
from streamkeep.actors.supervisor import Supervisor
from streamkeep.protocol import offsets
from streamkeep.protocol.errors import ProtocolError, not_found
from streamkeep.protocol.state_fold import StateFold
from streamkeep.storage import forks
from streamkeep.storage.errors import STORAGE_ERRORS, as_protocol_error

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 20
PROGRESS_EVERY = 1.0
# The fold runs on the event loop: it yields after this much work, so other streams' appends wait
# at most about this long behind it (ops/bench_compaction.py measures it).
SLICE_SECONDS = 0.002
# `Compactor._failed_at` is pruned of deleted streams once it holds more than this (then twice
# what the last prune left): amortized O(1) per failure, bounded by twice the failing streams alive.
PRUNE_FLOOR = 256


@dataclass
class Progress:
    name: str
    phase: str = "folding"  # folding, appending, done, failed
    folded_bytes: int = 0
    target_bytes: int = 0
    started: float = field(default_factory=time.monotonic)
    result: dict | None = None
    automatic: bool = False  # started by a retention rule, not a request
    error: ProtocolError | None = None
    done: trio.Event = field(default_factory=trio.Event)

    def line(self) -> dict:
        if self.error is not None:
            return {"error": {"code": self.error.code, "message": self.error.message}}
        if self.result is not None:
            return {"done": True, **self.result}
        return {
            "phase": self.phase,
            "folded_bytes": self.folded_bytes,
            "of": self.target_bytes,
            "seconds": round(time.monotonic() - self.started, 1),
        }


class Compactor:
    def __init__(self, supervisor: Supervisor, nursery: trio.Nursery) -> None:
        self.supervisor = supervisor
        self.storage = supervisor.storage
        self.nursery = nursery
        self.running: dict[str, Progress] = {}
        # Per stream, its incarnation and its tail when an automatic compaction last failed. An
        # entry goes when a compaction succeeds, when the name is created again, and when a prune
        # finds its stream gone (once the dict doubled since the last prune): streams deleted
        # after a failure must not cost memory for the rest of the server's life.
        self._failed_at: dict[str, tuple[int, int]] = {}
        self._prune_above = PRUNE_FLOOR
        self.compactions = 0
        self.failures = 0
        self.dropped_messages = 0

    def start(self, name: str, *, drop_invalid: bool = False) -> Progress:
        """Starts compacting `name` (or returns the compaction already running); raises
        ProtocolError at once for a stream that cannot be compacted."""
        progress = self.running.get(name)
        if progress is not None:
            return progress
        stream_log = self.storage.open(name)
        if stream_log is None or stream_log.meta.soft_deleted:
            raise not_found(name)
        check_compactable(stream_log)
        snapshot_log(stream_log)
        progress = self.running[name] = Progress(name)
        self.nursery.start_soon(self._run, progress, drop_invalid)
        return progress

    def start_due(self, name: str) -> None:
        """For retention's rules: starts a compaction unless one runs, or the last one failed and
        the stream grew little since (a stream of the wrong shape is not folded every pass)."""
        stream_log = self.storage.open(name)
        if stream_log is None or name in self.running:
            return
        failed = self._failed_at.get(name)
        if failed is not None:
            incarnation, failed_at = failed
            if incarnation != stream_log.meta.incarnation:  # a new stream under the same name
                del self._failed_at[name]
            elif stream_log.published_tail < failed_at + (1 << 20):
                return
        try:
            progress = self.start(name)
        except ProtocolError as error:
            self._note_failure(name)
            log.warning("compaction of %r not started: %s", name, error.message)
            return
        progress.automatic = True

    async def _run(self, progress: Progress, drop_invalid: bool) -> None:
        name = progress.name
        try:
            progress.result = await self._compact(progress, drop_invalid)
            progress.phase = "done"
            self.compactions += 1
            self._failed_at.pop(name, None)
            log.info("compaction of %r: %s", name, progress.result)
        except ProtocolError as error:
            progress.error, progress.phase = error, "failed"
            self.failures += 1
            self._note_failure(name)
            log.warning("compaction of %r failed: %s", name, error.message)
        except STORAGE_ERRORS as error:
            progress.error, progress.phase = as_protocol_error(error, name), "failed"
            self.failures += 1
            self._note_failure(name)
            log.warning("compaction of %r failed: %s", name, error)
        except Exception as error:  # a bug: logged with its traceback; the server goes on
            progress.error = ProtocolError(500, "internal_error", "the compaction failed; it has been logged")
            progress.phase = "failed"
            self.failures += 1
            self._note_failure(name)
            log.exception("compaction of %r failed: %r", name, error)
        finally:
            if self.running.get(name) is progress:
                del self.running[name]
            progress.done.set()

    def _note_failure(self, name: str) -> None:
        stream_log = self.storage.open(name)
        if stream_log is not None:
            self._failed_at[name] = (stream_log.meta.incarnation, stream_log.published_tail)
        if len(self._failed_at) > self._prune_above:
            self._failed_at = {n: f for n, f in self._failed_at.items() if self.storage.open(n) is not None}
            self._prune_above = max(PRUNE_FLOOR, 2 * len(self._failed_at))

    async def _compact(self, progress: Progress, drop_invalid: bool) -> dict:
        name = progress.name
        stream_log = self.storage.open(name)
        if stream_log is None:
            raise not_found(name)
        fold = StateFold(drop_invalid=drop_invalid)
        stream_id = stream_log.meta.stream_id
        floor_before = forks.readable_from(self.storage, stream_log)
        position = floor_before
        target = stream_log.published_tail
        progress.target_bytes = target - floor_before

        def folded(at: int) -> None:
            progress.folded_bytes = at - floor_before

        position = await fold_range(
            self.storage, stream_log, fold, position, target, READ_CHUNK,
            slice_seconds=SLICE_SECONDS, progress=folded,
        )  # fmt: skip
        progress.phase = "appending"
        snapshot = await self.supervisor.call(name, Compact(fold, position, READ_CHUNK, stream_id))
        start = snapshot.start
        end = await snapshot.commit.wait()  # durable: only now may readers be sent to it
        await snapshot.log.raise_floor(start, snapshot_end=end)
        self.dropped_messages += fold.dropped
        incarnation = snapshot.log.meta.incarnation
        return {
            "stream": name,
            "snapshot_offset": offsets.encode(start, incarnation),
            "floor_before": offsets.encode(floor_before, incarnation),
            "keys": len(fold.state),
            "messages_folded": fold.folded,
            "messages_dropped": fold.dropped,
            "history_bytes": start - floor_before,
            "snapshot_bytes": end - start,
            "seconds": round(time.monotonic() - progress.started, 3),
        }

    async def lines(self, progress: Progress) -> AsyncIterator[bytes]:
        """Progress as NDJSON, a line a second, then the result or the error."""
        while not progress.done.is_set():
            yield json.dumps(progress.line()).encode() + b"\n"
            with trio.move_on_after(PROGRESS_EVERY):
                await progress.done.wait()
        yield json.dumps(progress.line()).encode() + b"\n"

    def stats(self) -> dict:
        return {
            "running": sorted(self.running),
            "compactions": self.compactions,
            "failures": self.failures,
            "dropped_messages": self.dropped_messages,
        }
