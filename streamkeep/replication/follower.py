"""The follower's side of replication: applies the owner's channel to a copy of its data directory.

Blocking, in one thread per channel: it reads frames, applies each operation with plain POSIX calls
(paths are checked to stay inside the copy), and answers every barrier once everything before it
is applied and the copy's file system is synced (one syncfs for all the barriers a read brought, so
a busy owner's rounds are acknowledged in groups, as its own commits are).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from collections import OrderedDict
from pathlib import Path

from streamkeep.replication import wire
from streamkeep.replication.mirror import MARKER
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
        for entry in os.scandir(self.root):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        files.fsync_dir(files.OS, self.root)

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

    def _fd(self, relative: str, flags: int = os.O_WRONLY | os.O_CREAT) -> int:
        fd = self._fds.pop(relative, None)
        if fd is None:
            fd = os.open(self._path(relative), flags, 0o644)
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
            flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if op.number else 0)
            self._fd(op.path, flags)
        elif code == wire.RENAME:
            self._forget(op.path)
            self._forget(op.target)
            os.rename(self._path(op.path), self._path(op.target))
        elif code == wire.UNLINK:
            self._forget(op.path)
            os.unlink(self._path(op.path))
        elif code == wire.MKDIR:
            os.mkdir(self._path(op.path))
        elif code == wire.RMDIR:
            self._forget(op.path)
            os.rmdir(self._path(op.path))
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
    finally:
        copy.close()
