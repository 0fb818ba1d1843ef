"""The owner's side of replication: a FileSystem that keeps a follower's copy of the data directory.

Storage writes through it exactly as through the real file system. Every change under the data
directory (a write at an offset, a truncate, a create, rename, unlink, mkdir, rmdir) is made locally
and queued, in the same order and under one lock, on the channel to the follower; every sync (fsync,
fdatasync, syncfs: a commit round, a directory entry made durable) also sends a barrier, runs the
local sync, and returns only once the follower has applied and synced everything before the barrier.
So a commit round is durable on both machines before its appends are acknowledged or shown to a
reader (storage publishes a round only after its sync returns), and the follower's copy is what the
owner's recovery would rebuild from, byte for byte: the same files, written by the same operations.

Storage-agnostic on purpose: creates, deletes, meta/floor/cold manifests, producer state, forks and
pins, subscription state and keys all travel because they are all files in the data directory.

A follower joins while appends go on: a copier walks the tree one directory at a time and sends
each file in chunks, every step under the lock, so whatever it sends reflects every change queued
before it and a live change queued later lands after it (the follower makes missing parents and
takes a change to a path it has not received yet as a no-op: the copier will send that path as it
is then). Renames and unlinks move or drop the copier's place. The copier never runs more than a
window ahead of the socket. When it is done, a barrier is acknowledged before the follower is
joined (then every sync waits for it) and a second one before it counts as in sync; until then it is
not waited for (appends are not slowed by the copy) and cannot be promoted.

When the channel breaks, syncs wait until the coordinator decides (`release`: it recorded in etcd
that the owner runs alone, or the process exits because another replica was promoted). A sync is
never answered as done by the follower when it was not.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from streamkeep.replication import wire
from streamkeep.replication.copy_place import CopyPlace
from streamkeep.storage.files import FileSystem, PathLike

log = logging.getLogger(__name__)

LOOP_WAIT = 5.0
COPY_WINDOW = 16 << 20  # the copier waits while this much is queued and not yet sent
MOST_UNSENT = 256 << 20  # a follower this far behind is dropped (the owner's memory is bounded)
HEARTBEAT = 1.0  # an idle channel carries a barrier this often: both ends learn the other is there
COPY_TIMEOUT = 30.0  # a joining follower that acknowledges nothing for this long is dropped
FRAME_DATA = 1 << 20  # a write is sent in frames of at most this much
# A follower that acknowledges no sync for this long is taken for gone (a partition drops packets:
# no reset ever comes), and the owner goes on alone once etcd records it. Longer than a slow fsync.
ACK_TIMEOUT = 2.0
MARKER = "replica.json"  # each replica's own record of what its directory holds; never copied
LOCK = "replica.lock"  # held by the one process serving or following from this directory
# Files at the root that are each replica's own: never copied. The /readyz probe's file is written
# and removed straight through the OS (it checks the disk, not the data), so the copier skips it too.
PRIVATE = (MARKER, LOCK, ".readyz-probe")
COPY_CHUNK = 1 << 20
_WRITABLE = os.O_WRONLY | os.O_RDWR


@dataclass
class LinkStats:
    joined_at: float = 0.0
    copy_seconds: float = 0.0
    copied_bytes: int = 0
    sent_bytes: int = 0
    barriers: int = 0
    waits: int = 0
    wait_seconds: float = 0.0


class Link:
    """One follower connection: a sender thread writes queued frames (and a heartbeat barrier when
    idle), a reader thread takes acks."""

    def __init__(self, sock: socket.socket, peer: str, on_broken: Callable[[Link], None]) -> None:
        self.sock = sock
        self.peer = peer
        self._on_broken = on_broken
        self.cond = threading.Condition()
        self._out: collections.deque[bytes] = collections.deque()
        self.unsent = 0
        self.barrier = 0  # the last barrier queued (under the mirror's lock)
        self.acked = 0
        self.acked_at = time.monotonic()  # when the follower last acknowledged something new
        self.broken: BaseException | None = None
        self.released = False  # the coordinator let waiters go on without this follower
        self.joined = False  # the copy is done: syncs wait for this follower from now on
        self.in_sync = False  # and everything before joining is durable there too
        self.place = CopyPlace()  # the copier's: what is still to look at and to send
        self.session = ""  # the follower's id for this connection (its handshake says it)
        self.stats = LinkStats(joined_at=time.monotonic())

    def start(self, copier: Callable[[], None]) -> None:
        for target, name in ((self._send_loop, "send"), (self._ack_loop, "acks"), (copier, "copy")):
            threading.Thread(target=self._guard(target), name=f"replication-{name}", daemon=True).start()

    def _guard(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as error:
                self.fail(error)

        return run

    def queue(self, frame: bytes) -> None:
        with self.cond:
            if self.broken is not None:
                return
            self._out.append(frame)
            self.unsent += len(frame)
            self.stats.sent_bytes += len(frame)
            self.cond.notify_all()
            behind = self.unsent > MOST_UNSENT
        if behind:  # outside the condition: fail() takes it
            self.fail(OverflowError(f"follower {self.peer} fell {MOST_UNSENT >> 20} MiB behind"))

    def _send_loop(self) -> None:
        while True:
            with self.cond:
                if not self._out and self.broken is None and not self.cond.wait(HEARTBEAT):
                    if self._silent():
                        raise TimeoutError(
                            f"follower {self.peer} acknowledged nothing for {COPY_TIMEOUT:g} s"
                        )
                    if not self._out:  # idle: a barrier again, acknowledging it twice is harmless
                        self._out.append(wire.encode(wire.Op(wire.SYNC, number=self.barrier)))
                if self.broken is not None:
                    return
                batch = list(self._out)
                self._out.clear()
            self.sock.sendall(b"".join(batch))
            with self.cond:
                self.unsent -= sum(len(frame) for frame in batch)
                self.cond.notify_all()

    def _silent(self) -> bool:
        """Under the condition: barriers outstanding and nothing acknowledged for long (a joining
        follower; a joined one is judged by the syncs that wait for it)."""
        return self.barrier > self.acked and time.monotonic() - self.acked_at > COPY_TIMEOUT

    def _ack_loop(self) -> None:
        buffer = b""
        while True:
            data = self.sock.recv(4096)
            if not data:
                raise ConnectionError(f"follower {self.peer} closed the replication channel")
            buffer += data
            whole = len(buffer) - len(buffer) % wire.ACK.size
            if whole:
                highest = max(wire.ACK.unpack_from(buffer, at)[0] for at in range(0, whole, wire.ACK.size))
                buffer = buffer[whole:]
                with self.cond:
                    if highest > self.acked or self.barrier == highest:
                        self.acked_at = time.monotonic()
                    self.acked = max(self.acked, highest)
                    self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.broken is not None:
                return
            self.broken = error
            self._out.clear()
            self.unsent = 0
            self.cond.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        log.warning("replication to %s broke: %s", self.peer, self.broken)
        self._on_broken(self)

    def release(self) -> None:
        """Waiters go on without this follower (the coordinator recorded that the owner runs alone)."""
        with self.cond:
            self.released = True
            self.cond.notify_all()

    def wait(self, number: int, *, ack_timeout: float, loop_timeout: float | None = None) -> None:
        """Until the follower acknowledged barrier `number`, or the coordinator released this link.
        A follower that acknowledges nothing new for `ack_timeout` (cut off: no reset ever comes)
        breaks the link, which makes the coordinator decide; `loop_timeout` bounds a wait on the
        event loop itself."""
        started = time.monotonic()
        silent = False
        with self.cond:
            if not self.joined or self.released:
                return
            while self.acked < number and not self.released:
                now = time.monotonic()
                if loop_timeout is not None and now - started >= loop_timeout:
                    log.error(
                        "a sync on the event loop waited %.0f s for follower %s; going on without it",
                        loop_timeout,
                        self.peer,
                    )
                    break
                quiet = now - max(self.acked_at, started)
                if self.broken is None and quiet >= ack_timeout:
                    silent = True
                    break
                limits = [] if loop_timeout is None else [loop_timeout - (now - started)]
                if self.broken is None:
                    limits.append(ack_timeout - quiet)
                self.cond.wait(min(limits) if limits else None)
            self.stats.waits += 1
            self.stats.wait_seconds += time.monotonic() - started
        if silent:
            self.fail(TimeoutError(f"follower {self.peer} acknowledged no sync for {ack_timeout:g} s"))
            self.wait(number, ack_timeout=ack_timeout, loop_timeout=loop_timeout)

    def wait_released(self, loop_timeout: float | None) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.released, loop_timeout)

    def wait_acked(self, number: int) -> bool:
        """For the copier: True once `number` is acked, False if the link broke first."""
        with self.cond:
            while self.acked < number and self.broken is None:
                self.cond.wait(HEARTBEAT)
            return self.acked >= number

    def wait_sent(self, below: int) -> bool:
        """For the copier: until less than `below` bytes wait to be sent; False if the link broke."""
        with self.cond:
            while self.unsent >= below and self.broken is None:
                self.cond.wait(HEARTBEAT)
            return self.broken is None


@dataclass
class _Open:
    path: str | None  # None: the file was unlinked or replaced; its writes no longer matter
    position: int = 0


def _on_event_loop() -> bool:
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True


def _mode(root: str, relative: str) -> int:
    """A file's permission bits, for its copy (key files are 0600)."""
    try:
        return os.stat(os.path.join(root, relative)).st_mode & 0o777
    except OSError:
        return 0o644


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + os.sep)


