"""One stream on disk: `DiskLog`, its state (log_state.py) with the commit protocol and sealing.

Appends queue here (`submit`, the commit entry point); the committer (committer.py) takes them in
rounds (`take_batch`), has the stream's `SegmentWriter` (writer.py) write and sync them, and hands
them back to be published or failed (`finish_batch`). Sealing starts a new segment file, so the
old one can move to the cold tier. Reads (log_reads.py) and retention (log_retention.py) are the
other bases of the class; docs/architecture.md, section 6, follows an append through them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import trio

from streamkeep.segments import format as fmt
from streamkeep.storage.base import AppendRecord, Commit, resolved
from streamkeep.storage.disk.committer import CommitBatch
from streamkeep.storage.disk.index import Segment
from streamkeep.storage.disk.log_reads import LogReads
from streamkeep.storage.disk.log_retention import LogRetention
from streamkeep.storage.disk.log_state import NOTHING_QUEUED, own_producers, producers_copy
from streamkeep.storage.disk.writer import NotTakenBack, Pending, ReadOnly, plan_batch
from streamkeep.storage.errors import StorageUnavailable, StreamDeleted, from_os_error

log = logging.getLogger(__name__)


class DiskLog(LogReads, LogRetention):
    """A stream's log on disk: what the `Storage` interface (storage/base.py) hands its actor."""

    __slots__ = ()

    # ---- appends ----------------------------------------------------------------------

    def submit(self, record: AppendRecord) -> Commit:
        storage = self.host
        if self.writer.read_only is not None:
            raise StorageUnavailable(
                f"stream {self.meta.name!r} takes no appends: {self.writer.read_only}",
                status=503,
                code="read_only",
            )
        blocked = storage.cold.appends_blocked() if storage.cold is not None else None
        if blocked is not None:
            raise StorageUnavailable(blocked, status=503, code="cold_backlog")
        added = sum(len(m) for m in record.messages)
        storage.budget.reserve(self._tail - self.held_from, added)
        pending = Pending(record, self._tail, Commit(), int(time.time() * 1000))
        self._tail += added
        # The record's meta is a fresh copy made for this append; only last_access is ever
        # written in place afterwards, so sharing it is safe and saves a copy per append.
        self.meta = record.meta
        if record.producer is not None:
            self.producers = own_producers(self.producers)
            self.producers[record.producer[0]] = record.producer[1]
        if self._queue:
            self._queue.append(pending)
        else:
            self._queue = [pending]
        self._latest = pending.commit
        storage.committer.wake(self)
        return pending.commit

    def take_batch(self) -> CommitBatch | None:
        """For the committer: everything queued since the last round, laid out for writing, with
        the I/O lock held until `finish_batch`. None if there is nothing, or the lock is busy (its
        holder wakes the committer again when it lets go)."""
        if not self._queue:
            return None
        try:
            self.io_lock.acquire_nowait()
        except trio.WouldBlock:
            return None
        pending, self._queue = self._queue, NOTHING_QUEUED
        self._committing = True
        storage = self.host
        try:
            if self.deleted:  # cannot happen (a delete drains first); never write to a deleted stream
                raise StreamDeleted()
            plan = plan_batch(
                self.active_segment, pending, self.meta, storage.limits, int(time.time() * 1000)
            )
        except Exception as error:
            batch = CommitBatch(self, pending, None)  # type: ignore[arg-type]
            batch.error = error
            self.finish_batch(batch)
            return None
        return CommitBatch(self, pending, plan)

    def finish_batch(self, batch: CommitBatch) -> None:
        self._committing = False
        try:
            if batch.error is None:
                self._publish(batch)
                self.host.health.ok("commit")
                self.wrote_through_descriptor()
            else:
                self._fail(batch.pending + self._queue, self._storage_error(batch.error))
                self._queue = NOTHING_QUEUED
        finally:
            self.io_lock.release()

    def _storage_error(self, error: Exception) -> Exception:
        what = f"append to {self.meta.name!r}"
        if isinstance(error, NotTakenBack):
            return StorageUnavailable(
                f"{what} failed ({error.strerror}), and what it wrote could not be cut off again: it "
                "is not served, but a power loss may still keep it; a producer's retry is safe, "
                "check the stream before repeating a plain append",
                status=503,
                code="not_durable",
            )
        if isinstance(error, OSError):
            return from_os_error(error, what)
        if isinstance(error, ReadOnly):
            return StorageUnavailable(f"{what}: {error}", status=503, code="read_only")
        if isinstance(error, StorageUnavailable | StreamDeleted):
            return error
        log.error("%s failed: %r", what, error)
        return StorageUnavailable(f"{what} failed: {error}; retry shortly", status=503)

    def _publish(self, batch: CommitBatch) -> None:
        storage = self.host
        sealed = False
        for pending, (segment, record_at, payload_at, header) in zip(
            batch.pending, batch.plan.entries, strict=True
        ):
            if segment is not self.segments[-1]:
                self.segments.append(segment)  # the first append of a segment this batch rotated to
                sealed = True
            payload = b"".join(pending.record.messages)
            record = fmt.Record(fmt.KIND_APPEND, header, record_at, payload_at, len(payload), payload)
            self.index_record(segment, record, payload)
            self._durable_meta = pending.record.meta
            pending.commit.resolve(self._pub_tail)
        if storage.fsync != "always":
            self.dirty = True
        if sealed and storage.cold is not None:
            storage.cold.sealed()
        self.published()

    def published(self) -> None:
        """Tells the actor (and through it live readers and subscriptions) about new data. A
        listener's failure must not take the committer down with it."""
        if self.on_publish is not None:
            try:
                self.on_publish()
            except Exception:
                log.exception("stream %r: a publish listener failed", self.meta.name)

    def _fail(self, pending: list[Pending], error: Exception) -> None:
        self.host.health.failed("commit", str(error))
        self.host.budget.release(self._tail - self._pub_tail)
        self._tail = self._pub_tail
        # Undo the failed appends only: fork links (local counts and remote pins) and soft
        # deletion are not part of them. A new meta object: whoever changes one of those after
        # an await must change `self.meta` as it is then, not one it read before.
        self.meta = replace(
            self._durable_meta,
            last_access=self.meta.last_access,
            fork_count=self.meta.fork_count,
            soft_deleted=self.meta.soft_deleted,
            remote_forks=self.meta.remote_forks,
        )
        self.producers = producers_copy(self._durable_producers)
        # A retried duplicate or an idempotent close waits on this: it repeats what is published.
        self._latest = resolved(self._pub_tail)
        for item in pending:
            item.commit.fail(error)

    async def drain(self) -> None:
        """Waits until every accepted append is published or failed."""
        while self._queue or self._committing:
            await self._latest.settled()

    # ---- background work on the stream's files ---------------------------------------

    def should_seal(self, now_ms: float, max_age: float) -> bool:
        active = self.active_segment
        return (
            not self.deleted
            and active.appends > 0
            and self._pub_tail > active.start
            and active.first_ms is not None
            and now_ms - active.first_ms >= max_age * 1000
        )

    async def seal_idle(self) -> bool:
        """Seals the active segment of a stream nobody is appending to (for --segment-max-age):
        a new, empty segment takes its place, so the old one can move to the cold tier."""
        if self._queue or self._committing:
            return False
        async with self.exclusive():
            active = self.active_segment
            # A segment whose records hold no bytes (only a close) would be followed by one of the
            # same name: there is nothing to archive in it anyway.
            if self._queue or self.deleted or not active.appends or self._pub_tail == active.start:
                return False
            await self._start_segment(active)
        if self.host.cold is not None:
            self.host.cold.sealed()
        return True

    async def fresh_segment(self) -> int:
        """Makes the next append start a segment (a compaction snapshot, so the floor can move to
        it); returns where. Call with nothing queued (after `drain`, from the actor)."""
        async with self.exclusive():
            active = self.active_segment
            if self._pub_tail == active.start:
                return active.start  # nothing in it yet: it is fresh already
            if self._queue or self.deleted:
                raise StorageUnavailable(
                    f"{self.meta.name!r} changed while a compaction ran; retry", status=503
                )
            await self._start_segment(active)
        if self.host.cold is not None:
            self.host.cold.sealed()
        return self._pub_tail

    async def _start_segment(self, active: Segment) -> None:
        start = self._pub_tail
        segment = Segment(start, self.location, 0)
        header = fmt.encode_segment_header(self.meta.name, start, self.meta.content_type, self.meta.stream_id)
        await self.host.run_io(self.writer.start_segment, active, segment, header)
        segment.size = len(header)
        self.segments.append(segment)
        self.wrote_through_descriptor()

    async def make_durable(self) -> None:
        if self.host.fsync != "always" and self.dirty:
            what = f"sync of {self.meta.name!r}"
            try:
                await self.sync()
            except OSError as error:
                raise from_os_error(error, what) from None
            except ReadOnly as error:  # left bare, a 500 to the client of the fork that asked
                raise StorageUnavailable(f"{what}: {error}", status=503, code="read_only") from None

    def went_idle(self) -> None:
        """Its actor hibernated: nobody listens for publishes any more (the next actor says so
        again), and what an idle stream holds shrinks to what it cannot make again."""
        self.on_publish = None
        self.give_back()

    async def sync(self) -> None:
        """Makes what this stream wrote durable (fsync=interval)."""
        async with self.exclusive():
            if self.deleted:
                return
            self.dirty = False
            try:
                await self.host.run_io(self.writer.sync, self.active_segment)
            except BaseException:  # failed, refused (ReadOnly) or cancelled before it ran: still owed
                self.dirty = True
                raise
