"""The write path of one stream: laying a batch of appends out as records, and writing them.

`plan_batch` (pure) turns the appends queued since the last round into bytes per segment, starting
a new segment where the size, count or age limit says. `SegmentWriter` owns the file descriptor of
the stream's active segment and does the writing, in a worker thread, under the stream's I/O lock:

- Every byte goes in (`pwrite_all`: a short write on a filling disk is continued or fails; it is
  never taken for success), or the batch fails and is rolled back: new segment files are removed,
  the active segment is cut back to its published size and that cut is synced.
- A segment is synced before it is sealed (left for a new one), whatever the fsync policy: sealed
  segments never change again and may move to the cold tier, so they must be whole on disk.
- A failed fsync is never retried on the same descriptor: after one, the kernel may have dropped
  the dirty pages and the next fsync would report success for bytes that are not on disk. The
  writer closes the descriptor and, before writing again, reopens the file, re-verifies its
  records up to the published size, and cuts off anything after it. If the published records
  themselves do not verify, the stream goes read-only with the reason.
- Under `--fsync interval`, `sync` makes the active segment durable; if that fails, the unsynced
  range is read back from the page cache and written again through a fresh descriptor, so the next
  sync covers it.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field

from streamkeep.protocol.stream import StreamMeta
from streamkeep.segments import format as fmt
from streamkeep.segments import layout
from streamkeep.storage import files
from streamkeep.storage.base import AppendRecord, Commit
from streamkeep.storage.disk.index import Segment
from streamkeep.storage.files import FileSystem


@dataclass(slots=True)
class Pending:
    """An append accepted by the actor and waiting for its round."""

    record: AppendRecord
    start: int
    commit: Commit
    time_ms: int

    @property
    def end(self) -> int:
        return self.start + sum(len(m) for m in self.record.messages)


@dataclass(slots=True)
class Part:
    segment: Segment
    offset: int  # where `data` goes in the segment's file
    data: bytes
    new: bool  # the segment's file is created by this write


@dataclass
class WritePlan:
    """A batch as bytes: per segment, where and what; and per append, where its record landed."""

    parts: list[Part] = field(default_factory=list)
    # per pending append: its segment, where its record and its payload start there, its header
    entries: list[tuple[Segment, int, int, dict]] = field(default_factory=list)
    size: int = 0  # bytes to write in all


@dataclass(frozen=True)
class SegmentLimits:
    max_bytes: int
    max_messages: int
    max_age: float  # seconds; 0: off


def plan_batch(
    active: Segment,
    batch: list[Pending],
    meta: StreamMeta,
    limits: SegmentLimits,
    now_ms: int,
) -> WritePlan:
    plan = WritePlan()
    segment = active
    size, appends = segment.size, segment.appends
    buffer: list[bytes] = []
    offset = size
    new = False
    too_old = (
        bool(limits.max_age)
        and segment.first_ms is not None
        and now_ms - segment.first_ms >= limits.max_age * 1000
    )
    for pending in batch:
        if appends and (size >= limits.max_bytes or appends >= limits.max_messages or too_old):
            too_old = False
            if buffer:
                plan.parts.append(Part(segment, offset, b"".join(buffer), new))
            segment = Segment(pending.start, active.directory, 0)
            first = fmt.encode_segment_header(meta.name, pending.start, meta.content_type, meta.stream_id)
            buffer, offset, size, appends, new = [first], 0, len(first), 0, True
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
        plan.entries.append((segment, size, size + len(data) - len(payload), header))
        buffer.append(data)
        size += len(data)
        appends += 1
    plan.parts.append(Part(segment, offset, b"".join(buffer), new))
    plan.size = sum(len(part.data) for part in plan.parts)
    return plan


class ReadOnly(Exception):
    """The stream's published records no longer verify on disk: it takes no more appends."""


