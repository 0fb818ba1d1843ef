"""Every file operation the server makes goes through one `FileSystem`, so faults can be injected.

`OS` is the real one: thin calls into `os`. The deterministic simulation (ops/torture) swaps in an
in-memory file system that can fail any call (ENOSPC, EIO, short writes, failed fsyncs) and cut the
power, dropping whatever was written but not yet synced. Storage code therefore never calls `os`
or `pathlib` I/O directly: it takes a `FileSystem` and uses the helpers below, which also hold the
crash-safe write patterns (write-all loops, write + fsync + rename + directory fsync).

Paths are `str` or `os.PathLike`; the file system decides what they mean.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from typing import Protocol

PathLike = str | os.PathLike[str]


class FileSystem(Protocol):
    """POSIX file calls, as `os` has them. Every method may raise OSError."""

    def open(self, path: PathLike, flags: int, mode: int = 0o644) -> int: ...

    def close(self, fd: int) -> None: ...

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        """May write fewer bytes than given (a nearly full disk): callers use `pwrite_all`."""
        ...

    def write(self, fd: int, data: bytes | memoryview) -> int: ...

    def pread(self, fd: int, length: int, offset: int) -> bytes: ...

    def fsync(self, fd: int) -> None: ...

    def fdatasync(self, fd: int) -> None: ...

    def ftruncate(self, fd: int, length: int) -> None: ...

    def fsize(self, fd: int) -> int: ...

    def syncfs(self, fd: int) -> None:
        """Makes every file and directory of `fd`'s file system durable (Linux syncfs(2))."""
        ...

    def rename(self, source: PathLike, target: PathLike) -> None: ...

    def unlink(self, path: PathLike) -> None: ...

    def mkdir(self, path: PathLike) -> None: ...

    def rmdir(self, path: PathLike) -> None: ...

    def listdir(self, path: PathLike) -> list[str]: ...

    def exists(self, path: PathLike) -> bool: ...

    def is_dir(self, path: PathLike) -> bool: ...

    def free_bytes(self, path: PathLike) -> int:
        """Bytes an unprivileged writer may still use on `path`'s file system (statvfs)."""
        ...


class OsFileSystem:
    """The real file system."""

    open = staticmethod(os.open)
    close = staticmethod(os.close)
    pwrite = staticmethod(os.pwrite)
    write = staticmethod(os.write)
    pread = staticmethod(os.pread)
    fsync = staticmethod(os.fsync)
    fdatasync = staticmethod(os.fdatasync)
    ftruncate = staticmethod(os.ftruncate)
    rename = staticmethod(os.rename)
    unlink = staticmethod(os.unlink)
    rmdir = staticmethod(os.rmdir)
    listdir = staticmethod(os.listdir)

    @staticmethod
    def mkdir(path: PathLike) -> None:
        os.mkdir(path)

    @staticmethod
    def fsize(fd: int) -> int:
        return os.fstat(fd).st_size

    @staticmethod
    def syncfs(fd: int) -> None:
        if _libc().syncfs(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"syncfs failed: {os.strerror(code)}")

    @staticmethod
    def exists(path: PathLike) -> bool:
        return os.path.exists(path)

    @staticmethod
    def is_dir(path: PathLike) -> bool:
        return os.path.isdir(path)

    @staticmethod
    def free_bytes(path: PathLike) -> int:
        stats = os.statvfs(path)
        return stats.f_bavail * stats.f_frsize


OS: FileSystem = OsFileSystem()

_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
    return _LIBC


# ---- helpers: the patterns every caller needs, written once -------------------------------


def write_all(fs: FileSystem, fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[fs.write(fd, view) :]


def pwrite_all(fs: FileSystem, fd: int, data: bytes | memoryview, offset: int) -> None:
    """Writes all of `data` at `offset`. A short write (a disk filling up) is continued; if no
    byte goes in, the disk is full. Never returns having written less than everything."""
    view = memoryview(data)
    while view:
        written = fs.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, "No space left on device (short write)")
        view = view[written:]
        offset += written


def read_file(fs: FileSystem, path: PathLike) -> bytes:
    fd = fs.open(path, os.O_RDONLY)
    try:
        return read_all(fs, fd)
    finally:
        fs.close(fd)


