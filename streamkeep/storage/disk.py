"""Disk storage: each stream is a directory of segment files (streamkeep/segments/format.py).

Durability: one append is one CRC-checked record written with one write. With `fsync=always` an
append is published (acknowledged, visible to readers) only after it is synced. A single
`Committer` task runs rounds: each round writes the queued appends of every stream and syncs them,
so appends arriving while a round is in flight, on any stream, share the next one. Syncing is one
fdatasync per file, in parallel groups of two files per worker thread (concurrent fdatasyncs on ext4
share journal commits), or, with `sync_method="syncfs"`, one syncfs() for the whole round: fastest,
but it also flushes everything else on that file system, so use it on a dedicated data volume. `interval`
publishes after the write and syncs dirty streams every `fsync_interval`; `never` leaves syncing to
the OS. All blocking I/O runs in trio threads under one CapacityLimiter.

Recovery (`start`) reads every stream directory, verifies every record, truncates a torn tail of the
last segment, and rebuilds producer state, the closed flag and Stream-Seq from the records.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import time
import uuid
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import cbor2
import trio

from streamkeep.protocol.stream import ProducerMark, ProducerState, StreamMeta
from streamkeep.segments import format as fmt
from streamkeep.segments import layout
from streamkeep.storage import cold, files
from streamkeep.storage.base import AppendRecord, ByteBudget, Commit, ReadResult, StorageUnavailable, resolved
from streamkeep.storage.cold import Archiver, ColdConfig, ColdStore

log = logging.getLogger(__name__)

FSYNC_POLICIES = ("always", "interval", "never")


@dataclass
class Segment:
    start: int
    path: Path
    size: int  # bytes written and published
    appends: int  # append records in it
    cold_key: str | None = None  # its object in the bucket, once uploaded and verified
    local: bool = True  # False once the local copy is gone: reads go to the bucket
    first_ms: int | None = None  # append time of its first record: the segment's age


@dataclass
class _Pending:
    record: AppendRecord
    start: int
    commit: Commit
    time_ms: int


@dataclass
class _WritePlan:
    """Bytes to write for one batch: per segment, where and what; new segments get created."""

    parts: list[tuple[Segment, int, bytes, bool]] = field(default_factory=list)  # seg, offset, data, new
    # per pending append: its segment, where its payload starts there, and its record header
    entries: list[tuple[Segment, int, dict]] = field(default_factory=list)


def _unavailable(error: OSError, what: str) -> StorageUnavailable:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageUnavailable(f"{what}: the disk is full; free space or raise quotas", status=507)
    return StorageUnavailable(f"{what}: {error.strerror or error}; retry shortly", status=503)


def encode_meta(meta: StreamMeta) -> bytes:
    return cbor2.dumps(
        {
            "v": 1,
            "name": meta.name,
            "id": meta.stream_id,
            "ct": meta.content_type,
            "created": meta.created_at,
            "ttl": meta.ttl_seconds,
            "exp": meta.expires_at,
            "exp_ts": meta.expires_at_ts,
            "from": meta.forked_from,
            "base": meta.fork_base,
            "foff": meta.fork_offset,
            "fsub": meta.fork_sub_offset,
            "deleted": meta.soft_deleted,
        }
    )


def decode_meta(data: bytes) -> StreamMeta:
    raw = cbor2.loads(data)
    return StreamMeta(
        name=raw["name"],
        stream_id=raw["id"],
        content_type=raw["ct"],
        created_at=raw["created"],
        ttl_seconds=raw.get("ttl"),
        expires_at=raw.get("exp"),
        expires_at_ts=raw.get("exp_ts"),
        forked_from=raw.get("from"),
        fork_base=raw.get("base") or 0,
        fork_offset=raw.get("foff"),
        fork_sub_offset=raw.get("fsub") or 0,
        soft_deleted=bool(raw.get("deleted")),
    )


class DiskLog:
    def __init__(self, storage: DiskStorage, directory: Path, meta: StreamMeta) -> None:
        self._storage = storage
        self.directory = directory
        self.meta = meta  # accepted
        self.producers: dict[str, ProducerState] = {}
        self.on_publish: Callable[[], None] | None = None
        self.segments: list[Segment] = []
        self._tail = meta.fork_base
        # published (durable) state
        self._pub_tail = meta.fork_base
        self._pub_closed = False
        self._durable_meta = replace(meta)
        self._durable_producers: dict[str, ProducerState] = {}
        # index of published records
        self._rec_starts: list[int] = []
        self._rec_lens: list[int] = []
        self._rec_seg: list[Segment] = []
        self._rec_payload_at: list[int] = []
        self._rec_messages: list[list[int] | None] = []
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cache_bytes = 0
        self._queue: list[_Pending] = []
        self._committing = False
        self._latest: Commit = resolved(0)
        self._write_fd: int | None = None
        self.dirty = False
        self.deleted = False
        self.cold_entries: list[dict] = []  # the manifest: segments uploaded to the cold tier
        self._sealing = False

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

    def latest_commit(self) -> Commit:
        return self._latest

    def next_append_end(self, position: int) -> int | None:
        index = bisect_right(self._rec_starts, position) - 1
        if index < 0 or position >= self._pub_tail:
            return None
        return self._rec_starts[index] + self._rec_lens[index]

    def is_boundary(self, position: int) -> bool:
        if position in (self.meta.fork_base, self._pub_tail):
            return True
        index = bisect_right(self._rec_starts, position) - 1
        if index < 0 or position > self._pub_tail:
            return False
        at = self._rec_starts[index]
        if at == position:
            return True
        for length in self._rec_messages[index] or ():
            at += length
            if at == position:
                return True
        return False

    # ---- loading (recovery) -----------------------------------------------------------

    def index_record(self, segment: Segment, record: fmt.Record, payload: bytes | None) -> None:
        """Adds a durable record to the published state (used by recovery and by publishing)."""
        self._rec_starts.append(record.start)
        self._rec_lens.append(record.payload_len)
        self._rec_seg.append(segment)
        self._rec_payload_at.append(record.payload_offset)
        lengths = record.message_lengths
        self._rec_messages.append(lengths if len(lengths) > 1 else None)
        self._pub_tail = record.start + record.payload_len
        if segment.appends == 0:
            segment.first_ms = record.time_ms
        segment.appends += 1
        segment.size = record.end
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
            self._remember(len(self._rec_starts) - 1, payload)

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
        added = sum(len(m) for m in record.messages)
        archiver = self._storage.archiver
        if archiver is not None and archiver.backlog_bytes > archiver.config.high_water_bytes:
            raise StorageUnavailable(
                "sealed segments are waiting for the cold tier (is S3 reachable?); retry shortly", status=503
            )
        self._storage.budget.reserve(self._tail - self.meta.fork_base, added)
        pending = _Pending(record, self._tail, Commit(), int(time.time() * 1000))
        self._tail += added
        # The record's meta is a fresh copy made for this append; only last_access is ever
        # written in place afterwards, so sharing it is safe and saves a copy per append.
        self.meta = record.meta
        if record.producer is not None:
            self.producers[record.producer[0]] = record.producer[1]
        self._queue.append(pending)
        self._latest = pending.commit
        self._storage.committer.wake(self)
        return pending.commit

    def take_batch(self) -> tuple[list[_Pending], _WritePlan] | None:
        """For the committer: everything queued since the last round, laid out for writing."""
        if not self._queue or self._sealing:
            return None  # a seal in progress wakes the committer again when it is done
        batch, self._queue = self._queue, []
        if self.deleted:  # deleted meanwhile: those appends happened before the delete
            for pending in batch:
                pending.commit.resolve(pending.start + sum(len(m) for m in pending.record.messages))
            return None
        self._committing = True
        return batch, self._layout(batch)

    def finish_batch(self, batch: list[_Pending], plan: _WritePlan, error: OSError | None) -> None:
        self._committing = False
        if error is None:
            self._publish(batch, plan)
            return
        self._fail(batch + self._queue, _unavailable(error, f"append to {self.meta.name!r}"))
        self._queue = []

    def _layout(self, batch: list[_Pending]) -> _WritePlan:
        storage = self._storage
        plan = _WritePlan()
        segment = self.segments[-1]
        size, appends = segment.size, segment.appends
        buffer: list[bytes] = []
        offset = size
        new = False
        too_old = (
            storage.segment_max_age
            and segment.first_ms is not None
            and (time.time() * 1000 - segment.first_ms >= storage.segment_max_age * 1000)
        )
        for pending in batch:
            if appends and (
                size >= storage.segment_max_bytes or appends >= storage.segment_max_messages or too_old
            ):
                too_old = False
                if buffer:
                    plan.parts.append((segment, offset, b"".join(buffer), new))
                segment = Segment(
                    pending.start, self.directory / layout.segment_filename(pending.start), 0, 0
                )
                header = fmt.encode_segment_header(
                    self.meta.name, pending.start, self.meta.content_type, self.meta.stream_id
                )
                buffer, offset, size, appends, new = [header], 0, len(header), 0, True
            record = pending.record
            producer = record.producer
            header = fmt.append_header(
                pending.start,
                pending.time_ms,
                [len(m) for m in record.messages],
                producer=(producer[0], producer[1].epoch, producer[1].last_seq) if producer else None,
                closes=record.closes,
                stream_seq=record.stream_seq,
            )
            payload = b"".join(record.messages)
            data = fmt.frame_append(header, payload)
            plan.entries.append((segment, size + len(data) - len(payload), header))
            buffer.append(data)
            size += len(data)
            appends += 1
        plan.parts.append((segment, offset, b"".join(buffer), new))
        return plan

    @property
    def storage_sync_method(self) -> str:
        return self._storage.sync_method

    def directory_fd(self) -> int:
        return self._storage.root_fd

    def write_plan(self, plan: _WritePlan, sync: bool = True) -> None:
        """In a worker thread: write (and sync) one batch; on error, undo it and re-raise."""
        sync = sync and self._storage.fsync == "always"
        written: list[tuple[Segment, int, bool]] = []
        try:
            for segment, offset, data, new in plan.parts:
                if new:
                    fd = os.open(segment.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    written.append((segment, offset, True))
                    os.pwrite(fd, data, 0)
                    os.fsync(fd)  # a sealed predecessor and a new file: make both durable now
                    files.fsync_dir(files.OS, self.directory)
                    if self._write_fd is not None:
                        os.close(self._write_fd)
                    self._write_fd = fd
                else:
                    fd = self._active_fd(segment)
                    written.append((segment, offset, False))
                    os.pwrite(fd, data, offset)
                    if sync:
                        os.fdatasync(fd)
        except OSError:
            for segment, offset, new in reversed(written):
                try:
                    if new:
                        os.unlink(segment.path)
                    else:
                        os.truncate(segment.path, offset)
                except OSError:
                    pass
            if written and written[-1][2] and self._write_fd is not None:
                os.close(self._write_fd)
                self._write_fd = None
            raise
        if not sync:
            self.dirty = True

    async def seal_idle(self) -> bool:
        """Seals the active segment of a stream nobody is appending to (for --segment-max-age):
        a new, empty segment takes its place, so the old one can move to the cold tier."""
        active = self.segments[-1]
        if self._queue or self._committing or self._sealing or not active.appends or self.deleted:
            return False
        self._sealing = True
        try:
            start = self._pub_tail
            segment = Segment(start, self.directory / layout.segment_filename(start), 0, 0)
            header = fmt.encode_segment_header(
                self.meta.name, start, self.meta.content_type, self.meta.stream_id
            )
            await self._storage.io(self._start_segment, segment, header)
            segment.size = len(header)
            self.segments.append(segment)
        finally:
            self._sealing = False
            if self._queue:
                self._storage.committer.wake(self)
        return True

    def _start_segment(self, segment: Segment, header: bytes) -> None:
        files.write_new(files.OS, segment.path, header)
        files.fsync_dir(files.OS, self.directory)
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None

    def _active_fd(self, segment: Segment) -> int:
        if self._write_fd is None:
            self._write_fd = os.open(segment.path, os.O_WRONLY)
        return self._write_fd

    def _publish(self, batch: list[_Pending], plan: _WritePlan) -> None:
        for pending, (segment, payload_at, header) in zip(batch, plan.entries, strict=True):
            if segment is not self.segments[-1]:
                self.segments.append(segment)  # the first append of a segment this batch rotated to
                if self._storage.archiver is not None:
                    self._storage.archiver.kick()
            payload = b"".join(pending.record.messages)
            record = fmt.Record(fmt.KIND_APPEND, header, 0, payload_at, len(payload), payload)
            self.index_record(segment, record, payload)
            self._durable_meta = pending.record.meta
            pending.commit.resolve(self._pub_tail)
        if self.on_publish is not None:
            self.on_publish()

    def _fail(self, pending: list[_Pending], error: StorageUnavailable) -> None:
        log.error("stream %r: %s", self.meta.name, error)
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
        for item in pending:
            item.commit.fail(error)

    # ---- reads ------------------------------------------------------------------------

    def _remember(self, index: int, payload: bytes) -> None:
        limit = self._storage.cache_bytes
        if len(payload) > limit:
            return
        self._cache[index] = payload
        self._cache_bytes += len(payload)
        while self._cache_bytes > limit:
            _, dropped = self._cache.popitem(last=False)
            self._cache_bytes -= len(dropped)

    async def read(self, start: int, max_bytes: int, *, whole_messages: bool) -> ReadResult:
        tail = self._pub_tail
        if start >= tail:
            return ReadResult([], tail)
        first = bisect_right(self._rec_starts, start) - 1
        last = first + 1
        size = self._rec_lens[first]
        while last < len(self._rec_starts) and size + self._rec_lens[last] <= max_bytes:
            size += self._rec_lens[last]
            last += 1
        payloads = await self._payloads(first, last)
        messages: list[bytes] = []
        if whole_messages:
            for index, payload in zip(range(first, last), payloads, strict=True):
                at, cut = self._rec_starts[index], 0
                for length in self._rec_messages[index] or [len(payload)]:
                    if at >= start:
                        messages.append(payload[cut : cut + length])
                    at += length
                    cut += length
            end = self._rec_starts[last - 1] + self._rec_lens[last - 1]
            return ReadResult(messages, end)
        head = payloads[0][start - self._rec_starts[first] :]
        if len(head) > max_bytes:
            return ReadResult([head[:max_bytes]], start + max_bytes)
        messages = [head, *payloads[1:]]
        return ReadResult(messages, self._rec_starts[last - 1] + self._rec_lens[last - 1])

    async def _payloads(self, first: int, last: int) -> list[bytes]:
        found: dict[int, bytes] = {}
        missing: dict[int, list[int]] = {}
        for index in range(first, last):
            cached = self._cache.get(index)
            if cached is not None:
                found[index] = cached
            else:
                missing.setdefault(id(self._rec_seg[index]), []).append(index)
        for indexes in missing.values():
            segment = self._rec_seg[indexes[0]]
            begin = self._rec_payload_at[indexes[0]]
            end = self._rec_payload_at[indexes[-1]] + self._rec_lens[indexes[-1]]
            data = await self._read_segment(segment, begin, end - begin)
            for index in indexes:
                at = self._rec_payload_at[index] - begin
                found[index] = data[at : at + self._rec_lens[index]]
        return [found[index] for index in range(first, last)]

    async def _read_segment(self, segment: Segment, begin: int, length: int) -> bytes:
        storage = self._storage
        if segment.local:
            try:
                return await storage.io(_pread, segment.path, begin, length)
            except FileNotFoundError:
                if segment.cold_key is None:
                    raise _unavailable(
                        OSError("segment file missing"), f"read of {self.meta.name!r}"
                    ) from None
                # It moved to the bucket while this read was on its way: read it there.
            except OSError as error:
                raise _unavailable(error, f"read of {self.meta.name!r}") from None
        if storage.archiver is None or segment.cold_key is None:
            raise StorageUnavailable(
                f"{segment.path.name} of {self.meta.name!r} is in the cold tier, which is off", status=503
            )
        try:
            return await storage.archiver.read(segment.cold_key, begin, length)
        except Exception as error:  # S3 down, timeouts, missing objects: never wrong or partial data
            raise StorageUnavailable(
                f"the cold tier could not serve {self.meta.name!r}: {error}; retry shortly", status=503
            ) from None

    def close_files(self) -> None:
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None

    def sync(self) -> None:
        """In a worker thread: fdatasync a stream written under fsync=interval."""
        self.dirty = False
        if self._write_fd is not None:
            os.fdatasync(self._write_fd)


def _pread(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


class Committer:
    """Group commit across streams: one round writes and syncs every stream that has queued
    appends, in one worker-thread call (split into parallel groups when many are dirty, since
    concurrent fdatasyncs on ext4 share journal commits). Appends queued during a round share the
    next one."""

    def __init__(self, storage: DiskStorage, group_size: int) -> None:
        self._storage = storage
        self._group_size = group_size
        self._dirty: dict[DiskLog, None] = {}
        self._work = trio.Event()

    def wake(self, stream_log: DiskLog) -> None:
        self._dirty[stream_log] = None
        self._work.set()

    async def run(self) -> None:
        while True:
            await self._work.wait()
            self._work = trio.Event()
            while self._dirty:
                logs, self._dirty = list(self._dirty), {}
                work = [(stream_log, *taken) for stream_log in logs if (taken := stream_log.take_batch())]
                if not work:
                    continue
                groups = [work[i : i + self._group_size] for i in range(0, len(work), self._group_size)]
                errors: dict[DiskLog, OSError | None] = {}
                async with trio.open_nursery() as nursery:
                    for group in groups:
                        nursery.start_soon(self._write_group, group, errors)
                for stream_log, batch, plan in work:
                    stream_log.finish_batch(batch, plan, errors.get(stream_log))

    async def _write_group(self, group: list, errors: dict) -> None:  # type: ignore[type-arg]
        results = await self._storage.io(_write_all, [(stream_log, plan) for stream_log, _, plan in group])
        errors.update(results)


def _write_all(work: list[tuple[DiskLog, _WritePlan]]) -> dict[DiskLog, OSError | None]:
    """In a worker thread: each stream's batch, written and synced; one failure spares the rest."""
    results: dict[DiskLog, OSError | None] = {}
    use_syncfs = bool(work) and work[0][0].storage_sync_method == "syncfs"
    for stream_log, plan in work:
        try:
            stream_log.write_plan(plan, sync=not use_syncfs)
            results[stream_log] = None
        except OSError as error:
            results[stream_log] = error
    if use_syncfs:
        # One call makes every file of the data directory's file system durable. If it fails,
        # nothing in this group is known to be durable.
        if _libc.syncfs(work[0][0].directory_fd()) != 0:
            error = OSError(ctypes.get_errno(), "syncfs failed")
            return dict.fromkeys(results, error)
    return results