class NotTakenBack(OSError):
    """A failed write whose bytes could not be cut off the segment again (the undo's own truncate
    or sync failed too): the append is not served, but a power cut may still keep it on disk."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror)
        self.cause = cause


class SegmentWriter:
    """Owns the active segment's descriptor. Every method runs in a worker thread while the stream's
    I/O lock is held, so no two of them ever touch the descriptor at once."""

    __slots__ = ("_fd", "directory", "fs", "needs_repair", "read_only", "synced_size", "unlink_unsynced")

    def __init__(self, fs: FileSystem, directory: str | os.PathLike[str]) -> None:
        self.fs = fs
        self.directory = directory
        self._fd: int | None = None
        self.needs_repair = False  # a write or sync failed: reopen and re-verify before writing
        # A segment a failed write created was unlinked, but the directory's sync failed: until a
        # sync succeeds, a power cut may bring the file, and the failed append in it, back.
        self.unlink_unsynced = False
        self.synced_size: int | None = None  # how much of the active segment is known durable
        self.read_only: str | None = None

    # ---- writing -----------------------------------------------------------------------

    def write(self, plan: WritePlan, active: Segment, *, sync: bool) -> None:
        """Writes a batch (and with `sync`, makes it durable). On OSError everything the batch
        wrote is undone before the error propagates: nothing of it may appear after a restart."""
        fs = self.fs
        if self.read_only is not None:
            raise ReadOnly(self.read_only)
        if self.needs_repair:
            self.repair(active)
        fd = self._active_fd(active)
        opened: list[tuple[Segment, int]] = []
        try:
            for part in plan.parts:
                if part.new:
                    fs.fdatasync(fd)  # seal the segment we leave: whole on disk before anything follows it
                    fd = fs.open(part.segment.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    opened.append((part.segment, fd))
                    files.pwrite_all(fs, fd, part.data, 0)
                    fs.fsync(fd)
                    files.fsync_dir(fs, self.directory)
                else:
                    files.pwrite_all(fs, fd, part.data, part.offset)
                    if sync:
                        fs.fdatasync(fd)
        except OSError as error:
            if not self._undo(active, opened):
                raise NotTakenBack(error) from error
            raise
        if opened:  # the newest segment is the active one now; the ones before it are sealed
            for superseded in [self._fd, *(fd for _, fd in opened[:-1])]:
                if superseded is not None:
                    self._close_quietly(superseded)
            self._fd = opened[-1][1]
        if sync or opened:
            last = plan.parts[-1]
            self.synced_size = last.offset + len(last.data)

    def mark_synced(self, plan: WritePlan) -> None:
        """The round's shared sync (syncfs) covered this batch."""
        last = plan.parts[-1]
        self.synced_size = last.offset + len(last.data)

    def undo_unsynced(self, plan: WritePlan, active: Segment, error: OSError) -> OSError:
        """A round's shared sync (syncfs) failed after this batch was written: take it back.
        Returns the error to answer with."""
        if self._undo(active, [(part.segment, -1) for part in plan.parts if part.new]):
            return error
        return NotTakenBack(error)

    def _undo(self, active: Segment, opened: list[tuple[Segment, int]]) -> bool:
        """Takes back a failed write; False if that could not be made durable (retried before the
        next write, but until then a power cut may keep what the failed write left)."""
        fs = self.fs
        for segment, fd in opened:
            if fd >= 0 and fd != self._fd:
                self._close_quietly(fd)
            _unlink_quietly(fs, segment.path)
        if opened:
            self.unlink_unsynced = True
        # The descriptor saw a failure (or its last fsync may have): never sync through it again.
        if self._fd is not None:
            self._close_quietly(self._fd)
            self._fd = None
        self.needs_repair = True
        try:
            self.repair(active)
        except (OSError, ReadOnly):
            return False  # torture seed 7: a 507 whose new segment came back after a power cut
        return True

    def repair(self, active: Segment) -> None:
        """Reopens the active segment, re-verifies its last acknowledged record, cuts off whatever a
        failed write left after it, writes again what was acknowledged but never synced (a failed
        fsync may have dropped it from the page cache's dirty set for good), and syncs."""
        fs = self.fs
        if self._fd is not None:
            self._close_quietly(self._fd)
            self._fd = None
        # A new segment a failed write could not remove would be taken for data at the next start
        # (and block the next rotation to the same position): remove it first.
        later = [
            name
            for name in fs.listdir(self.directory)
            if name.endswith(layout.SEGMENT_SUFFIX) and layout.segment_start(name) > active.start
        ]
        for name in later:
            fs.unlink(os.path.join(self.directory, name))
        if later or self.unlink_unsynced:
            files.fsync_dir(fs, self.directory)
            self.unlink_unsynced = False
        fd = fs.open(active.file, os.O_RDWR)
        try:
            size = fs.fsize(fd)
            if size < active.size:
                self._read_only(active, "the file is shorter")
            if size > active.size:  # first, before anything that can fail: cut what the failed write left
                fs.ftruncate(fd, active.size)
            check_from = active.last_record_at or 0
            tail = fs.pread(fd, active.size - check_from, check_from)
            _records, valid, reason = fmt.scan(tail, keep_payload=False)
            if valid < len(tail):
                self._read_only(active, reason or "a short read")
            unsynced_from = min(self.synced_size if self.synced_size is not None else 0, active.size)
            if unsynced_from < active.size:
                data = tail[unsynced_from - check_from :] if unsynced_from >= check_from else b""
                if unsynced_from < check_from:
                    data = fs.pread(fd, active.size - unsynced_from, unsynced_from)
                if len(data) != active.size - unsynced_from:
                    raise OSError(errno.EIO, f"{active.path.name}: short read of what is to be written again")
                files.pwrite_all(fs, fd, data, unsynced_from)
            fs.fdatasync(fd)
        except BaseException:
            self._close_quietly(fd)
            raise
        self._fd = fd
        self.needs_repair = False
        self.synced_size = active.size

    def _read_only(self, active: Segment, reason: str) -> None:
        self.read_only = (
            f"{active.path.name} no longer holds the records already acknowledged ({reason}); "
            "restart the server to recover the stream from what is on disk"
        )
        raise ReadOnly(self.read_only)

    # ---- syncing (--fsync interval) -----------------------------------------------------

    def sync(self, active: Segment) -> None:
        """Makes the active segment durable. After a failed sync, `repair` first writes the
        unsynced range again through a fresh descriptor."""
        if self.read_only is not None:
            return
        if self.needs_repair:
            self.repair(active)
            return
        self._sync_active(active)
        self.synced_size = active.size

    def _sync_active(self, active: Segment) -> None:
        """fdatasync of the active segment's descriptor. If it fails, the descriptor is let go and
        never synced through again: what it held may be gone from the page cache, and a second
        fsync through it would say durable. `repair` writes it again through a new one."""
        fd = self._active_fd(active)
        try:
            self.fs.fdatasync(fd)
        except OSError:
            self._close_quietly(fd)
            self._fd = None
            self.needs_repair = True
            raise

    # ---- sealing an idle segment (--segment-max-age) -----------------------------------

    def start_segment(self, active: Segment, new: Segment, header: bytes) -> None:
        """Seals the active segment (synced first) and starts `new` with only its header."""
        fs = self.fs
        if self.needs_repair:
            self.repair(active)
        self._sync_active(active)
        fd = fs.open(new.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            files.pwrite_all(fs, fd, header, 0)
            fs.fsync(fd)
            files.fsync_dir(fs, self.directory)
        except BaseException:
            self._close_quietly(fd)
            _unlink_quietly(fs, new.path)
            raise
        if self._fd is not None:
            self._close_quietly(self._fd)
        self._fd = fd
        self.synced_size = len(header)

    # ---- descriptors ------------------------------------------------------------------

    def _active_fd(self, active: Segment) -> int:
        if self._fd is None:
            self._fd = self.fs.open(active.file, os.O_WRONLY)
        return self._fd

    def open_fd(self) -> int | None:
        return self._fd

    def at_rest(self, active: Segment) -> bool:
        """Whether a new writer for `active` would be the same as this one: no descriptor, nothing
        to repair or take back, and all of the segment known durable."""
        return (
            self._fd is None
            and not self.needs_repair
            and not self.unlink_unsynced
            and self.read_only is None
            and self.synced_size == active.size
        )

    def close(self) -> None:
        if self._fd is not None:
            self._close_quietly(self._fd)
            self._fd = None

    def _close_quietly(self, fd: int) -> None:
        try:
            self.fs.close(fd)
        except OSError:
            pass


def _unlink_quietly(fs: FileSystem, path: os.PathLike[str]) -> None:
    try:
        fs.unlink(path)
    except OSError:
        pass  # a file we could not remove is a torn new segment: recovery removes it
