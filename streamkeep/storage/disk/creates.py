"""Group commit of stream creation.

A create builds the stream's directory in `streams/.tmp-*`, makes it durable, renames it into
place and makes the rename durable: whole or nothing after a crash (recovery removes `.tmp-*`).
One `CreateCommitter` task runs those steps for every create waiting, in rounds, so concurrent
creates share their syncs the way appends share commit rounds (committer.py):

1. in at most MAX_THREADS worker threads, `group_size` or more creates each: check the name is
   free, mkdir the staging directory, write its files, and (fdatasync method) fsync each file
   and the staging directory: parallel fsyncs on a journalled ext4 share journal commits (on
   ext4 without a journal, as perf found on the 2-core dev VM, each is its own write and flush). With
   `syncfs`, nothing is synced per create: one syncfs() of the file system covers the round;
2. in the thread whose group ends last (a round of one group, as under `syncfs`, is one thread
   hop in all): rename each durable staging directory into place, then fsync `streams/` once
   for the round.

The two steps (`build`, `commit`) are module functions: a create outside a running storage
(`streamkeep restore`) is a round of one through them (`create_now`), so whole-or-nothing is
written once.

A create is answered only when its round ends: done (durable), failed (OSError or
StorageUnavailable: nothing of it is left), or done but not durable (NotDurable: `streams/`
could not be synced, so a power cut may take it back). One create failing (its disk space, a
write, its fsync) fails only itself; a syncfs that fails fails every create of its round. The
round also checks free space once: a create that would eat into `--min-free-bytes` fails 507
unwritten. A round that fails outright (a bug) fails its creates with 503 and the next one runs:
it never ends the server.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from streamkeep.storage import files
from streamkeep.storage.errors import StorageUnavailable, below_reserve
from streamkeep.storage.files import FileSystem

log = logging.getLogger(__name__)

# A stream's directory while it is built; recovery removes what a crash left (directory.py).
STAGING_PREFIX = ".tmp-"

# At most this many worker threads per round, however many creates wait: 64 creates in groups of
# two took 32 threads, and the event loop's thread then waited for the GIL behind them after each
# socket write (py-spy: 31 % of its samples in a non-blocking write; 3.5 ms of CPU per create).
# Four threads: 2.1 ms per create, 1.7x the creates per second (docs/benchmarks.md, issue 26).
MAX_THREADS = 4


@dataclass(eq=False)
class PendingCreate:
    """One create waiting for (then in) a round, and its outcome."""

    directory: Path
    contents: dict[str, bytes]
    staging: str | None = None  # made, not yet renamed into place
    renamed: bool = False
    error: OSError | StorageUnavailable | None = None
    uncertain: files.NotDurable | None = None
    done: bool = False  # its round ended (or the committer stopped): the outcome is set
    waiter: trio.lowlevel.Task | None = None  # the task waiting for `done`

    @property
    def size(self) -> int:
        return sum(len(data) for data in self.contents.values())

    def finish(self) -> None:
        self.done = True
        if self.waiter is not None:
            trio.lowlevel.reschedule(self.waiter)
            self.waiter = None

    async def wait(self) -> None:
        """Until `finish`, even if the caller is cancelled meanwhile (a cancel then comes at its
        next checkpoint), as `CancelScope(shield=True)` would, without entering and leaving a
        cancel scope per create (~10 us of the event loop's time; issue 26)."""
        if not self.done:
            self.waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(_not_now)


def _not_now(raise_cancel: object) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


class _Round:
    """A round built in several worker threads: which of them ends last (and so commits it)."""

    def __init__(self, admitted: list[PendingCreate], groups: int, syncfs: bool) -> None:
        self.admitted = admitted
        self.syncfs = syncfs
        self._left = groups
        self._lock = threading.Lock()

    def ended(self) -> bool:
        """A group ended: whether it was the round's last."""
        with self._lock:
            self._left -= 1
            return self._left == 0


@dataclass(frozen=True)
class CreateSettings:
    syncfs: bool
    min_free_bytes: int
    group_size: int


class CreateCommitter:
    def __init__(
        self,
        fs: FileSystem,
        streams: Path,
        run_sync: Callable[..., Awaitable[Any]],
        settings: CreateSettings,
        *,
        free_bytes: Callable[[], int],
        syncfs: Callable[[], None],
    ) -> None:
        self._fs = fs
        self._streams = streams
        self._streams_str = os.fspath(streams)
        self._run_sync = run_sync
        self._settings = settings
        self._free_bytes = free_bytes
        self._syncfs = syncfs
        self._waiting: list[PendingCreate] = []
        self._work = trio.Event()
        self._running = False
        self.rounds = 0
        self.failed_rounds = 0
        self.created = 0  # creates done (durable or not), for /stats: created / rounds is the sharing

    async def create(self, directory: Path, contents: dict[str, bytes]) -> PendingCreate:
        """Queues a create and returns it once its round ended (see its `error` and `uncertain`).
        Cancelling the caller does not cancel a create already queued: its outcome is waited for,
        so a stream made on disk is never left unknown to the storage."""
        pending = PendingCreate(directory, contents)
        if not self._running:  # the storage was not started (tools, tests): a round of one
            with trio.CancelScope(shield=True):
                await self._round([pending], syncfs=False)
        else:
            self._waiting.append(pending)
            self._work.set()
            await pending.wait()
        return pending

    def will_run(self) -> None:
        """Called where `run` is started (before its task first runs): creates queue from now on."""
        self._running = True

    async def run(self) -> None:
        self._running = True
        try:
            while True:
                await self._work.wait()
                self._work = trio.Event()
                while self._waiting:
                    batch, self._waiting = self._waiting, []
                    with trio.CancelScope(shield=True):  # a round started ends: its creates are answered
                        await self._round(batch, syncfs=self._settings.syncfs)
        finally:  # cancelled (the server stops): what still waits is answered, never left hanging
            self._running = False
            for pending in self._waiting:
                pending.error = StorageUnavailable("the server is stopping", status=503)
                pending.finish()
            self._waiting = []

    async def _round(self, batch: list[PendingCreate], *, syncfs: bool) -> None:
        self.rounds += 1
        try:
            admitted = self._admit(batch)
            size = 1 << 30 if syncfs else max(self._settings.group_size, -(-len(admitted) // MAX_THREADS))
            groups = [admitted[i : i + size] for i in range(0, len(admitted), size)]
            if len(groups) == 1:
                await self._run_sync(self._build_and_commit, admitted, syncfs)
            elif groups:
                # The group that ends last commits the round in its own thread: a thread hop
                # less per round (each costs the event loop ~40 us and GIL hand-offs).
                round_ = _Round(admitted, len(groups), syncfs)
                async with trio.open_nursery() as nursery:
                    for group in groups:
                        nursery.start_soon(self._run_sync, self._build_group, round_, group)
        except Exception as error:  # a bug, or a failure outside any one create: fail this round only
            self.failed_rounds += 1
            log.exception("create round failed; its creates are answered 503 and the next round runs")
            for pending in batch:
                if pending.renamed:  # in place: done, but its directory entry may not be durable
                    if pending.error is None and pending.uncertain is None:
                        pending.uncertain = files.NotDurable(0, f"the create round failed: {error}")
                elif pending.error is None:
                    pending.error = StorageUnavailable(f"the create round failed: {error}", status=503)
            await self._run_sync(self._clean_up, batch)
        finally:
            for pending in batch:
                if pending.renamed:
                    self.created += 1
                pending.finish()

    def _admit(self, batch: list[PendingCreate]) -> list[PendingCreate]:
        """Fails, unwritten, the creates that would eat into the free-space reserve."""
        reserve = self._settings.min_free_bytes
        if not reserve:
            return batch
        free = self._free_bytes()  # statvfs answers from memory: once per round
        admitted = []
        for pending in batch:
            if free - pending.size < reserve:
                pending.error = below_reserve(f"create of {pending.directory.name}", free, reserve)
                continue
            free -= pending.size
            admitted.append(pending)
        return admitted

    # ---- in worker threads --------------------------------------------------------------

    def _build_and_commit(self, admitted: list[PendingCreate], syncfs: bool) -> None:
        """A round's steps in one worker thread."""
        for pending in admitted:
            build(self._fs, self._streams_str, pending, not syncfs)
        self._commit(admitted, syncfs)

    def _build_group(self, round_: _Round, group: list[PendingCreate]) -> None:
        """Step 1 for one group; the last group of the round to end also runs step 2. A group
        that raises (a bug) never counts as ended, so its round is never committed."""
        for pending in group:
            build(self._fs, self._streams_str, pending, not round_.syncfs)
        if round_.ended():
            self._commit(round_.admitted, round_.syncfs)

    def _commit(self, admitted: list[PendingCreate], syncfs: bool) -> None:
        built = [pending for pending in admitted if pending.error is None]
        if built:
            commit(self._fs, self._streams, built, self._syncfs if syncfs else None)

    def _clean_up(self, batch: list[PendingCreate]) -> None:
        for pending in batch:
            remove_staging(self._fs, pending)


# ---- the steps of a create, shared by rounds and by a create on its own (`create_now`) ----


def create_now(fs: FileSystem, streams: Path, directory: Path, contents: dict[str, bytes]) -> None:
    """A round of one in the calling thread, for what creates streams without a running storage
    (`streamkeep restore` builds them in its own thread pool): the same steps as a round's, each
    file synced. An OSError means it did not happen; NotDurable, that it did but a power cut may
    take it back."""
    pending = PendingCreate(directory, contents)
    build(fs, os.fspath(streams), pending, sync=True)
    if pending.error is None:
        commit(fs, streams, [pending], None)
    if pending.error is not None:
        raise pending.error
    if pending.uncertain is not None:
        raise pending.uncertain


def build(fs: FileSystem, streams: str, pending: PendingCreate, sync: bool) -> None:
    """Step 1: checks the name is free and writes the stream's files into a new staging
    directory, each file and the directory synced if `sync`. An OSError is the create's own
    (`pending.error`), and nothing of it is left."""
    try:
        if fs.exists(pending.directory):
            raise FileExistsError(
                f"{pending.directory} exists but holds no loaded stream; see the startup log"
            )
        # Paths as str and a random name without a UUID object: pathlib's joins cost a create
        # ~40 of the ~75 us of Python its file work takes on a worker thread (cProfile, issue 26).
        staging = f"{streams}/{STAGING_PREFIX}{os.urandom(16).hex()}"
        fs.mkdir(staging)
        pending.staging = staging
        for name, data in pending.contents.items():
            fd = fs.open(f"{staging}/{name}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                files.write_all(fs, fd, data)
                if sync:
                    fs.fsync(fd)
            finally:
                fs.close(fd)
        if sync:
            files.fsync_dir(fs, staging)
    except OSError as error:
        pending.error = error
        remove_staging(fs, pending)


def commit(
    fs: FileSystem, streams: Path, built: list[PendingCreate], syncfs: Callable[[], None] | None
) -> None:
    """Step 2: makes the staging directories durable (one `syncfs`) if they are not yet, renames
    each into place, then makes the renames durable with one fsync of `streams/`."""
    if syncfs is not None:
        try:
            syncfs()
        except OSError as error:  # nothing of this round is known durable: none of it happened
            for pending in built:
                pending.error = error
                remove_staging(fs, pending)
            return
    renamed = []
    for pending in built:
        assert pending.staging is not None
        try:
            fs.rename(pending.staging, pending.directory)
        except OSError as error:
            pending.error = error
            remove_staging(fs, pending)
            continue
        pending.renamed = True
        pending.staging = None
        renamed.append(pending)
    if not renamed:
        return
    try:
        files.commit_dirs(fs, streams)
    except files.NotDurable as error:
        for pending in renamed:
            pending.uncertain = error


def remove_staging(fs: FileSystem, pending: PendingCreate) -> None:
    if pending.staging is not None:
        files.rmtree(fs, pending.staging)
        pending.staging = None
