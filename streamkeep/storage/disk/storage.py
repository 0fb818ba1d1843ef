"""Disk storage: each stream is a directory of segment files (docs/segment-format.md), each
kept by a `DiskLog` (log.py); this module is the storage around them.

It creates and deletes streams, recovers them at start, runs the committer and interval syncs,
and recovers from an unclean stop. A large directory can be served before all of it is read
(`start(serve_after=...)`): each stream not read yet is read the moment it is first asked for,
the rest in the background. A delete first lets the commits already accepted land (they
happened before the delete), then takes the stream's I/O lock, so an append racing a DELETE
either lands in the old stream or is answered 404, and the stream's descriptor is closed before
its files go: nothing stays open on a deleted file.

With `fsync=always` an append is published (acknowledged, visible to readers) only after it is
synced. `interval` publishes after the write and syncs dirty streams every `fsync_interval`;
`never` leaves syncing to the OS. In every mode a segment is synced before it is sealed. What each
mode promises across a process crash and a power cut is in docs/segment-format.md.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import trio
import trio.lowlevel

from streamkeep.background import Backoff, supervised
from streamkeep.health import Health
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.stream import StreamMeta
from streamkeep.segments import format as fmt
from streamkeep.segments import layout
from streamkeep.storage import files
from streamkeep.storage.base import ByteBudget, RemoteSources
from streamkeep.storage.disk.committer import Committer, RoundSettings
from streamkeep.storage.disk.creates import CreateCommitter, CreateSettings
from streamkeep.storage.disk.descriptors import DescriptorBudget, default_limit
from streamkeep.storage.disk.directory import DataDirectory, FormatError
from streamkeep.storage.disk.index import Segment
from streamkeep.storage.disk.log import DiskLog
from streamkeep.storage.disk.meta import encode_meta
from streamkeep.storage.disk.recovery import (
    DAMAGE,
    Loaded,
    RecoveryReport,
    list_streams,
    read_stream,
    recover,
    skip,
)
from streamkeep.storage.disk.tiering import ColdTier
from streamkeep.storage.disk.writer import ReadOnly, SegmentLimits
from streamkeep.storage.errors import (
    StorageUnavailable,
    as_protocol_error,
    from_os_error,
    not_durable,
)
from streamkeep.storage.files import FileSystem

log = logging.getLogger(__name__)

FSYNC_POLICIES = ("always", "interval", "never")
RunSync = Callable[..., Awaitable[Any]]


# Each stream log's cache of its newest records (index.TailCache), in bytes: live readers and
# catch-ups near the tail are served without touching the disk.
READ_CACHE_BYTES = 256 << 10

# While streams are read in the background the event loop reads for at most this long at a time,
# so requests wait no longer than that between reads (one stream is read whole, however big).
BACKGROUND_READ_SLICE = 0.005

# A stream whose read at start fails with an I/O error is tried again (503 meanwhile) this many
# times in all, then left on disk like a damaged one, so everything waiting for the read to end
# (deletes, the TTL sweep, retention, the cold tier) does not wait forever; errors that say the
# entry is no stream directory at all are damage at once, as a start that reads everything says.
READ_ATTEMPTS = 10
NOT_A_STREAM = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG})


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
        cache_bytes: int = READ_CACHE_BYTES,
        commit_group: int = 2,
        sync_method: str = "fdatasync",
        min_free_bytes: int = 0,
        fs: FileSystem = files.OS,
        run_sync: RunSync | None = None,
        read_slice_streams: int | None = None,
        write_descriptors: int | None = None,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}")
        if sync_method not in ("fdatasync", "syncfs"):
            raise ValueError("sync_method must be fdatasync or syncfs")
        self.root = root
        self.fs = fs
        self.directory = DataDirectory(fs, root)
        self.remote: RemoteSources | None = None  # fork sources on other members (a cluster)
        self.budget = budget
        self.fsync = fsync
        self.fsync_interval = fsync_interval
        self.sync_method = sync_method
        self.min_free_bytes = min_free_bytes
        self.segment_max_age = segment_max_age  # seconds; 0 turns age-based sealing off
        self.limits = SegmentLimits(segment_max_bytes, segment_max_messages, segment_max_age)
        self.cache_bytes = cache_bytes
        # Write descriptors kept open at most (None: half the process's limit): descriptors.py.
        self.descriptors = DescriptorBudget(write_descriptors or default_limit())
        self._unsynced_wanted = trio.Event()  # the budget asked for syncs (`_sync_to_give_back`)
        self._limiter = trio.CapacityLimiter(io_threads)
        self._run_sync: RunSync = run_sync or trio.to_thread.run_sync
        self._logs: dict[str, DiskLog] = {}
        # Streams found at start and not read yet (`start(serve_after=...)`), by name.
        self._unread: dict[str, Path] = {}
        self._all_read = trio.Event()
        self.recovery = RecoveryReport()
        self._repair_when_read = False  # a crash under fsync=interval: see _after_a_crash
        self._read_slice_streams = read_slice_streams  # None: BACKGROUND_READ_SLICE of time
        self._read_failures: dict[str, int] = {}
        self.root_fd = -1
        self.health = Health()
        self.committer = Committer(
            self.run_io,
            RoundSettings(fsync == "always", sync_method == "syncfs", min_free_bytes),
            commit_group,
            free_bytes=lambda: fs.free_bytes(root),
            syncfs=lambda: fs.syncfs(self.root_fd),
        )
        self.creates = CreateCommitter(
            fs,
            self.directory.streams,
            self.run_io,
            CreateSettings(sync_method == "syncfs", min_free_bytes, commit_group),
            free_bytes=lambda: fs.free_bytes(root),
            syncfs=lambda: fs.syncfs(self.root_fd),
        )
        self.cold: ColdTier | None = None

    # ---- plumbing -------------------------------------------------------------------

    async def run_io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._run_sync(fn, *args, limiter=self._limiter)

    async def start(self, nursery: trio.Nursery, *, serve_after: float | None = None) -> RecoveryReport:
        """Recovers every stream from disk, then starts committing (and syncing, fsync=interval).

        With `serve_after` (seconds) it returns once every stream is named and as many as it could
        read in that time are read: the others are read when first asked for (`open`) or by the
        background task this starts, and `recovered()` says when all are. A failover to a member
        with 100,000 streams then serves within seconds instead of after all of them are read."""
        version = await self.run_io(self.directory.open)
        if version != layout.FORMAT_VERSION:
            raise FormatError(
                f"{self.root} is in format {version}; this version needs format {layout.FORMAT_VERSION}: "
                "run `streamkeep migrate` (or start with `streamkeep serve`, which upgrades it)"
            )
        if serve_after is None:
            report = await self.run_io(self._recover_all)
        else:
            report = await self.run_io(self._name_and_read, serve_after)
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
        if self._unread:
            nursery.start_soon(supervised, "recovery", self._read_the_rest, self.health)
        else:
            self._all_read.set()
        nursery.start_soon(supervised, "committer", self.committer.run, self.health)
        self.creates.will_run()
        nursery.start_soon(supervised, "creates", self.creates.run, self.health)
        if self.fsync == "interval":
            nursery.start_soon(supervised, "interval sync", self._sync_loop, self.health)
        if self.fsync != "always":
            self.descriptors.on_unsynced = lambda: self._unsynced_wanted.set()  # the Event of now
            nursery.start_soon(supervised, "descriptor give-back", self._sync_to_give_back, self.health)
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
            self._repair_when_read = True  # streams read later (serve_after) are marked as read
            for stream_log in self._logs.values():
                self._repair_at_first_sync(stream_log)

    @staticmethod
    def _repair_at_first_sync(stream_log: DiskLog) -> None:
        stream_log.writer.needs_repair = True
        stream_log.writer.synced_size = None
        stream_log.dirty = True

    async def stop(self) -> None:
        """At shutdown, once nothing else runs: syncs what fsync=interval/never left unsynced (a
        clean stop loses nothing to a later power cut), closes every descriptor, and notes the
        clean stop so the next start needs no crash recovery."""
        # Streams not read yet still owe the repair a crash under fsync=interval calls for: the
        # next start must know the last stop was not clean.
        clean = not (self._repair_when_read and self._unread)
        for stream_log in list(self._logs.values()):
            writer = stream_log.kept_writer  # a stream with none has nothing open or to repair
            if writer is not None and writer.needs_repair and writer.read_only is None:
                try:  # a failed write not yet cut back: cut it now, not at the next start
                    async with stream_log.exclusive():
                        await self.run_io(stream_log.writer.repair, stream_log.active_segment)
                except (OSError, ReadOnly) as error:
                    clean = False
                    log.error("shutdown: repairing %r failed: %s", stream_log.meta.name, error)
            has_fd = writer is not None and writer.open_fd() is not None
            if self.fsync != "always" and (has_fd or stream_log.dirty):
                try:
                    await stream_log.sync()
                except (OSError, ReadOnly) as error:
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
            writer = stream_log.kept_writer
            if writer is not None:
                writer.close()

    async def _sync_to_give_back(self) -> None:
        """Syncs the streams whose unsynced writes kept the descriptor budget from giving their
        descriptors back (descriptors.py), then gives them back: each in its own task as soon as
        it is listed (as many at once as the I/O threads allow), so one slow sync holds up no
        other. One at a time, 6,000 streams written once each under fsync=never outran the syncs
        and reached the descriptor limit all the same."""
        async with trio.open_nursery() as nursery:
            while True:
                await self._unsynced_wanted.wait()
                self._unsynced_wanted = trio.Event()
                for holder in self.descriptors.take_unsynced():
                    nursery.start_soon(self._sync_and_give_back, cast("DiskLog", holder))

    async def _sync_and_give_back(self, stream_log: DiskLog) -> None:
        """Never raises: a failure is the stream's own (it keeps its descriptor and the next trim
        asks again), and must not cancel the other streams' syncs."""
        if stream_log.deleted:
            return
        was_open = stream_log.descriptor_open()
        try:
            if stream_log.dirty:
                await stream_log.sync()
        except (OSError, ReadOnly) as error:
            self.health.failed("descriptor give-back sync", f"{stream_log.meta.name!r}: {error}")
            return
        except Exception as error:  # a bug: logged with its traceback, the other syncs go on
            self.health.failed(
                "descriptor give-back sync", f"{stream_log.meta.name!r}: {error!r}", traceback=error
            )
            return
        self.health.ok("descriptor give-back sync")
        if not stream_log.deleted:  # a delete meanwhile closed it, not the budget
            self.descriptors.synced(stream_log, was_open)

    async def _sync_loop(self) -> None:
        while True:
            await trio.sleep(self.fsync_interval)
            for stream_log in list(self._logs.values()):
                if not stream_log.dirty:
                    continue
                try:
                    await stream_log.sync()
                except (OSError, ReadOnly) as error:  # the stream's own: the other streams are synced
                    self.health.failed("interval sync", f"{stream_log.meta.name!r}: {error}")
                else:
                    self.health.ok("interval sync")

    # ---- the Storage interface --------------------------------------------------------

    def open(self, name: str) -> DiskLog | None:
        stream_log = self._logs.get(name)
        if stream_log is None and name in self._unread:  # asked for before the background read it
            stream_log = self._read_now(name)
        return stream_log

    def logs(self) -> list[DiskLog]:
        """The streams read so far (all of them once `recovered()` returned)."""
        return list(self._logs.values())

    def names(self) -> list[str]:
        return [*self._logs, *self._unread]

    def unread(self) -> int:
        return len(self._unread)

    def idle(self, name: str) -> None:
        stream_log = self._logs.get(name)  # never read here: a stream not read yet holds nothing
        if stream_log is not None:
            stream_log.went_idle()

    async def recovered(self) -> None:
        """Returns once every stream found at start is read. Work over all streams (the TTL
        sweep, retention, the cold tier, the registry's reconcile, listings, deletes) waits for it."""
        await self._all_read.wait()

    def still_reading(self) -> StorageUnavailable:
        """The answer to what waited too long for `recovered`."""
        return StorageUnavailable(
            f"the server is still reading {len(self._unread)} streams from disk after a start; retry shortly",
            status=503,
            code="recovering",
        )

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
        done = await self.creates.create(directory, contents)  # shares a round with other creates
        if done.error is not None:
            self.budget.release(added)
            if isinstance(done.error, StorageUnavailable):
                raise done.error
            raise from_os_error(done.error, f"create of {meta.name!r}") from None
        uncertain = None
        if done.uncertain is not None:  # it exists, but a power cut may take it back
            uncertain = not_durable(f"create of {meta.name!r}", done.uncertain)
        stream_log = DiskLog(self, directory, replace(meta, closed=False))
        segment = Segment(base, stream_log.location, header_len)
        stream_log.segments = [segment]  # not appended: a list grown by append holds room for four
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

    async def delete(self, name: str) -> None:
        stream_log = self._logs.get(name)
        if stream_log is None:
            return
        await stream_log.drain()  # appends accepted before the delete land first
        async with stream_log.io_lock:
            if self._logs.get(name) is not stream_log:
                return
            keys = [entry["key"] for entry in stream_log.cold_entries]
            # Reads take no lock: one that finds the files gone meanwhile waits for this outcome.
            stream_log.deleting = trio.Event()
            try:
                pending, uncertain = await self.run_io(self._delete_files, stream_log, keys)
            except OSError as error:
                raise from_os_error(error, f"delete of {name!r}") from None
            else:
                stream_log.deleted = True
                del self._logs[name]
                self.descriptors.released(stream_log)  # closed by the delete: not a holder now
                stream_log.shed()
            finally:
                stream_log.deleting.set()
                stream_log.deleting = None
        self.budget.release(stream_log.tail - stream_log.held_from)
        if uncertain is not None:  # its objects stay: a power cut may bring the stream back
            raise not_durable(f"delete of {name!r}", uncertain)
        if keys and self.cold is not None:
            self.cold.forget(pending, keys)

    def _delete_files(
        self, stream_log: DiskLog, keys: list[str]
    ) -> tuple[Path | None, files.NotDurable | None]:
        writer = stream_log.kept_writer
        if writer is not None:
            writer.close()
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
            "create_rounds": self.creates.rounds,
            "creates": self.creates.created,
            # Write descriptors open (those the budget counts) and given back to stay within it.
            "write_descriptors": self.descriptors.held,
            "write_descriptors_limit": self.descriptors.limit,
            "write_descriptors_given_back": self.descriptors.given_back,
            "streams_unread": len(self._unread),  # found at start, not read yet (serving early)
            **self.health.stats(),
            "read_only_streams": sorted(
                n
                for n, s in self._logs.items()
                if s.kept_writer is not None and s.kept_writer.read_only is not None
            ),
        }

    def tier_bytes(self) -> dict[str, int]:
        """Bytes of segment files by where they are: `hot` on local disk (cold copies kept as a
        cache included), `cold` only in the bucket. One pass over every segment: for scrapes."""
        hot = cold = 0
        for stream_log in self._logs.values():
            for segment in stream_log.segments:
                if segment.local:
                    hot += segment.size
                else:
                    cold += segment.size
        return {"hot": hot, "cold": cold}

    # ---- recovery ---------------------------------------------------------------------

    def _recover_all(self) -> RecoveryReport:
        report = recover(self.fs, self.directory, self._adopt)
        self._link_forks(report)
        report.bytes = self.budget.total_bytes
        self.recovery = report
        return report

    def _name_and_read(self, budget: float) -> RecoveryReport:
        """Names every stream, then reads streams for up to `budget` seconds (in a thread, before
        anything is served)."""
        report = self.recovery
        started = time.monotonic()
        found = list_streams(self.fs, self.directory, report)
        self._unread = {
            name: path for name, path in found.items() if name not in self._logs
        }  # a retried start
        failed = 0
        while self._unread and time.monotonic() - started < budget and failed < len(self._unread):
            try:
                self._read_now(next(iter(self._unread)))
            except ProtocolError:  # a read that failed goes last; failing every one, it stops
                failed += 1
        if not self._unread:
            self._finish_recovery()
        report.seconds = time.monotonic() - started
        return report

    async def _read_the_rest(self) -> None:
        """Reads the streams nobody asked for yet, on the event loop in slices (a thread would
        race with `open` reading the same stream, and recovery cuts torn tails), then finishes
        what needs every stream read. A stream whose read failed is tried again after the others,
        with a backoff while every remaining one fails."""
        started = time.monotonic()
        pause = Backoff()
        total = len(self._unread) + self.recovery.streams
        told = self.recovery.streams
        counted = self._read_slice_streams
        while self._unread:
            progress = False
            slice_ends, in_slice = time.perf_counter() + BACKGROUND_READ_SLICE, 0
            for name in list(self._unread):
                if name not in self._unread:
                    continue  # read meanwhile, for a request
                try:
                    self._read_now(name)
                    progress = True
                except ProtocolError:
                    pass
                in_slice += 1
                if in_slice == counted or (counted is None and time.perf_counter() >= slice_ends):
                    await trio.lowlevel.checkpoint()
                    slice_ends, in_slice = time.perf_counter() + BACKGROUND_READ_SLICE, 0
                    if self.recovery.streams - told >= 10_000:
                        told = self.recovery.streams
                        log.info("recovery: %d of %d streams read", told, total)
            if self._unread:  # every one left failed this pass: wait a while before the next
                await trio.sleep(0 if progress else pause.failed())
        self._finish_recovery()
        self._all_read.set()
        self.recovery.seconds += time.monotonic() - started
        self.health.ok("recovery")
        log.info("%s", self.recovery.summary(" while serving"))

    def _read_now(self, name: str) -> DiskLog | None:
        """Reads one stream found at start and adopts it (its fork source first). An I/O error
        leaves it to be read again and is answered 503 (a failing disk is not a damaged stream),
        up to READ_ATTEMPTS times; what is missing or not a stream directory is damage at once."""
        path = self._unread.pop(name)
        report = self.recovery
        try:
            loaded = read_stream(self.fs, path, report)
        except OSError as error:
            failures = self._read_failures[name] = self._read_failures.get(name, 0) + 1
            if error.errno in NOT_A_STREAM or failures >= READ_ATTEMPTS:
                skip(report, path, error)
                return None
            self._unread[name] = path
            self.health.failed("recovery", f"reading {name!r}: {error}")
            raise as_protocol_error(from_os_error(error, f"reading {name!r} at start"), name) from None
        except DAMAGE as error:
            skip(report, path, error)
            return None
        except BaseException:
            self._unread[name] = path  # a bug, or cancelled: never lose the stream for it
            raise
        if loaded.meta.name != name:
            log.warning("recovery: %s holds %r, not %r as its name says", path, loaded.meta.name, name)
        stream_log = self._adopt(loaded)
        report.streams += 1
        stream_log.meta.fork_count += len(stream_log.meta.remote_forks)
        self._link_to_source(stream_log, report)
        return self._logs.get(name)

    def _finish_recovery(self) -> None:
        self._finish_cascading_deletes(self.recovery)
        self.recovery.bytes = self.budget.total_bytes

    def _adopt(self, loaded: Loaded) -> DiskLog:
        stream_log = DiskLog(self, loaded.directory, loaded.meta)
        stream_log.cold_entries = loaded.cold_entries
        stream_log.segments = loaded.segments
        if loaded.floor is not None:
            stream_log.adopt_floor(loaded.floor)
        for segment, record in loaded.records:
            stream_log.index_record(segment, record, None)
        last_ms = loaded.last_ms if loaded.last_ms is not None else stream_log.last_append_ms
        stream_log.adopt_durable_state(last_ms)
        # Under fsync=always what recovery read was synced before it was acknowledged, as a writer
        # made at the first write assumes (`DiskLog.writer`); otherwise it is not known durable.
        if self.fsync != "always":
            stream_log.writer.synced_size = None
        if loaded.needs_repair:
            stream_log.writer.needs_repair = True
        if self._repair_when_read:
            self._repair_at_first_sync(stream_log)
        self._logs[stream_log.meta.name] = stream_log
        self.budget.total_bytes += stream_log.tail - stream_log.held_from
        return stream_log

    def _link_forks(self, report: RecoveryReport) -> None:
        """Counts each stream's live forks, and finishes cascading deletes a crash interrupted:
        a soft-deleted stream that no fork reads any more is removed. Forks other cluster members
        own count by their pins (`remote_forks`), which the cluster's reconcile keeps true."""
        for stream_log in self._logs.values():
            stream_log.meta.fork_count += len(stream_log.meta.remote_forks)
        for stream_log in list(self._logs.values()):
            self._link_to_source(stream_log, report)
        self._finish_cascading_deletes(report)

    def _link_to_source(self, stream_log: DiskLog, report: RecoveryReport) -> None:
        """Counts a fork in its source's forks (reading the source now if it is not read yet)."""
        source = stream_log.meta.forked_from
        if source is None or (self.remote is not None and self.remote.elsewhere(source)):
            return
        parent = self._logs.get(source)
        if parent is None and source in self._unread:
            try:
                parent = self._read_now(source)
            except ProtocolError:  # not readable now: the fork is read again later, with it
                self._drop_unlinked(stream_log)
                raise
        if parent is None:
            log.error(
                "recovery: fork %r has lost its source %r; its inherited range cannot be read",
                stream_log.meta.name,
                source,
            )
            report.skipped.append(f"{stream_log.meta.name}: source {source!r} missing")
            return
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

    def _drop_unlinked(self, stream_log: DiskLog) -> None:
        """Takes back the adoption of a fork whose source could not be read (it is read again)."""
        name = stream_log.meta.name
        del self._logs[name]
        self.budget.total_bytes -= stream_log.tail - stream_log.held_from
        self.recovery.streams -= 1
        self._unread[name] = stream_log.directory

    def _finish_cascading_deletes(self, report: RecoveryReport) -> None:
        """A soft-deleted stream that no fork reads any more is removed (a crash came between its
        last fork's delete and its own)."""
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
                    stream_log.deleted = True  # served early, an actor may hold it (a 410 answered)
                    del self._logs[name]
                    self.descriptors.released(stream_log)
                    self.budget.total_bytes -= stream_log.tail - stream_log.held_from
                    parent = self._logs.get(stream_log.meta.forked_from or "")
                    if parent is not None:
                        parent.meta.fork_count -= 1
                    report.repaired.append(f"{name}: finished deleting (its last fork was gone)")
                    log.warning("recovery: %s: finished deleting; its last fork was gone", name)
                    removed = True