def read_all(fs: FileSystem, fd: int) -> bytes:
    size = fs.fsize(fd)
    parts: list[bytes] = []
    offset = 0
    while offset < size:
        chunk = fs.pread(fd, min(size - offset, 8 << 20), offset)
        if not chunk:
            break
        parts.append(chunk)
        offset += len(chunk)
    return b"".join(parts)


def pread_exact(fs: FileSystem, path: PathLike, offset: int, length: int) -> bytes:
    """`length` bytes at `offset`, or OSError: a short read means the file is not what we indexed."""
    fd = fs.open(path, os.O_RDONLY)
    try:
        data = fs.pread(fd, length, offset)
        while len(data) < length:
            more = fs.pread(fd, length - len(data), offset + len(data))
            if not more:
                raise OSError(errno.EIO, f"short read from {os.fspath(path)}: {len(data)} of {length} bytes")
            data += more
        return data
    finally:
        fs.close(fd)


class NotDurable(OSError):
    """The change is made (the page cache shows it) but could not be made durable: it may or may
    not survive a power cut. Callers must treat the change as done, not as failed."""


DIR_SYNC_ATTEMPTS = 3


def fsync_dir(fs: FileSystem, path: PathLike) -> None:
    """Makes a directory's entries (created, renamed, removed files) durable."""
    fd = fs.open(path, os.O_RDONLY)
    try:
        fs.fsync(fd)
    finally:
        fs.close(fd)


def commit_dirs(fs: FileSystem, *paths: PathLike) -> None:
    """After a change that cannot be taken back (a rename into place): makes it durable in each
    directory, trying each a few times, each through a fresh descriptor. A failed directory fsync
    leaves the journal as it was (unlike a file's, whose dirty pages the kernel may drop), so a
    retry is sound. Raises NotDurable if it cannot be done: the change stays made."""
    for path in paths:
        for attempt in range(DIR_SYNC_ATTEMPTS):
            try:
                fsync_dir(fs, path)
                break
            except OSError as error:
                if attempt == DIR_SYNC_ATTEMPTS - 1:
                    raise NotDurable(error.errno, f"{os.fspath(path)}: {error.strerror or error}") from error


def _write_synced(fs: FileSystem, path: PathLike, data: bytes, flags: int, mode: int) -> None:
    fd = fs.open(path, os.O_WRONLY | os.O_CREAT | flags, mode)
    try:
        write_all(fs, fd, data)
        fs.fsync(fd)
    finally:
        fs.close(fd)


def write_new(fs: FileSystem, path: PathLike, data: bytes, mode: int = 0o644) -> None:
    """Creates `path` (which must not exist) with `data`, synced. The caller syncs the directory;
    a crash before that may leave the file missing, or present and empty: use `replace` for files
    whose absence or emptiness would be read as something else."""
    _write_synced(fs, path, data, os.O_EXCL, mode)


def replace(fs: FileSystem, directory: PathLike, name: str, data: bytes, mode: int = 0o644) -> None:
    """Write, fsync, rename over, fsync the directory: after a crash the file is old or new, never
    torn or empty. An OSError before the rename leaves the old file; NotDurable means the new one
    is in place but a power cut may still bring the old one back."""
    staging = os.path.join(directory, f".{name}.tmp")
    _write_synced(fs, staging, data, os.O_TRUNC, mode)
    fs.rename(staging, os.path.join(directory, name))
    commit_dirs(fs, directory)


def unlink_quietly(fs: FileSystem, path: PathLike) -> None:
    try:
        fs.unlink(path)
    except FileNotFoundError:
        pass


def makedirs(fs: FileSystem, path: PathLike) -> None:
    """Creates `path` and missing parents, making each new entry durable in its parent."""
    path = os.fspath(path)
    if fs.is_dir(path):
        return
    parent = os.path.dirname(path.rstrip("/")) or "."
    makedirs(fs, parent)
    try:
        fs.mkdir(path)
    except FileExistsError:
        return
    fsync_dir(fs, parent)


def rmtree(fs: FileSystem, path: PathLike) -> None:
    """Removes a directory tree; what cannot be removed stays (the next start tries again)."""
    if fs is OS:
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        names = fs.listdir(path)
    except OSError:
        return
    for name in names:
        child = os.path.join(path, name)
        if fs.is_dir(child):
            rmtree(fs, child)
        else:
            try:
                fs.unlink(child)
            except OSError:
                pass
    try:
        fs.rmdir(path)
    except OSError:
        pass