_libc = ctypes.CDLL("libc.so.6", use_errno=True)


@dataclass
class RecoveryReport:
    streams: int = 0
    records: int = 0
    bytes: int = 0
    repaired: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0


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
        io_threads: int = 32,
        cache_bytes: int = 256 << 10,
        commit_group: int = 2,
        sync_method: str = "fdatasync",
        cold: ColdConfig | None = None,
        segment_max_age: float = 0.0,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}")
        self.root = root
        self.streams_dir = root / layout.STREAMS
        self.trash_dir = root / layout.TRASH
        self.budget = budget
        self.fsync = fsync
        self.fsync_interval = fsync_interval
        self.segment_max_bytes = segment_max_bytes
        self.segment_max_messages = segment_max_messages
        self.segment_max_age = segment_max_age  # seconds; 0 turns age-based sealing off
        self.cache_bytes = cache_bytes
        self._limiter = trio.CapacityLimiter(io_threads)
        self._logs: dict[str, DiskLog] = {}
        self._nursery: trio.Nursery | None = None
        if sync_method not in ("fdatasync", "syncfs"):
            raise ValueError("sync_method must be fdatasync or syncfs")
        self.sync_method = sync_method
        self.root_fd = -1
        # syncfs covers every stream of a round in one call, so it needs no parallel groups.
        self.committer = Committer(self, 1 << 30 if sync_method == "syncfs" else commit_group)
        self.cold_config = cold
        self.archiver: Archiver | None = None

    # ---- plumbing -------------------------------------------------------------------

    async def io(self, fn: Callable, *args: object):  # type: ignore[no-untyped-def, type-arg]
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def start(self, nursery: trio.Nursery) -> RecoveryReport:
        """Recovers every stream from disk, then starts background syncing (fsync=interval)."""
        self._nursery = nursery
        report = await trio.to_thread.run_sync(self._recover_all)
        self.root_fd = os.open(self.root, os.O_RDONLY)
        nursery.start_soon(self.committer.run)
        if self.cold_config is not None:
            store = await trio.to_thread.run_sync(ColdStore, self.cold_config)
            self.archiver = Archiver(self, store)
            nursery.start_soon(self.archiver.run)
        if self.fsync == "interval":
            nursery.start_soon(self._sync_loop)
        return report

    async def _sync_loop(self) -> None:
        while True:
            await trio.sleep(self.fsync_interval)
            for stream_log in list(self._logs.values()):
                if stream_log.dirty:
                    try:
                        await self.io(stream_log.sync)
                    except OSError as error:
                        log.error("background fsync of %r failed: %s", stream_log.meta.name, error)

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
        directory = self.streams_dir / layout.stream_dirname(meta.name)
        try:
            await self.io(self._create_files, directory, encode_meta(meta), segment_bytes, base)
        except OSError as error:
            self.budget.release(added)
            raise _unavailable(error, f"create of {meta.name!r}") from None
        stream_log = DiskLog(self, directory, replace(meta, closed=False))
        segment = Segment(base, directory / layout.segment_filename(base), header_len, 0)
        stream_log.segments.append(segment)
        if initial is not None:
            record = fmt.decode_at(segment_bytes, header_len)
            stream_log.index_record(segment, record, record.payload)
        stream_log.adopt_durable_state(time_ms)
        stream_log.meta.last_access = meta.last_access
        self._logs[meta.name] = stream_log
        return stream_log

    def _create_files(self, directory: Path, meta_bytes: bytes, segment_bytes: bytes, base: int) -> None:
        """Builds the stream in a temporary directory and renames it into place: all or nothing."""
        if directory.exists():
            raise OSError(errno.EEXIST, f"{directory} exists but holds no loaded stream; see the startup log")
        staging = self.streams_dir / f".tmp-{uuid.uuid4().hex}"
        staging.mkdir()
        files.write_new(files.OS, staging / layout.META, meta_bytes)
        files.write_new(files.OS, staging / layout.segment_filename(base), segment_bytes)
        files.fsync_dir(files.OS, staging)
        os.rename(staging, directory)
        files.fsync_dir(files.OS, self.streams_dir)

    async def delete(self, name: str) -> None:
        stream_log = self._logs.pop(name, None)
        if stream_log is None:
            return
        try:
            await self.io(self._delete_files, stream_log)
        except OSError as error:
            self._logs[name] = stream_log
            raise _unavailable(error, f"delete of {name!r}") from None
        stream_log.deleted = True
        self.budget.release(stream_log.tail - stream_log.meta.fork_base)
        if self.archiver is not None and stream_log.cold_entries:
            self.archiver.forget([entry["key"] for entry in stream_log.cold_entries])

    async def save_meta(self, name: str, meta: StreamMeta) -> None:
        stream_log = self._logs.get(name)
        if stream_log is None:
            return
        try:
            await self.io(files.replace, files.OS, stream_log.directory, layout.META, encode_meta(meta))
        except OSError as error:
            raise _unavailable(error, f"update of {name!r}") from None

    def _delete_files(self, stream_log: DiskLog) -> None:
        """Renames the directory into trash/ first, so a crash mid-delete cannot resurrect it."""
        stream_log.close_files()
        target = self.trash_dir / uuid.uuid4().hex
        os.rename(stream_log.directory, target)
        files.fsync_dir(files.OS, self.streams_dir)
        files.fsync_dir(files.OS, self.trash_dir)
        shutil.rmtree(target, ignore_errors=True)

    # ---- recovery ---------------------------------------------------------------------

    def close(self) -> None:
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1

    def _recover_all(self) -> RecoveryReport:
        started = time.monotonic()
        report = RecoveryReport()
        self.root.mkdir(parents=True, exist_ok=True)
        format_file = self.root / layout.FORMAT_FILE
        if format_file.exists():
            if format_file.read_text() != layout.FORMAT_LINE:
                raise RuntimeError(f"{self.root} holds another format ({format_file.read_text().strip()!r})")
        else:
            format_file.write_text(layout.FORMAT_LINE)
        self.streams_dir.mkdir(exist_ok=True)
        self.trash_dir.mkdir(exist_ok=True)
        for leftover in self.trash_dir.iterdir():  # deletes a crash interrupted: finish them
            shutil.rmtree(leftover, ignore_errors=True)
        entries = sorted(os.scandir(self.streams_dir), key=lambda e: e.name)
        for count, entry in enumerate(entries, 1):
            if entry.name.startswith(".tmp-"):  # a create a crash interrupted: it never happened
                shutil.rmtree(entry.path, ignore_errors=True)
                continue
            try:
                stream_log = self._recover_stream(Path(entry.path), report)
            except (
                OSError,
                ValueError,
                KeyError,
                TypeError,
                fmt.CorruptRecord,
                cbor2.CBORDecodeError,
            ) as error:
                report.skipped.append(f"{entry.name}: {error}")
                log.error("recovery: skipped %s: %s (left in place for inspection)", entry.path, error)
                continue
            self._logs[stream_log.meta.name] = stream_log
            self.budget.total_bytes += stream_log.tail - stream_log.meta.fork_base
            report.streams += 1
            if count % 5000 == 0:
                log.info("recovery: %d of %d stream directories read", count, len(entries))
        self._link_forks(report)
        report.bytes = self.budget.total_bytes
        report.seconds = time.monotonic() - started
        return report

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
            parent.meta.fork_count += 1
        removed = True
        while removed:
            removed = False
            for name, stream_log in list(self._logs.items()):
                if stream_log.meta.soft_deleted and stream_log.meta.fork_count == 0:
                    self._delete_files(stream_log)
                    del self._logs[name]
                    self.budget.total_bytes -= stream_log.tail - stream_log.meta.fork_base
                    parent = self._logs.get(stream_log.meta.forked_from or "")
                    if parent is not None:
                        parent.meta.fork_count -= 1
                    report.repaired.append(f"{name}: finished deleting (its last fork was gone)")
                    log.warning("recovery: %s: finished deleting; its last fork was gone", name)
                    removed = True

    def _recover_stream(self, directory: Path, report: RecoveryReport) -> DiskLog:
        meta = decode_meta((directory / layout.META).read_bytes())
        stream_log = DiskLog(self, directory, meta)
        manifest = {entry["file"]: entry for entry in cold.load_manifest(directory)}
        stream_log.cold_entries = list(manifest.values())
        local = {p.name for p in directory.iterdir() if p.name.endswith(layout.SEGMENT_SUFFIX)}
        names = sorted(local | set(manifest))
        if not names:
            raise ValueError("no segment files")
        segment_files = [directory / name for name in names]
        expected = layout.segment_start(names[0])
        last_ms: int | None = None
        for number, path in enumerate(segment_files):
            is_last = number == len(segment_files) - 1
            entry = manifest.get(path.name)
            if path.name not in local:  # only in the bucket: its index sidecar stands in for it
                segment = Segment(expected, path, 0, 0, cold_key=entry["key"], local=False)
                stream_log.segments.append(segment)
                for record in cold.read_index(path):
                    if record.start != expected:
                        raise fmt.CorruptRecord(f"cold segment {path.name} is out of order")
                    stream_log.index_record(segment, record, None)
                    expected += record.payload_len
                    last_ms = record.time_ms
                    report.records += 1
                segment.size = entry["size"]
                continue
            data = path.read_bytes()
            records, valid, reason = fmt.scan(data, keep_payload=False)
            if not records or records[0].kind != fmt.KIND_SEGMENT or records[0].header.get("s") != expected:
                if is_last and number > 0:  # a rotation a crash interrupted: the new file is empty or torn
                    path.unlink()
                    report.repaired.append(f"{meta.name}: removed torn new segment {path.name}")
                    log.warning("recovery: %s: removed torn new segment %s", meta.name, path.name)
                    break
                raise ValueError(f"segment {path.name} has no valid header for position {expected}")
            if reason is not None:
                if not is_last:
                    raise fmt.CorruptRecord(f"sealed segment {path.name} is damaged: {reason}")
                with open(path, "r+b") as handle:
                    handle.truncate(valid)
                    os.fsync(handle.fileno())
                report.repaired.append(f"{meta.name}: truncated {path.name} to {valid} bytes ({reason})")
                log.warning(
                    "recovery: %s: truncated torn tail of %s at byte %d (%s)",
                    meta.name,
                    path.name,
                    valid,
                    reason,
                )
            segment = Segment(expected, path, records[0].end, 0, cold_key=entry["key"] if entry else None)
            stream_log.segments.append(segment)
            for record in records[1:]:
                if record.kind != fmt.KIND_APPEND or record.start != expected:
                    raise fmt.CorruptRecord(
                        f"record at byte {record.file_offset} of {path.name} is out of order"
                    )
                stream_log.index_record(segment, record, None)
                expected += record.payload_len
                last_ms = record.time_ms
                report.records += 1
        stream_log.adopt_durable_state(last_ms)
        return stream_log
