"""Disk storage: each stream is a directory of segment files (docs/segment-format.md).

A `DiskLog` is one stream: what its actor has accepted, what is durable and shown to readers, and
where every published record lives. Appends queue in the log; the `Committer` (committer.py) writes
and syncs them in rounds through the stream's `SegmentWriter` (writer.py) and publishes them.

Every operation that touches a stream's files (a commit round, sealing an idle segment, a
background sync, recording an upload, dropping a local copy, deleting the stream) holds the
stream's I/O lock, so none of them can close, replace or delete a file another is using. A delete
first lets the commits already accepted land (they happened before the delete), then takes the
lock, so an append racing a DELETE either lands in the old stream or is answered 404, and the
stream's descriptor is closed before its files go: nothing stays open on a deleted file.

With `fsync=always` an append is published (acknowledged, visible to readers) only after it is
synced. `interval` publishes after the write and syncs dirty streams every `fsync_interval`;
`never` leaves syncing to the OS. In every mode a segment is synced before it is sealed. What each
mode promises across a process crash and a power cut is in docs/segment-format.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import trio

from streamkeep.background import supervised
from streamkeep.health import Health
from streamkeep.protocol.stream import ProducerMark, ProducerState, StreamMeta
from streamkeep.segments import format as fmt
from streamkeep.segments import layout
from streamkeep.storage import files, manifest
from streamkeep.storage.base import AppendRecord, ByteBudget, Commit, ReadResult, resolved
from streamkeep.storage.committer import Batch, Committer, RoundSettings
from streamkeep.storage.directory import DataDirectory, FormatError
from streamkeep.storage.errors import (
    StorageUnavailable,
    StreamDeleted,
    below_reserve,
    from_os_error,
    not_durable,
)
from streamkeep.storage.files import FileSystem
from streamkeep.storage.index import Entry, RecordIndex, Segment, TailCache
from streamkeep.storage.meta import encode_meta
from streamkeep.storage.recovery import Loaded, RecoveryReport, recover
from streamkeep.storage.tiering import ColdTier
from streamkeep.storage.writer import Pending, ReadOnly, SegmentLimits, SegmentWriter, plan_batch

log = logging.getLogger(__name__)

FSYNC_POLICIES = ("always", "interval", "never")
RunSync = Callable[..., Awaitable[Any]]


class DiskLog:
    def __init__(self, storage: DiskStorage, directory: Path, meta: StreamMeta) -> None:
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
        self.cold_entries: list[dict] = []  # the manifest: segments uploaded to the cold tier

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
            self._cache.put(len(self.index) - 1, payload)

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
                f"stream {self.meta.name!r} takes no appends: {self.writer.read_only}", status=503
            )
        blocked = storage.cold.appends_blocked() if storage.cold is not None else None
        if blocked is not None:
            raise StorageUnavailable(blocked, status=503)
        added = sum(len(m) for m in record.messages)
        storage.budget.reserve(self._tail - self.meta.fork_base, added)
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
        if isinstance(error, OSError):
            return from_os_error(error, what)
        if isinstance(error, ReadOnly):
            return StorageUnavailable(f"{what}: {error}", status=503)
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
        # Undo the failed appends only: fork links and soft deletion are not part of them.
        self.meta = replace(
            self._durable_meta,
            last_access=self.meta.last_access,
            fork_count=self.meta.fork_count,
            soft_deleted=self.meta.soft_deleted,
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
            if self._queue or self.deleted or not active.appends:
                return False
            start = self._pub_tail
            segment = Segment(start, self.directory / layout.segment_filename(start), 0)
            header = fmt.encode_segment_header(
                self.meta.name, start, self.meta.content_type, self.meta.stream_id
            )
            await self._storage.run_io(self.writer.start_segment, active, segment, header)
            segment.size = len(header)
            self.segments.append(segment)
        if self._storage.cold is not None:
            self._storage.cold.sealed()
        return True

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
            if self.deleted or not segment.local:
                return None
            return await self._storage.run_io(self._storage.fs.open, segment.path, os.O_RDONLY)

    async def record_upload(self, segment: Segment, entry: dict) -> bool:
        """Notes an uploaded, verified segment in the manifest (after writing its index sidecar).
        False if the stream was deleted meanwhile (the object is then an orphan to delete)."""
        async with self.exclusive():
            if self.deleted:
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
            if self.deleted or not segment.local or segment.cold_key is None:
                return
            segment.local = False
            await self._storage.run_io(files.unlink_quietly, self._storage.fs, segment.path)

    # ---- reads ------------------------------------------------------------------------

    async def read(self, start: int, max_bytes: int, *, whole_messages: bool) -> ReadResult:
        tail = self._pub_tail
        if start >= tail:
            return ReadResult([], tail)
        entries = self.index.entries
        first = self.index.find(start)
        last = first + 1
        size = entries[first].length
        while last < len(entries) and size + entries[last].length <= max_bytes:
            size += entries[last].length
            last += 1
        payloads = await self._payloads(first, last)
        messages: list[bytes] = []
        end = entries[last - 1].end
        if whole_messages:
            for entry, payload in zip(entries[first:last], payloads, strict=True):
                at, cut = entry.start, 0
                # A close-only append holds no message (a JSON value is never empty).
                for length in entry.messages or ([len(payload)] if payload else []):
                    if at >= start:
                        messages.append(payload[cut : cut + length])
                    at += length
                    cut += length
            return ReadResult(messages, end)
        head = payloads[0][start - entries[first].start :]
        if len(head) > max_bytes:
            return ReadResult([head[:max_bytes]], start + max_bytes)
        return ReadResult([head, *payloads[1:]], end)

    async def _payloads(self, first: int, last: int) -> list[bytes]:
        entries = self.index.entries
        found: dict[int, bytes] = {}
        missing: dict[int, list[int]] = {}
        for index in range(first, last):
            cached = self._cache.get(index)
            if cached is not None:
                found[index] = cached
            else:
                missing.setdefault(id(entries[index].segment), []).append(index)
        for indexes in missing.values():
            head, tail = entries[indexes[0]], entries[indexes[-1]]
            begin = head.payload_at
            data = await self._read_segment(head.segment, begin, tail.payload_at + tail.length - begin)
            for index in indexes:
                at = entries[index].payload_at - begin
                found[index] = data[at : at + entries[index].length]
        return [found[index] for index in range(first, last)]

    async def _read_segment(self, segment: Segment, begin: int, length: int) -> bytes:
        storage = self._storage
        what = f"read of {self.meta.name!r}"
        if segment.local:
            try:
                data = await storage.run_io(files.pread_exact, storage.fs, segment.path, begin, length)
            except FileNotFoundError:
                if self.deleted:
                    raise StreamDeleted() from None
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
                f"{segment.path.name} of {self.meta.name!r} is in the cold tier, which is off", status=503
            )
        try:
            return await storage.cold.read(segment.cold_key, begin, length)
        except Exception as error:  # S3 down, timeouts, missing objects: never wrong or partial data
            raise StorageUnavailable(
                f"the cold tier could not serve {self.meta.name!r}: {error}; retry shortly", status=503
            ) from None


def _record_upload(fs: FileSystem, segment_path: Path, directory: Path, entries: list[dict]) -> None:
    """Index sidecar first, then the manifest: a manifest entry always has its sidecar."""
    manifest.write_index(fs, segment_path)
    manifest.save_manifest(fs, directory, entries)


class DiskStorage:
    def __init__(
        self,
        root: Path,
        *,
        budget: ByteBudget,
        fsync: str = "always",
        fsync_interval: float = 1.0,
        segment_max_bytes: int = 64 << 20,
        segment_max_messages: int = 100_000,
        segment_max_age: float = 0.0,
        io_threads: int = 32,
        cache_bytes: int = 256 << 10,
        commit_group: int = 2,
        sync_method: str = "fdatasync",
        min_free_bytes: int = 0,
        fs: FileSystem = files.OS,
        run_sync: RunSync | None = None,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}")
        if sync_method not in ("fdatasync", "syncfs"):
            raise ValueError("sync_method must be fdatasync or syncfs")
        self.root = root
        self.fs = fs
        self.directory = DataDirectory(fs, root)
        self.budget = budget
        self.fsync = fsync
        self.fsync_interval = fsync_interval
        self.sync_method = sync_method
        self.min_free_bytes = min_free_bytes
        self.segment_max_age = segment_max_age  # seconds; 0 turns age-based sealing off
        self.limits = SegmentLimits(segment_max_bytes, segment_max_messages, segment_max_age)
        self.cache_bytes = cache_bytes
        self._limiter = trio.CapacityLimiter(io_threads)
        self._run_sync: RunSync = run_sync or trio.to_thread.run_sync
        self._logs: dict[str, DiskLog] = {}
        self.root_fd = -1
        self.health = Health()
        self.committer = Committer(
            self.run_io,
            RoundSettings(fsync == "always", sync_method == "syncfs", min_free_bytes),
            commit_group,
            free_bytes=lambda: fs.free_bytes(root),
            syncfs=lambda: fs.syncfs(self.root_fd),
        )
        self.cold: ColdTier | None = None

    # ---- plumbing -------------------------------------------------------------------

    async def run_io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._run_sync(fn, *args, limiter=self._limiter)

    async def start(self, nursery: trio.Nursery) -> RecoveryReport:
        """Recovers every stream from disk, then starts committing (and syncing, fsync=interval)."""
        version = await self.run_io(self.directory.open)
        if version != layout.FORMAT_VERSION:
            raise FormatError(
                f"{self.root} is in format {version}; this version needs format {layout.FORMAT_VERSION}: "
                "run `streamkeep migrate` (or start with `streamkeep serve`, which upgrades it)"
            )
        report = await self.run_io(self._recover_all)
        self.root_fd = await self.run_io(self.fs.open, self.root, os.O_RDONLY)
        try:
            unclean = await self.run_io(self.directory.mark_running)
        except OSError as error:
            log.warning(
                "cannot note the start in %s (%s); treating the last stop as a crash", self.root, error
            )
            unclean = True
        if unclean:
            await self._after_a_crash()
        nursery.start_soon(supervised, "committer", self.committer.run, self.health)
        if self.fsync == "interval":
            nursery.start_soon(supervised, "interval sync", self._sync_loop, self.health)
        return report

    async def _after_a_crash(self) -> None:
        """The last server did not stop cleanly. What recovery read may be only in the page cache:
        a reader must never be shown bytes a power cut could still take back, so it is synced
        now. Under --fsync interval a sync that failed before the crash may have dropped
        acknowledged bytes from the dirty set for good (a later fsync would report success
        without writing them), so each stream's active segment is also written again, through
        a fresh descriptor, at its first sync."""
        try:
            await self.run_io(self.fs.syncfs, self.root_fd)
        except OSError as error:
            self.health.failed("crash recovery sync", str(error))
        if self.fsync == "interval":
            for stream_log in self._logs.values():
                stream_log.writer.needs_repair = True
                stream_log.writer.synced_size = None
                stream_log.dirty = True

    async def stop(self) -> None:
        """At shutdown, once nothing else runs: syncs what fsync=interval/never left unsynced (a
        clean stop loses nothing to a later power cut), closes every descriptor, and notes the
        clean stop so the next start needs no crash recovery."""
        clean = True
        for stream_log in list(self._logs.values()):
            if stream_log.writer.needs_repair and stream_log.writer.read_only is None:
                try:  # a failed write not yet cut back: cut it now, not at the next start
                    async with stream_log.exclusive():
                        await self.run_io(stream_log.writer.repair, stream_log.active_segment)
                except (OSError, ReadOnly) as error:
                    clean = False
                    log.error("shutdown: repairing %r failed: %s", stream_log.meta.name, error)
            if self.fsync != "always" and (stream_log.writer.open_fd() is not None or stream_log.dirty):
                try:
                    await stream_log.sync()
                except OSError as error:
                    clean = False
                    log.error("shutdown: syncing %r failed: %s", stream_log.meta.name, error)
        self.close()
        if clean:
            try:
                await self.run_io(self.directory.mark_stopped)
            except OSError as error:
                log.error("shutdown: cannot note the clean stop: %s", error)

    def close(self) -> None:
        if self.root_fd >= 0:
            self.fs.close(self.root_fd)
            self.root_fd = -1
        for stream_log in self._logs.values():
            stream_log.writer.close()

    async def _sync_loop(self) -> None:
        while True:
            await trio.sleep(self.fsync_interval)
            for stream_log in list(self._logs.values()):
                if not stream_log.dirty:
                    continue
                try:
                    await stream_log.sync()
                except OSError as error:
                    self.health.failed("interval sync", f"{stream_log.meta.name!r}: {error}")
                else:
                    self.health.ok("interval sync")

    # ---- the Storage interface --------------------------------------------------------

    def open(self, name: str) -> DiskLog | None:
        return self._logs.get(name)

    def logs(self) -> list[DiskLog]:
        return list(self._logs.values())

    def names(self) -> list[str]:
        return list(self._logs)

    async def create(self, meta: StreamMeta, messages: list[bytes]) -> DiskLog:
        added = sum(len(m) for m in messages)
        self.budget.reserve(0, added)
        time_ms = int(time.time() * 1000)
        base = meta.fork_base
        segment_bytes = fmt.encode_segment_header(meta.name, base, meta.content_type, meta.stream_id)
        header_len = len(segment_bytes)
        initial = None
        if messages or meta.closed:
            initial = fmt.encode_append(base, time_ms, messages, closes=meta.closed)
            segment_bytes += initial
        directory = self.directory.stream_dir(meta.name)
        contents = {layout.META: encode_meta(meta), layout.segment_filename(base): segment_bytes}
        uncertain = None
        try:
            await self.run_io(self._create_files, directory, contents)
        except files.NotDurable as error:  # it exists, but a power cut may take it back
            uncertain = not_durable(f"create of {meta.name!r}", error)
        except (OSError, StorageUnavailable) as error:
            self.budget.release(added)
            if isinstance(error, StorageUnavailable):
                raise
            raise from_os_error(error, f"create of {meta.name!r}") from None
        stream_log = DiskLog(self, directory, replace(meta, closed=False))
        segment = Segment(base, directory / layout.segment_filename(base), header_len)
        stream_log.segments.append(segment)
        if initial is not None:
            record = fmt.decode_at(segment_bytes, header_len)
            stream_log.index_record(segment, record, record.payload)
        stream_log.adopt_durable_state(time_ms)
        stream_log.writer.synced_size = len(segment_bytes)
        stream_log.meta.last_access = meta.last_access
        self._logs[meta.name] = stream_log
        if uncertain is not None:
            raise uncertain
        return stream_log

    def _create_files(self, directory: Path, contents: dict[str, bytes]) -> None:
        if self.min_free_bytes:
            free = self.fs.free_bytes(self.root)
            if free - sum(len(data) for data in contents.values()) < self.min_free_bytes:
                raise below_reserve(f"create of {directory.name}", free, self.min_free_bytes)
        self.directory.create_stream(directory, contents)

    async def delete(self, name: str) -> None:
        stream_log = self._logs.get(name)
        if stream_log is None:
            return
        await stream_log.drain()  # appends accepted before the delete land first
        async with stream_log.io_lock:
            if self._logs.get(name) is not stream_log:
                return
            keys = [entry["key"] for entry in stream_log.cold_entries]
            try:
                pending, uncertain = await self.run_io(self._delete_files, stream_log, keys)
            except OSError as error:
                raise from_os_error(error, f"delete of {name!r}") from None
            stream_log.deleted = True
            del self._logs[name]
        self.budget.release(stream_log.tail - stream_log.meta.fork_base)
        if uncertain is not None:  # its objects stay: a power cut may bring the stream back
            raise not_durable(f"delete of {name!r}", uncertain)
        if keys and self.cold is not None:
            self.cold.forget(pending, keys)

    def _delete_files(
        self, stream_log: DiskLog, keys: list[str]
    ) -> tuple[Path | None, files.NotDurable | None]:
        stream_log.writer.close()
        return self.directory.delete_stream(stream_log.directory, keys)

    async def save_meta(self, name: str, meta: StreamMeta) -> None:
        stream_log = self._logs.get(name)
        if stream_log is None:
            return
        async with stream_log.exclusive():
            try:
                await self.run_io(
                    files.replace, self.fs, stream_log.directory, layout.META, encode_meta(meta)
                )
            except OSError as error:
                raise from_os_error(error, f"update of {name!r}") from None

    def pending_object_deletes(self) -> list[tuple[Path, list[str]]]:
        return self.directory.pending_object_deletes()

    def stats(self) -> dict:
        try:
            free = self.fs.free_bytes(self.root)
        except OSError:
            free = None
        return {
            "free_bytes": free,
            "min_free_bytes": self.min_free_bytes,
            "commit_rounds": self.committer.rounds,
            **self.health.stats(),
            "read_only_streams": sorted(n for n, s in self._logs.items() if s.writer.read_only is not None),
        }

    # ---- recovery ---------------------------------------------------------------------

    def _recover_all(self) -> RecoveryReport:
        report = recover(self.fs, self.directory, self._adopt)
        self._link_forks(report)
        report.bytes = self.budget.total_bytes
        return report

    def _adopt(self, loaded: Loaded) -> DiskLog:
        stream_log = DiskLog(self, loaded.directory, loaded.meta)
        stream_log.cold_entries = loaded.cold_entries
        stream_log.segments = loaded.segments
        for segment, record in loaded.records:
            stream_log.index_record(segment, record, None)
        stream_log.adopt_durable_state(loaded.last_ms)
        if self.fsync == "always":  # what recovery read was synced before it was acknowledged
            stream_log.writer.synced_size = stream_log.active_segment.size
        stream_log.writer.needs_repair = loaded.needs_repair
        self._logs[stream_log.meta.name] = stream_log
        self.budget.total_bytes += stream_log.tail - stream_log.meta.fork_base
        return stream_log

    def _link_forks(self, report: RecoveryReport) -> None:
        """Counts each stream's live forks, and finishes cascading deletes a crash interrupted:
        a soft-deleted stream that no fork reads any more is removed."""
        for stream_log in self._logs.values():
            source = stream_log.meta.forked_from
            if source is None:
                continue
            parent = self._logs.get(source)
            if parent is None:
                log.error(
                    "recovery: fork %r has lost its source %r; its inherited range cannot be read",
                    stream_log.meta.name,
                    source,
                )
                report.skipped.append(f"{stream_log.meta.name}: source {source!r} missing")
                continue
            if parent.published_tail < stream_log.meta.fork_base:
                log.error(
                    "recovery: fork %r inherits up to position %d of %r, which ends at %d; reads of "
                    "the missing range will fail",
                    stream_log.meta.name,
                    stream_log.meta.fork_base,
                    source,
                    parent.published_tail,
                )
                report.skipped.append(f"{stream_log.meta.name}: source {source!r} ends before the fork point")
            parent.meta.fork_count += 1
        removed = True
        while removed:
            removed = False
            for name, stream_log in list(self._logs.items()):
                if stream_log.meta.soft_deleted and stream_log.meta.fork_count == 0:
                    try:
                        self._delete_files(stream_log, [entry["key"] for entry in stream_log.cold_entries])
                    except (
                        OSError
                    ) as error:  # a full or failing disk: it stays soft-deleted until the next start
                        log.warning("recovery: %s: cannot finish deleting it now: %s", name, error)
                        continue
                    del self._logs[name]
                    self.budget.total_bytes -= stream_log.tail - stream_log.meta.fork_base
                    parent = self._logs.get(stream_log.meta.forked_from or "")
                    if parent is not None:
                        parent.meta.fork_count -= 1
                    report.repaired.append(f"{name}: finished deleting (its last fork was gone)")
                    log.warning("recovery: %s: finished deleting; its last fork was gone", name)
                    removed = True
