"""One stream on disk: what its actor has accepted, what is durable and shown to readers, and
where every published record lives (docs/architecture.md, section 6).

Appends queue here; the committer (committer.py) takes them in rounds, has the stream's
`SegmentWriter` (writer.py) write and sync them, and hands them back to be published. Every
operation that touches the stream's files (a commit round, sealing an idle segment, a background
sync, recording an upload, dropping a local copy; and the storage's delete) holds the stream's I/O
lock, so none of them can close, replace or delete a file another is using. Reads do not: they
find their records in the index or the tail cache, or read the segment files, and never serve
bytes of a stream deleted while they ran.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import trio

from streamkeep.health import Health
from streamkeep.protocol.stream import ProducerMark, ProducerState, StreamMeta
from streamkeep.segments import format as fmt
from streamkeep.segments import layout
from streamkeep.storage import files, manifest
from streamkeep.storage import floor as floors
from streamkeep.storage.base import AppendRecord, ByteBudget, Commit, ReadResult, resolved
from streamkeep.storage.committer import Batch, Committer
from streamkeep.storage.errors import RetainedAway, StorageUnavailable, StreamDeleted, from_os_error
from streamkeep.storage.files import FileSystem
from streamkeep.storage.floor import FloorCheckpoint
from streamkeep.storage.index import Entry, RecordIndex, Segment, TailCache
from streamkeep.storage.tiering import ColdTier
from streamkeep.storage.writer import (
    NotTakenBack,
    Pending,
    ReadOnly,
    SegmentLimits,
    SegmentWriter,
    plan_batch,
)

log = logging.getLogger(__name__)


class LogHost(Protocol):
    """What a stream's log needs from the storage it belongs to (DiskStorage is one)."""

    fs: FileSystem
    budget: ByteBudget
    fsync: str
    limits: SegmentLimits
    cache_bytes: int
    health: Health
    committer: Committer
    cold: ColdTier | None

    async def run_io(self, fn: Callable[..., Any], *args: Any) -> Any: ...


