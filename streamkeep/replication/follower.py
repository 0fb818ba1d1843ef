"""The follower's side of replication: applies the owner's channel to a copy of its data directory.

Blocking, in one thread per channel: it reads frames, applies each operation with plain POSIX calls
(paths are checked to stay inside the copy), and answers every barrier once everything before it
is applied and the copy's file system is synced (one syncfs for all the barriers a read brought, so
a busy owner's rounds are acknowledged in groups, as its own commits are).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import threading
import uuid
from collections import OrderedDict
from pathlib import Path

from streamkeep.replication import wire
from streamkeep.replication.mirror import MARKER, PRIVATE
from streamkeep.storage import files

log = logging.getLogger(__name__)

OPEN_FILES = 64


class Copy:
    """A follower's directory, changed only by `apply`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._root_fd: int | None = None
        self.applied = 0
        self.bytes_written = 0

    def wipe(self) -> None:
        """Empties the directory (the marker first: a half-wiped copy must never look complete)."""
        self.close()
        files.unlink_quietly(files.OS, self.root / MARKER)
        self.root.mkdir(parents=True, exist_ok=True)
        files.fsync_dir(files.OS, self.root)  # the marker is gone before anything else goes
        # What a large copy held (100,000 stream directories) takes minutes to unlink on a busy
        # disk, while the owner waits for this copy's first acknowledgement: it is moved beside
        # the directory (one rename per top-level entry) and removed in the background. Where it
        # cannot be moved (the directory is a mount point), it is removed here.
        doomed = self._aside()
        for entry in os.scandir(self.root):
            if entry.name in PRIVATE:
                continue
            if doomed is not None:
                try:
                    os.rename(entry.path, doomed / entry.name)
                    continue
                except OSError:
                    pass
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        files.fsync_dir(files.OS, self.root)
        for old in self.root.parent.glob(f".{self.root.name}.wiped-*"):  # this one, and any a crash left
            threading.Thread(
                target=shutil.rmtree, args=(old, True), name="replication-wipe", daemon=True
            ).start()

    def _aside(self) -> Path | None:
        """A new directory beside the copy, for what a wipe moves out of it (None: none made)."""
        aside = self.root.parent / f".{self.root.name}.wiped-{uuid.uuid4().hex[:8]}"
        try:
            aside.mkdir()
        except OSError:
            return None
        return aside

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None

    def _path(self, relative: str) -> str:
        parts = relative.split(os.sep)
        if not relative or os.path.isabs(relative) or ".." in parts or "" in parts:
            raise wire.ProtocolError(f"a path outside the copy: {relative!r}")
        return os.path.join(self.root, relative)

    def _fd(self, relative: str, flags: int = os.O_WRONLY | os.O_CREAT, mode: int = 0o644) -> int:
        fd = self._fds.pop(relative, None)
        if fd is None:
            path = self._path(relative)
            try:
                fd = os.open(path, flags, mode)
            except FileNotFoundError:  # a change inside a directory the copier has not sent yet
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(path, flags, mode)
            if len(self._fds) >= OPEN_FILES:
                os.close(self._fds.popitem(last=False)[1])
        self._fds[relative] = fd
        return fd

    def _forget(self, relative: str) -> None:
        prefix = relative + os.sep
        for path in [p for p in self._fds if p == relative or p.startswith(prefix)]:
            os.close(self._fds.pop(path))

    def apply(self, op: wire.Op) -> None:
        code = op.code
        if code == wire.WRITE:
            files.pwrite_all(files.OS, self._fd(op.path), op.data, op.number)
            self.bytes_written += len(op.data)
        elif code == wire.TRUNCATE:
            os.ftruncate(self._fd(op.path), op.number)
        elif code == wire.CREATE:
            self._forget(op.path)
            truncate, mode = wire.parse_create(op.number)
            flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0)
            os.fchmod(self._fd(op.path, flags, mode), mode)
        # While the copy runs, a change may name a path the copier has not sent yet (it will send
        # it as it is then), or one it sent twice over: those are no-ops, not divergence.
        elif code == wire.RENAME:
            self._forget(op.path)
            self._forget(op.target)
            target = self._path(op.target)
            try:
                os.rename(self._path(op.path), target)
            except FileNotFoundError:
                if os.path.lexists(self._path(op.path)):
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    os.rename(self._path(op.path), target)
        elif code == wire.UNLINK:
            self._forget(op.path)
            path = self._path(op.path)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)  # moved out of the data directory on the owner
            else:
                files.unlink_quietly(files.OS, path)
        elif code == wire.MKDIR:
            os.makedirs(self._path(op.path), exist_ok=True)
        elif code == wire.RMDIR:
            self._forget(op.path)
            try:
                os.rmdir(self._path(op.path))
            except FileNotFoundError:
                pass
        self.applied += 1

    def sync(self) -> None:
        if self._root_fd is None:
            self._root_fd = os.open(self.root, os.O_RDONLY)
        files.OS.syncfs(self._root_fd)


def follow(sock: socket.socket, copy: Copy) -> None:
    """Applies frames until the owner closes the channel or `sock` is closed under us (promotion).
    Raises what broke it; the copy is left as applied (the coordinator decides what it is worth)."""
    decoder = wire.Decoder()
    try:
        while True:
            data = sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the owner closed the replication channel")
            barrier = 0
            for op in decoder.feed(data):
                if op.code == wire.SYNC:
                    barrier = op.number
                else:
                    copy.apply(op)
            if barrier:
                copy.sync()
                sock.sendall(wire.ACK.pack(barrier))
    except Exception:
        # The owner must learn now that this copy stopped applying, not after its ack timeout:
        # every sync it makes meanwhile would wait for an acknowledgement that never comes.
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        raise
    finally:
        copy.close()
