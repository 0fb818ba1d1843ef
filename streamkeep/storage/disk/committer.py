"""Group commit across streams.

A single `Committer` task runs rounds: it takes every stream's queued appends, writes and syncs
them in worker threads, then publishes them. Appends that arrive during a round, on any stream,
share the next one. Syncing is one fdatasync per file, in parallel groups of `group_size` streams
per worker thread (concurrent fdatasyncs on ext4 share journal commits), or, with
`sync_method="syncfs"`, one syncfs() for the whole round. The round also checks free space once:
a batch that would eat into the `--min-free-bytes` reserve fails with 507 without being written.

A round never ends the server: a failure fails that round's commits and the next round runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from streamkeep.protocol.stream import StreamMeta
from streamkeep.storage.disk.index import Segment
from streamkeep.storage.disk.writer import Pending, ReadOnly, SegmentWriter, WritePlan
from streamkeep.storage.errors import StorageUnavailable, below_reserve
from streamkeep.telemetry.histogram import COUNT_BUCKETS, Histogram

log = logging.getLogger(__name__)


class Committable(Protocol):
    """A stream's log as the committer sees it (DiskLog is one)."""

    meta: StreamMeta

    @property
    def writer(self) -> SegmentWriter: ...

    @property
    def active_segment(self) -> Segment: ...

    def take_batch(self) -> CommitBatch | None: ...

    def finish_batch(self, batch: CommitBatch) -> None: ...


@dataclass
class CommitBatch:
    """One stream's share of a commit round: its queued appends, laid out for writing."""

    log: Committable
    pending: list[Pending]
    plan: WritePlan
    error: Exception | None = None


@dataclass(frozen=True)
class RoundSettings:
    fsync_always: bool
    syncfs: bool
    min_free_bytes: int


class Committer:
    def __init__(
        self,
        run_sync: Callable[..., Awaitable[Any]],
        settings: RoundSettings,
        group_size: int,
        *,
        free_bytes: Callable[[], int],
        syncfs: Callable[[], None],
    ) -> None:
        self._run_sync = run_sync
        self._settings = settings
        # syncfs covers every stream of a round in one call, so it needs no parallel groups.
        self._group_size = 1 << 30 if settings.syncfs else group_size
        self._free_bytes = free_bytes
        self._syncfs = syncfs
        self._dirty: dict[Committable, None] = {}
        self._work = trio.Event()
        self.rounds = 0
        self.failed_rounds = 0
        # For metrics: how long each round's writes and syncs took, and how many appends shared it.
        self.round_seconds = Histogram()
        self.round_records = Histogram(COUNT_BUCKETS)

    def wake(self, stream_log: Committable) -> None:
        self._dirty[stream_log] = None
        self._work.set()

    async def run(self) -> None:
        while True:
            await self._work.wait()
            self._work = trio.Event()
            while self._dirty:
                logs, self._dirty = list(self._dirty), {}
                batches = [batch for stream_log in logs if (batch := stream_log.take_batch()) is not None]
                if batches:
                    await self._round(batches)

    async def _round(self, batches: list[CommitBatch]) -> None:
        self.rounds += 1
        try:
            # statvfs answers from memory in microseconds: not worth a thread hop per round.
            free = self._free_bytes() if self._settings.min_free_bytes else None
            admitted = []
            for batch in batches:
                if free is not None and free - batch.plan.size < self._settings.min_free_bytes:
                    batch.error = below_reserve(
                        f"append to {batch.log.meta.name!r}", free, self._settings.min_free_bytes
                    )
                    continue
                if free is not None:
                    free -= batch.plan.size
                admitted.append(batch)
            groups = [admitted[i : i + self._group_size] for i in range(0, len(admitted), self._group_size)]
            started = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for group in groups:
                    nursery.start_soon(self._run_sync, self._write_group, group)
            if admitted:
                self.round_seconds.observe(time.perf_counter() - started)
                self.round_records.observe(sum(len(batch.pending) for batch in admitted))
        except Exception as error:  # a bug, or a failure outside any one stream: fail this round only
            self.failed_rounds += 1
            log.exception("commit round failed; its appends are answered 503 and the next round runs")
            for batch in batches:
                if batch.error is None:
                    batch.error = StorageUnavailable(f"the commit round failed: {error}", status=503)
        finally:
            for batch in batches:
                batch.log.finish_batch(batch)

    def _write_group(self, group: list[CommitBatch]) -> None:
        """In a worker thread: each stream's batch, written and synced; one failure spares the rest."""
        settings = self._settings
        written = []
        for batch in group:
            try:
                batch.log.writer.write(
                    batch.plan,
                    batch.log.active_segment,
                    sync=settings.fsync_always and not settings.syncfs,
                )
            except (OSError, ReadOnly) as error:
                batch.error = error
            else:
                written.append(batch)
        if settings.fsync_always and settings.syncfs and written:
            # One call makes every file of the data directory's file system durable. If it fails,
            # nothing in this round is known to be durable: take every batch back.
            try:
                self._syncfs()
            except OSError as error:
                for batch in written:
                    batch.error = batch.log.writer.undo_unsynced(batch.plan, batch.log.active_segment, error)
                return
            for batch in written:
                batch.log.writer.mark_synced(batch.plan)