class DiskLog:
    def __init__(self, storage: LogHost, directory: Path, meta: StreamMeta) -> None:
        self._storage = storage
        self.directory = directory
        self.meta = meta  # accepted
        self.producers: dict[str, ProducerState] = {}
        self.on_publish: Callable[[], None] | None = None
        self.segments: list[Segment] = []
        self.index = RecordIndex()
        self._cache = TailCache(storage.cache_bytes)
        self._tail = meta.fork_base
        # published (durable) state
        self._pub_tail = meta.fork_base
        self._pub_closed = False
        self._durable_meta = replace(meta)
        self._durable_producers: dict[str, ProducerState] = {}
        self._queue: list[Pending] = []
        self._committing = False
        self._latest: Commit = resolved(0)
        self.writer = SegmentWriter(storage.fs, directory)
        self.io_lock = trio.Lock()
        self.dirty = False  # written but not yet synced (fsync=interval)
        self.deleted = False
        self.deleting: trio.Event | None = None  # set when a delete in progress has its outcome
        self.cold_entries: list[dict] = []  # the manifest: segments uploaded to the cold tier
        # Retention (retention.py): readers see nothing before `floor` (410); the files before it
        # may stay a while for forks that pin them (`segments[0].start` is what is still held).
        self.floor = 0  # a fork shows its source from 0
        self.snapshot_end: int | None = None  # the end of the compaction snapshot at the floor
        # The time of the last append whose record retention dropped: a sliding TTL counts from
        # it when no later record is left.
        self.last_append_ms: int | None = None

    # ---- state views --------------------------------------------------------------------

    @property
    def tail(self) -> int:
        return self._tail

    @property
    def published_tail(self) -> int:
        return self._pub_tail

    @property
    def published_closed(self) -> bool:
        return self._pub_closed

    @property
    def pending(self) -> int:
        return len(self._queue) + (1 if self._committing else 0)

    @property
    def active_segment(self) -> Segment:
        return self.segments[-1]

    def latest_commit(self) -> Commit:
        return self._latest

    def next_append_end(self, position: int) -> int | None:
        return self.index.record_end(position, self._pub_tail)

    def is_boundary(self, position: int) -> bool:
        return self.index.is_boundary(position, self.meta.fork_base, self._pub_tail)

    # ---- loading (recovery) -----------------------------------------------------------

    def index_record(self, segment: Segment, record: fmt.Record, payload: bytes | None) -> None:
        """Adds a durable record to the published state (used by recovery and by publishing)."""
        lengths = record.message_lengths
        self.index.add(
            Entry(
                record.start,
                record.payload_len,
                segment,
                record.payload_offset,
                lengths if len(lengths) > 1 else None,
            )
        )
        self._pub_tail = record.start + record.payload_len
        if segment.appends == 0:
            segment.first_ms = record.time_ms
        segment.last_ms = record.time_ms
        segment.appends += 1
        segment.size = max(segment.size, record.end)
        segment.last_record_at = record.file_offset
        producer = record.producer
        if producer is not None:
            self._durable_producers[producer[0]] = ProducerState(producer[1], producer[2])
        if record.stream_seq is not None:
            self._durable_meta.last_stream_seq = record.stream_seq
        if record.closes:
            self._pub_closed = True
            self._durable_meta.closed = True
            if producer is not None:
                self._durable_meta.closed_by = ProducerMark(*producer)
        if payload is not None:
            self._cache.put(self.index.dropped + len(self.index) - 1, payload)

    def adopt_floor(self, checkpoint: FloorCheckpoint) -> None:
        """At recovery, before the records still there are indexed: what the dropped ones decided."""
        self.floor = max(self.floor, checkpoint.floor)
        self.snapshot_end = checkpoint.snapshot_end
        self.last_append_ms = checkpoint.last_append_ms
        self._durable_producers.update(checkpoint.producers)
        self._durable_meta.last_stream_seq = checkpoint.last_stream_seq
        if checkpoint.closed:
            self._pub_closed = True
            self._durable_meta.closed = True
            self._durable_meta.closed_by = checkpoint.closed_by
        self._pub_tail = max(self._pub_tail, checkpoint.floor)

    def checkpoint_at(self, floor: int, snapshot_end: int | None = None) -> FloorCheckpoint:
        """The durable state now, as a floor checkpoint at `floor`."""
        meta = self._durable_meta
        times = [segment.last_ms for segment in self.segments if segment.last_ms is not None]
        return FloorCheckpoint(
            floor,
            dict(self._durable_producers),
            meta.last_stream_seq,
            self._pub_closed,
            meta.closed_by,
            snapshot_end,
            max(times, default=self.last_append_ms),
        )

    @property
    def held_from(self) -> int:
        """The first position whose bytes this stream still holds (its own, not a source's)."""
        return self.segments[0].start if self.segments else self.floor

    @property
    def record_count(self) -> int:
        """Append records published in this stream since recovery found it (those below the floor
        it found excluded): the admin API's `appends`, whose rate the stream browser charts."""
        return self.index.dropped + len(self.index)

    def tier_bytes(self) -> dict[str, int]:
        """This stream's segment bytes by tier, as `DiskStorage.tier_bytes` counts them all."""
        hot = sum(segment.size for segment in self.segments if segment.local)
        cold = sum(segment.size for segment in self.segments if not segment.local)
        return {"hot": hot, "cold": cold}

    def adopt_durable_state(self, last_append_ms: int | None) -> None:
        """After loading: the accepted state starts equal to the durable one."""
        if last_append_ms is not None:
            self._durable_meta.last_access = max(self._durable_meta.created_at, last_append_ms / 1000)
        else:
            self._durable_meta.last_access = self._durable_meta.created_at
        self._tail = self._pub_tail
        self.meta = replace(self._durable_meta)
        self.producers = dict(self._durable_producers)

    # ---- appends ----------------------------------------------------------------------

    def submit(self, record: AppendRecord) -> Commit:
        storage = self._storage
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
            self.producers[record.producer[0]] = record.producer[1]
        self._queue.append(pending)
        self._latest = pending.commit
        storage.committer.wake(self)
        return pending.commit

    def take_batch(self) -> Batch | None:
        """For the committer: everything queued since the last round, laid out for writing, with
        the I/O lock held until `finish_batch`. None if there is nothing, or the lock is busy (its
        holder wakes the committer again when it lets go)."""
        if not self._queue:
            return None
        try:
            self.io_lock.acquire_nowait()
        except trio.WouldBlock:
            return None
        pending, self._queue = self._queue, []
        self._committing = True
        storage = self._storage
        try:
            if self.deleted:  # cannot happen (a delete drains first); never write to a deleted stream
                raise StreamDeleted()
            plan = plan_batch(
                self.active_segment, pending, self.meta, storage.limits, int(time.time() * 1000)
            )
        except Exception as error:
            batch = Batch(self, pending, None)  # type: ignore[arg-type]
            batch.error = error
            self.finish_batch(batch)
            return None
        return Batch(self, pending, plan)

    def finish_batch(self, batch: Batch) -> None:
        self._committing = False
        try:
            if batch.error is None:
                self._publish(batch)
                self._storage.health.ok("commit")
            else:
                self._fail(batch.pending + self._queue, self._storage_error(batch.error))
                self._queue = []
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

    def _publish(self, batch: Batch) -> None:
        storage = self._storage
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
        self._storage.health.failed("commit", str(error))
        self._storage.budget.release(self._tail - self._pub_tail)
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
        self.producers = dict(self._durable_producers)
        # A retried duplicate or an idempotent close waits on this: it repeats what is published.
        self._latest = resolved(self._pub_tail)
        for item in pending:
            item.commit.fail(error)  # type: ignore[arg-type]

    async def drain(self) -> None:
        """Waits until every accepted append is published or failed."""
        while self._queue or self._committing:
            await self._latest.settled()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Holds the stream's I/O lock; wakes the committer afterwards if appends queued meanwhile."""
        async with self.io_lock:
            yield
        if self._queue:
            self._storage.committer.wake(self)

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
        if self._storage.cold is not None:
            self._storage.cold.sealed()
        return True

    async def fresh_segment(self) -> int:
        """Makes the next append start a segment (a compaction snapshot, so the floor can move to
        it); returns where. Call with nothing queued (after `drain`, from the actor)."""
        async with self.exclusive():
            active = self.active_segment
            if self._pub_tail == active.start:
                return active.start  # nothing in it yet: it is fresh already
            if self._queue or self.deleted:
                raise StorageUnavailable(f"{self.meta.name!r} changed while a compaction ran; retry", status=503)
            await self._start_segment(active)
        if self._storage.cold is not None:
            self._storage.cold.sealed()
        return self._pub_tail

    async def _start_segment(self, active: Segment) -> None:
        start = self._pub_tail
        segment = Segment(start, self.directory / layout.segment_filename(start), 0)
        header = fmt.encode_segment_header(self.meta.name, start, self.meta.content_type, self.meta.stream_id)
        await self._storage.run_io(self.writer.start_segment, active, segment, header)
        segment.size = len(header)
        self.segments.append(segment)

    async def make_durable(self) -> None:
        if self._storage.fsync != "always" and self.dirty:
            try:
                await self.sync()
            except OSError as error:
                raise from_os_error(error, f"sync of {self.meta.name!r}") from None

    async def sync(self) -> None:
        """Makes what this stream wrote durable (fsync=interval)."""
        async with self.exclusive():
            if self.deleted:
                return
            self.dirty = False
            try:
                await self._storage.run_io(self.writer.sync, self.active_segment)
            except OSError:
                self.dirty = True
                raise

    async def open_sealed(self, segment: Segment) -> int | None:
        """A descriptor of a sealed segment for the archiver to upload from, or None if the stream
        is gone. It stays valid whatever happens to the stream meanwhile."""
        async with self.exclusive():
            if self.deleted or not segment.local or segment.retained_away:
                return None
            return await self._storage.run_io(self._storage.fs.open, segment.path, os.O_RDONLY)

    async def record_upload(self, segment: Segment, entry: dict) -> bool:
        """Notes an uploaded, verified segment in the manifest (after writing its index sidecar).
        False if the stream was deleted or the segment retained away meanwhile (the object is then
        an orphan to delete)."""
        async with self.exclusive():
            if self.deleted or segment.retained_away:
                return False
            entries = [*self.cold_entries, entry]
            fs = self._storage.fs
            await self._storage.run_io(_record_upload, fs, segment.path, self.directory, entries)
            self.cold_entries = entries
            segment.cold_key = entry["key"]
            return True

    async def drop_local(self, segment: Segment) -> None:
        """Removes the local copy of an uploaded segment: its reads go to the bucket from now on."""
        async with self.exclusive():
            if self.deleted or not segment.local or segment.cold_key is None or segment.retained_away:
                return
            segment.local = False
            await self._storage.run_io(files.unlink_quietly, self._storage.fs, segment.path)

    # ---- retention (retention.py decides; this does it, crash-safely) ----------------

    async def raise_floor(self, new_floor: int, snapshot_end: int | None = None) -> bool:
        """Moves the floor readers see up to `new_floor` (a segment start), the checkpoint made
        durable before anything below it goes. False if there was nothing to move. A compaction
        passes where its snapshot (starting at `new_floor`) ends."""
        async with self.exclusive():
            if self.deleted or new_floor < self.floor or (new_floor == self.floor and snapshot_end is None):
                return False
            if snapshot_end is None and self.snapshot_end is not None and self.snapshot_end > new_floor:
                snapshot_end = self.snapshot_end  # retention below a snapshot keeps it in view
            checkpoint = self.checkpoint_at(new_floor, snapshot_end)
            try:
                if self.dirty:
                    # fsync=interval/never: the checkpoint must not claim producer state or a
                    # close whose records a power cut could still take back.
                    await self._storage.run_io(self.writer.sync, self.active_segment)
                    self.dirty = False
                await self._storage.run_io(floors.save, self._storage.fs, self.directory, checkpoint)
            except OSError as error:
                raise from_os_error(error, f"retention checkpoint of {self.meta.name!r}") from None
            self.floor = new_floor
            self.snapshot_end = snapshot_end
            return True

    async def drop_held(self, limit: int) -> tuple[int, list[str]]:
        """Deletes the sealed segments that end at or before `limit` (never past the floor): the
        manifest without them first, then their files, oldest first (docs/segment-format.md,
        "Retention"). Returns the bytes freed and the bucket keys to delete."""
        async with self.exclusive():
            limit = min(limit, self.floor)
            sealed = self.segments[:-1]
            count = 0
            while count < len(sealed) and self.segments[count + 1].start <= limit:
                count += 1
            if self.deleted or not count:
                return 0, []
            doomed = self.segments[:count]
            new_start = self.segments[count].start
            names = {segment.path.name for segment in doomed}
            entries = [entry for entry in self.cold_entries if entry["file"] not in names]
            keys = [segment.cold_key for segment in doomed if segment.cold_key is not None]
            for segment in doomed:
                segment.retained_away = True  # reads that hold it now answer 410
            fs = self._storage.fs
            # Saved even when the list in memory names none of them: an upload whose manifest
            # save failed after its rename (its directory sync) left a manifest on disk that
            # lists a doomed segment, and dropping its files under it lost the whole stream at
            # the next start (torture sim seed 3178).
            try:
                await self._storage.run_io(manifest.save_manifest, fs, self.directory, entries)
            except OSError as error:
                for segment in doomed:
                    segment.retained_away = False
                raise from_os_error(error, f"retention of {self.meta.name!r}") from None
            # From here the drop has happened (the floor and the manifest say so): files that
            # cannot be removed now are below the floor, removed by the next pass or at start.
            try:
                await self._storage.run_io(_drop_files, fs, self.directory, doomed)
            except OSError as error:
                log.warning("retention of %r: leftover files below the floor: %s", self.meta.name, error)
            freed = new_start - self.segments[0].start
            self.cold_entries = entries
            del self.segments[:count]
            self.index.drop_before(new_start)
            self._storage.budget.release(freed)
            return freed, keys

    # ---- reads ------------------------------------------------------------------------

    async def read(self, start: int, max_bytes: int, *, whole_messages: bool) -> ReadResult:
        tail = self._pub_tail
        if start >= tail:
            return ReadResult([], tail)
        index = self.index
        entries = index.entries
        first = index.find(start)
        if first < 0 or start < self.held_from:
            raise RetainedAway(self.floor, self.meta.incarnation)
        last = first + 1
        size = entries[first].length
        while last < len(entries) and size + entries[last].length <= max_bytes:
            size += entries[last].length
            last += 1
        # Taken before any await: retention may drop a prefix of the index meanwhile.
        chosen = entries[first:last]
        payloads = await self._payloads(chosen, index.dropped + first)
        messages: list[bytes] = []
        end = chosen[-1].end
        if whole_messages:
            for entry, payload in zip(chosen, payloads, strict=True):
                at, cut = entry.start, 0
                # A close-only append holds no message (a JSON value is never empty).
                for length in entry.messages or ([len(payload)] if payload else []):
                    if at >= start:
                        messages.append(payload[cut : cut + length])
                    at += length
                    cut += length
            return ReadResult(messages, end)
        head = payloads[0][start - chosen[0].start :]
        if len(head) > max_bytes:
            return ReadResult([head[:max_bytes]], start + max_bytes)
        return ReadResult([head, *payloads[1:]], end)

    async def _payloads(self, entries: list[Entry], first_key: int) -> list[bytes]:
        """The payloads of `entries`, whose first has tail-cache key `first_key`."""
        found: dict[int, bytes] = {}
        missing: dict[int, list[int]] = {}
        for number, entry in enumerate(entries):
            cached = self._cache.get(first_key + number)
            if cached is not None:
                found[number] = cached
            else:
                missing.setdefault(id(entry.segment), []).append(number)
        for numbers in missing.values():
            head, tail = entries[numbers[0]], entries[numbers[-1]]
            begin = head.payload_at
            data = await self._read_segment(head.segment, begin, tail.payload_at + tail.length - begin)
            for number in numbers:
                at = entries[number].payload_at - begin
                found[number] = data[at : at + entries[number].length]
        return [found[number] for number in range(len(entries))]

    async def _read_segment(self, segment: Segment, begin: int, length: int) -> bytes:
        storage = self._storage
        what = f"read of {self.meta.name!r}"
        if segment.local:
            try:
                data = await storage.run_io(files.pread_exact, storage.fs, segment.path, begin, length)
            except FileNotFoundError:
                # A delete may have moved the files away and not yet said so (it sets `deleted`
                # when its file work returns): a stream deleted meanwhile is a 404, not a 503.
                if self.deleting is not None:
                    await self.deleting.wait()
                if self.deleted:
                    raise StreamDeleted() from None
                if segment.retained_away:
                    raise RetainedAway(self.floor, self.meta.incarnation) from None
                if segment.cold_key is None:
                    raise StorageUnavailable(
                        f"{what}: segment file {segment.path.name} is missing", status=503
                    ) from None
                # It moved to the bucket while this read was on its way: read it there.
            except OSError as error:
                if self.deleted:
                    raise StreamDeleted() from None
                raise from_os_error(error, what) from None
            else:
                if self.deleted:
                    # The path may already hold a new stream's file of the same name: never serve it.
                    raise StreamDeleted()
                return data
        if storage.cold is None or segment.cold_key is None:
            raise StorageUnavailable(
                f"{segment.path.name} of {self.meta.name!r} is in the cold tier, which is off",
                status=503,
                code="cold_tier_unavailable",
            )
        try:
            return await storage.cold.read(segment.cold_key, begin, length)
        except Exception as error:  # S3 down, timeouts, missing objects: never wrong or partial data
            if segment.retained_away:
                raise RetainedAway(self.floor, self.meta.incarnation) from None
            if self.deleted:
                # Deleted while this read was on its way: its objects go once the delete is
                # durable (DiskStorage.delete), so a missing object is the delete, not the bucket.
                raise StreamDeleted() from None
            raise StorageUnavailable(
                f"the cold tier could not serve {self.meta.name!r}: {error}; retry shortly",
                status=503,
                code="cold_tier_unavailable",
            ) from None


def _drop_files(fs: FileSystem, directory: Path, doomed: list[Segment]) -> None:
    """The doomed segments' files, oldest first (the manifest no longer lists them): a crash
    leaves a suffix of them (recovery finishes a gap below the floor) and bucket objects no
    manifest lists, which `archive verify` finds."""
    for segment in doomed:
        files.unlink_quietly(fs, segment.path)
        files.unlink_quietly(fs, str(segment.path) + manifest.INDEX_SUFFIX)
    files.fsync_dir(fs, directory)


def _record_upload(fs: FileSystem, segment_path: Path, directory: Path, entries: list[dict]) -> None:
    """Index sidecar first, then the manifest: a manifest entry always has its sidecar."""
    manifest.write_index(fs, segment_path)
    manifest.save_manifest(fs, directory, entries)