class MirrorFileSystem:
    """`inner` (the real file system), with every change under `root` mirrored to the follower."""

    def __init__(
        self,
        inner: FileSystem,
        root: PathLike,
        *,
        on_broken: Callable[[Link], None] = lambda link: None,
        on_in_sync: Callable[[Link], None] = lambda link: None,
        ack_timeout: float = ACK_TIMEOUT,
    ) -> None:
        self.inner = inner
        self.ack_timeout = ack_timeout
        self.root = os.path.abspath(os.fspath(root))
        self._lock = threading.RLock()
        self._link: Link | None = None
        # Links that broke while joined, until the coordinator decides (records in etcd that the
        # owner runs alone, or fences): no sync may count as done before that decision.
        self._undecided: set[Link] = set()
        self._open: dict[int, _Open] = {}
        self.on_broken = on_broken
        self.on_in_sync = on_in_sync
        self.links_made = 0

    # ---- the follower ------------------------------------------------------------------------

    @property
    def link(self) -> Link | None:
        return self._link

    def attach(self, sock: socket.socket, peer: str, session: str = "") -> Link:
        """A follower (with an empty directory) joined: the copier starts at the root. Replaces any
        previous link, which counts as broken (the coordinator decides about it)."""
        link = Link(sock, peer, self._broken)
        link.session = session
        with self._lock:
            previous = self._link
            self._link = link
            self.links_made += 1
        if previous is not None:
            previous.fail(ConnectionError(f"replaced by a new connection from {peer}"))
        link.start(lambda: self._copy(link))
        return link

    def release(self, link: Link) -> None:
        """The coordinator's decision about a broken link is recorded: syncs go on without it."""
        link.release()
        with self._lock:
            self._undecided.discard(link)
            if self._link is link:
                self._link = None

    def _copy_step(self, link: Link) -> bool:
        """One step of the copy, under the lock: look at one entry (a directory is listed, a file
        is created) or send one chunk. False when nothing is left."""
        place = link.place
        entry = place.next_visit()
        if entry is not None:
            relative = place.path(entry)
            absolute = os.path.join(self.root, relative)
            try:
                if relative == ".":
                    names = [name for name in self.inner.listdir(absolute) if name not in PRIVATE]
                elif self.inner.is_dir(absolute):
                    names = self.inner.listdir(absolute)
                    link.queue(wire.encode(wire.Op(wire.MKDIR, relative)))
                else:
                    if not self.inner.exists(absolute):
                        # Removed since its directory was listed (an rmdir or an unlink the place
                        # has forgotten already, or not): sending it would create a file that is
                        # not there, in a directory the owner may remove next.
                        raise FileNotFoundError(absolute)
                    flags = wire.create_flags(True, _mode(self.root, relative))
                    link.queue(wire.encode(wire.Op(wire.CREATE, relative, number=flags)))
                    place.send_from_start(entry)
                    return True
            except FileNotFoundError:
                names = []  # removed since it was listed: nothing to send
            # Each entry is looked at in a step of its own: a directory of 100,000 streams must not
            # hold the lock for 100,000 stats.
            place.add_visits(entry, sorted(names))
            place.done(entry)
            return True
        entry = place.next_send()
        if entry is None:
            return False
        assert entry.offset is not None
        path, offset = place.path(entry), entry.offset
        try:
            fd = self.inner.open(os.path.join(self.root, path), os.O_RDONLY)
        except FileNotFoundError:
            place.sent(entry, None)
            return True
        try:
            chunk = self.inner.pread(fd, COPY_CHUNK, offset)
        finally:
            self.inner.close(fd)
        if chunk:
            link.queue(wire.write(path, offset, chunk))
            link.stats.copied_bytes += len(chunk)
        place.sent(entry, offset + len(chunk) if len(chunk) == COPY_CHUNK else None)
        return True

    def _copy(self, link: Link) -> None:
        started = time.monotonic()
        while link.broken is None:
            with self._lock:
                more = self._copy_step(link)
            time.sleep(0)  # the lock is not fair: let a write (or a close) waiting for it have it
            if not more:
                break
            if not link.wait_sent(COPY_WINDOW):
                return
        else:
            return
        # The copy is queued: once it is acknowledged, the follower is joined with only what came
        # since still in flight, so the first syncs that wait for it do not wait for the copy.
        with self._lock:
            copied = self._queue_barrier(link)
        if not link.wait_acked(copied):
            return
        with self._lock:
            link.joined = True  # from here on every sync waits for this follower
            last = self._queue_barrier(link)
        # Everything queued before the barrier (rounds acknowledged while the follower was not
        # yet waited for among them) must be durable there before it counts as in sync.
        if link.wait_acked(last):
            link.stats.copy_seconds = time.monotonic() - started
            link.in_sync = True
            log.info(
                "follower %s is in sync: copied %d bytes in %.2f s",
                link.peer,
                link.stats.copied_bytes,
                link.stats.copy_seconds,
            )
            self.on_in_sync(link)

    def _broken(self, link: Link) -> None:
        with self._lock:
            if link.joined:
                self._undecided.add(link)
            if self._link is link:
                self._link = None
        self.on_broken(link)

    # ---- mirroring ---------------------------------------------------------------------------

    def _relative(self, path: PathLike) -> str | None:
        absolute = os.path.abspath(os.fspath(path))
        if absolute == self.root:
            return "."
        if absolute.startswith(self.root + os.sep):
            relative = absolute[len(self.root) + 1 :]
            return None if relative in PRIVATE else relative
        return None

    def _queue(self, op: wire.Op) -> None:
        link = self._link
        if link is not None:
            link.queue(wire.encode(op))

    def _queue_write(self, path: str, offset: int, data: bytes | memoryview) -> None:
        link = self._link
        if link is not None:
            view = memoryview(data)
            for at in range(0, len(view), FRAME_DATA):
                link.queue(wire.write(path, offset + at, view[at : at + FRAME_DATA]))

    def _queue_barrier(self, link: Link) -> int:
        link.barrier += 1
        link.stats.barriers += 1
        link.queue(wire.encode(wire.Op(wire.SYNC, number=link.barrier)))
        return link.barrier

    def _synced(self, sync: Callable[[], None]) -> None:
        with self._lock:
            link = self._link
            # A follower still copying is not waited for (its joining barrier covers this round):
            # a barrier would only make it sync its half-made copy once per round.
            number = self._queue_barrier(link) if link is not None and link.joined else 0
            undecided = list(self._undecided)
        sync()  # the local sync runs while the follower syncs: latency is the larger of the two
        # Storage syncs from worker threads. The few writes made on the event loop itself (a key
        # file at start-up) must not wait forever: the decision that releases a broken link's
        # waiters is made on that loop.
        loop_timeout = LOOP_WAIT if _on_event_loop() else None
        if link is not None:
            link.wait(number, ack_timeout=self.ack_timeout, loop_timeout=loop_timeout)
        for old in undecided:
            old.wait_released(loop_timeout)

    def _forget(self, relative: str) -> None:
        """`relative` (a file, or a directory and all below it) is gone or replaced: writes through
        descriptors still open on it are no longer part of the tree, and the copier skips it."""
        for entry in self._open.values():
            if entry.path is not None and _under(entry.path, relative):
                entry.path = None
        link = self._link
        if link is not None:
            link.place.forget(relative)

    # ---- FileSystem ---------------------------------------------------------------------------

    def open(self, path: PathLike, flags: int, mode: int = 0o644) -> int:
        if not flags & (_WRITABLE | os.O_CREAT | os.O_TRUNC):
            return self.inner.open(path, flags, mode)
        with self._lock:
            fd = self.inner.open(path, flags, mode)
            relative = self._relative(path)
            if relative is not None and relative != ".":
                self._open[fd] = _Open(relative)
                if flags & os.O_CREAT:
                    flags_and_mode = wire.create_flags(bool(flags & os.O_TRUNC), mode)
                    self._queue(wire.Op(wire.CREATE, relative, number=flags_and_mode))
                elif flags & os.O_TRUNC:
                    self._queue(wire.Op(wire.TRUNCATE, relative, number=0))
            return fd

    def close(self, fd: int) -> None:
        if fd not in self._open:  # opened for reading (`open` did not note it): nothing to mirror
            self.inner.close(fd)  # and no lock, which a copy may hold for a while
            return
        with self._lock:
            self._open.pop(fd, None)
            self.inner.close(fd)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        with self._lock:
            written = self.inner.pwrite(fd, data, offset)
            entry = self._open.get(fd)
            if entry is not None and entry.path is not None and written > 0:
                self._queue_write(entry.path, offset, memoryview(data)[:written])
            return written

    def write(self, fd: int, data: bytes | memoryview) -> int:
        with self._lock:
            written = self.inner.write(fd, data)
            entry = self._open.get(fd)
            if entry is not None and written > 0:
                if entry.path is not None:
                    self._queue_write(entry.path, entry.position, memoryview(data)[:written])
                entry.position += written
            return written

    def ftruncate(self, fd: int, length: int) -> None:
        with self._lock:
            self.inner.ftruncate(fd, length)
            entry = self._open.get(fd)
            if entry is not None and entry.path is not None:
                self._queue(wire.Op(wire.TRUNCATE, entry.path, number=length))
        # A cut-back (a failed write taken back before a 503) must be gone on the follower too
        # before the answer, or a promoted follower could serve bytes we said were not stored.
        self._synced(lambda: None)

    def rename(self, source: PathLike, target: PathLike) -> None:
        old, new = self._relative(source), self._relative(target)
        if old in (None, ".") and new not in (None, "."):  # its content would have to travel
            raise OSError(errno.EXDEV, f"cannot mirror a rename into the data directory: {target}")
        with self._lock:
            self.inner.rename(source, target)
            if old in (None, ".") or old is None:
                return
            if new in (None, ".") or new is None:  # moved out: gone from the tree
                self._forget(old)
                self._queue(wire.Op(wire.UNLINK, old))
                return
            self._forget(new)  # whatever the target replaced
            self._queue(wire.Op(wire.RENAME, old, new))
            for entry in self._open.values():
                if entry.path is not None and _under(entry.path, old):
                    entry.path = new + entry.path[len(old) :]
            link = self._link
            if link is not None:
                link.place.move(old, new)

    def unlink(self, path: PathLike) -> None:
        with self._lock:
            self.inner.unlink(path)
            relative = self._relative(path)
            if relative not in (None, "."):
                assert relative is not None
                self._queue(wire.Op(wire.UNLINK, relative))
                self._forget(relative)

    def mkdir(self, path: PathLike) -> None:
        with self._lock:
            self.inner.mkdir(path)
            relative = self._relative(path)
            if relative not in (None, "."):
                assert relative is not None
                self._queue(wire.Op(wire.MKDIR, relative))

    def rmdir(self, path: PathLike) -> None:
        with self._lock:
            self.inner.rmdir(path)
            relative = self._relative(path)
            if relative not in (None, "."):
                assert relative is not None
                self._queue(wire.Op(wire.RMDIR, relative))
                self._forget(relative)  # the copier must not visit it (nor anything it listed in it)

    def fsync(self, fd: int) -> None:
        self._synced(lambda: self.inner.fsync(fd))

    def fdatasync(self, fd: int) -> None:
        self._synced(lambda: self.inner.fdatasync(fd))

    def syncfs(self, fd: int) -> None:
        self._synced(lambda: self.inner.syncfs(fd))

    def pread(self, fd: int, length: int, offset: int) -> bytes:
        return self.inner.pread(fd, length, offset)

    def fsize(self, fd: int) -> int:
        return self.inner.fsize(fd)

    def listdir(self, path: PathLike) -> list[str]:
        return self.inner.listdir(path)

    def exists(self, path: PathLike) -> bool:
        return self.inner.exists(path)

    def is_dir(self, path: PathLike) -> bool:
        return self.inner.is_dir(path)

    def free_bytes(self, path: PathLike) -> int:
        return self.inner.free_bytes(path)


__all__ = ["LOCK", "MARKER", "PRIVATE", "Link", "MirrorFileSystem"]
