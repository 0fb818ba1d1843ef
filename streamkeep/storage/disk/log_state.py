"""One stream on disk, as every part of its log sees it: what its actor has accepted, what is
durable and shown to readers, where every published record lives, and the I/O lock.

`DiskLog` (log.py) is this state plus the commit protocol and sealing; its reads (log_reads.py)
and retention steps (log_retention.py) are the other bases it is built from, and the cold tier's
bookkeeping (storage/cold/bookkeeping.py) works on it from outside. Every operation that touches
the stream's files (a commit round, sealing an idle segment, a background sync, recording an
upload, dropping a local copy, a retention drop; and the storage's delete) holds the I/O lock, so
none of them can close, replace or delete a file another is using. Reads do not: they find their
records in the index or the tail cache, or read the segment files, and never serve bytes of a
stream deleted while they ran.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, cast

import trio

from streamkeep.health import Health
from streamkeep.protocol.stream import ProducerMark, ProducerState, StreamMeta
from streamkeep.segments import format as fmt
from streamkeep.segments.floor import FloorCheckpoint
from streamkeep.storage.base import ByteBudget, Commit, resolved
from streamkeep.storage.disk.committer import Committable, Committer
from streamkeep.storage.disk.descriptors import DescriptorBudget
from streamkeep.storage.disk.index import Entry, RecordIndex, Segment, TailCache
from streamkeep.storage.disk.tiering import ColdTier
from streamkeep.storage.disk.writer import Pending, SegmentLimits, SegmentWriter
from streamkeep.storage.files import FileSystem

# What a stream's last commit is before it has one; shared, as a settled commit never changes.
_RESOLVED = resolved(0)


class _NoProducers(dict[str, ProducerState]):
    """The producer table of a stream no idempotent producer wrote to: one object every such
    stream shares (an empty dict per table cost 64 B, two per idle stream). Read-only: whoever
    records a producer gives the stream a table of its own first (`own_producers`); writing to
    this one is a bug, and fails loudly rather than reaching every stream."""

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("the shared empty producer table is read-only")

    __setitem__ = __delitem__ = __ior__ = _read_only
    update = setdefault = pop = popitem = clear = _read_only


NO_PRODUCERS: dict[str, ProducerState] = _NoProducers()

# The queue of a stream with no append waiting for a round, shared: `submit` starts a list of the
# stream's own (an empty list per stream cost 56 B), and nothing else ever adds to it.
NOTHING_QUEUED: list[Pending] = []


def producers_copy(table: dict[str, ProducerState]) -> dict[str, ProducerState]:
    """A table of one's own with `table`'s producers, or the shared empty one."""
    return dict(table) if table else NO_PRODUCERS


def own_producers(table: dict[str, ProducerState]) -> dict[str, ProducerState]:
    """`table`, or a new empty one in place of the shared one, to write to."""
    return {} if table is NO_PRODUCERS else table


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
    descriptors: DescriptorBudget

    async def run_io(self, fn: Callable[..., Any], *args: Any) -> Any: ...


class LogState:
    """The state every part of a `DiskLog` shares. Accepted (`meta`, `producers`, `tail`: what
    the actor has said yes to) runs ahead of published (durable, what readers see) by the appends
    queued or being committed.

    One of these stays in memory for every stream, idle or not (100,000 streams on a server are
    issue 26's case): it has slots, and the parts only a busy stream uses (the tail cache, the I/O
    lock) are made at first use and dropped again when the stream goes idle (`shed`)."""

    __slots__ = (
        "_cache",
        "_committing",
        "_durable_meta",
        "_durable_producers",
        "_io_lock",
        "_latest",
        "_pub_closed",
        "_pub_tail",
        "_queue",
        "_tail",
        "_writer",
        "cold_entries",
        "deleted",
        "deleting",
        "dirty",
        "floor",
        "host",
        "index",
        "last_append_ms",
        "location",
        "meta",
        "on_publish",
        "producers",
        "segments",
        "snapshot_end",
    )

    def __init__(self, host: LogHost, directory: Path, meta: StreamMeta) -> None:
        self.host = host
        # A string, shared with its segments: see `directory`.
        self.location = os.fspath(directory)
        self.meta = meta  # accepted
        self.producers = NO_PRODUCERS
        self.on_publish: Callable[[], None] | None = None
        self.segments: list[Segment] = []
        self.index = RecordIndex()
        self._cache: TailCache | None = None  # made by the first payload it keeps
        self._tail = meta.fork_base
        # published (durable) state
        self._pub_tail = meta.fork_base
        self._pub_closed = False
        self._durable_meta = replace(meta)
        self._durable_producers = NO_PRODUCERS
        self._queue: list[Pending] = NOTHING_QUEUED
        self._committing = False
        self._latest: Commit = _RESOLVED
        self._writer: SegmentWriter | None = None  # made by the first to use it (`writer`)
        self._io_lock: trio.Lock | None = None  # made by the first to take it (`io_lock`)
        self.dirty = False  # written but not yet synced (fsync=interval)
        self.deleted = False
        self.deleting: trio.Event | None = None  # set when a delete in progress has its outcome
        self.cold_entries: Sequence[dict] = ()  # the manifest: segments uploaded to the cold tier
        # Retention (log_retention.py): readers see nothing before `floor` (410); the files before it
        # may stay a while for forks that pin them (`segments[0].start` is what is still held).
        self.floor = 0  # a fork shows its source from 0
        self.snapshot_end: int | None = None  # the end of the compaction snapshot at the floor
        # The time of the last append whose record retention dropped: a sliding TTL counts from
        # it when no later record is left.
        self.last_append_ms: int | None = None

    # ---- state views --------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The stream's directory. Made when asked (a `Path` kept per stream cost ~250 B), which
        is only for work on its files other than appends: retention, the cold tier, deletes."""
        return Path(self.location)

    @property
    def writer(self) -> SegmentWriter:
        """The active segment's writer. An idle stream at rest drops it (`drop_writer`); made
        again, it knows the whole active segment durable, as the one dropped did."""
        writer = self._writer
        if writer is None:
            writer = self._writer = SegmentWriter(self.host.fs, self.location)
            if self.segments:
                writer.synced_size = self.segments[-1].size
        return writer

    def drop_writer(self) -> None:
        self._writer = None

    @property
    def kept_writer(self) -> SegmentWriter | None:
        """The writer if the stream has one now: for work over every stream (stop, /stats) that
        must not make one per idle stream just to look at it."""
        return self._writer

    @property
    def io_lock(self) -> trio.Lock:
        lock = self._io_lock
        if lock is None:
            lock = self._io_lock = trio.Lock()
        return lock

    def release_descriptor(self) -> None:
        """Closes the active segment's write descriptor of a stream whose actor hibernated, or the
        least recently written one past the storage's budget (descriptors.py): kept, one per
        stream ever written, they ran into the process's descriptor limit (100,000 streams; past
        it every append answered 503 and accept failed with EMFILE), and the next write opens it
        again. Not while anything of the stream is queued, being written, synced or repaired,
        nor while it holds what a relaxed fsync policy has not synced yet (the interval sync, a
        clean stop, or the budget's ask for a sync under either policy syncs through it first)."""
        writer, lock = self._writer, self._io_lock  # not made just to look at them
        if writer is None:
            return
        if self.pending or (lock is not None and lock.locked()) or writer.needs_repair or self.dirty:
            # Whoever is busy with it gives it back as its work ends (`exclusive`): under
            # fsync=interval the sync of what is dirty, retention holding the I/O lock, say.
            return
        writer.close()
        self.host.descriptors.released(self)
        if writer.at_rest(self.active_segment):
            self.drop_writer()  # the next write makes a new one, the same as this

    def wrote_through_descriptor(self) -> None:
        """Tells the storage's descriptor budget (descriptors.py) this stream's descriptor was just
        used."""
        self.host.descriptors.wrote(self)

    def descriptor_open(self) -> bool:
        writer = self._writer
        return writer is not None and writer.open_fd() is not None

    def give_back(self) -> None:
        """What an idle stream holds shrinks to what it cannot make again."""
        self.release_descriptor()
        self.shed()

    def shed(self) -> None:
        """Drops what an idle stream can make again when it is next used: the payloads of its tail
        cache (a woken stream reads its tail from the segment file, most likely still in the page
        cache) and its I/O lock, if nobody holds or waits for it. Taking the lock never awaits
        between reading `io_lock` and acquiring it, so nobody can hold a lock dropped here."""
        self._cache = None
        lock = self._io_lock
        if lock is not None and not lock.locked() and lock.statistics().tasks_waiting == 0:
            self._io_lock = None

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
            self._durable_producers = own_producers(self._durable_producers)
            self._durable_producers[producer[0]] = ProducerState(producer[1], producer[2])
        if record.stream_seq is not None:
            self._durable_meta.last_stream_seq = record.stream_seq
        if record.closes:
            self._pub_closed = True
            self._durable_meta.closed = True
            if producer is not None:
                self._durable_meta.closed_by = ProducerMark(*producer)
        if payload is not None:
            cache = self._cache
            if cache is None:
                cache = self._cache = TailCache(self.host.cache_bytes)
            cache.put(self.index.dropped + len(self.index) - 1, payload)

    def adopt_floor(self, checkpoint: FloorCheckpoint) -> None:
        """At recovery, before the records still there are indexed: what the dropped ones decided."""
        self.floor = max(self.floor, checkpoint.floor)
        self.snapshot_end = checkpoint.snapshot_end
        self.last_append_ms = checkpoint.last_append_ms
        if checkpoint.producers:
            self._durable_producers = own_producers(self._durable_producers)
            self._durable_producers.update(checkpoint.producers)
        self._durable_meta.last_stream_seq = checkpoint.last_stream_seq
        if checkpoint.closed:
            self._pub_closed = True
            self._durable_meta.closed = True
            self._durable_meta.closed_by = checkpoint.closed_by
        self._pub_tail = max(self._pub_tail, checkpoint.floor)

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
        # One object while accepted equals durable, as after every round: the fields written in
        # place (last access, fork links, soft deletion) are carried over from `meta` when a
        # failed round rolls back to the durable state (log.py, `_fail`).
        self.meta = self._durable_meta
        self.producers = producers_copy(self._durable_producers)

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Holds the stream's I/O lock; wakes the committer afterwards if appends queued meanwhile,
        however the work under the lock ended: the committer passed over the stream while the
        lock was held, and after a sync that failed nothing else woke it (under fsync=never an
        append queued meanwhile waited for the stream's next append, and a delete's drain hung)."""
        try:
            async with self.io_lock:
                yield
        finally:
            self._after_exclusive()

    def _after_exclusive(self) -> None:
        if self._queue:
            # Only ever a DiskLog, which the committer takes batches from.
            self.host.committer.wake(cast("Committable", self))
        elif self.on_publish is None and not self._committing:
            # Background work on an idle stream (sealing it for the cold tier, the tier's
            # description, retention) must not leave it holding what it gave back when it went
            # idle: a sealed idle stream kept its new segment's descriptor, one per stream.
            self.give_back()
