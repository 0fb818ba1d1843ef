"""Crash-safe file writes, shared by every part that keeps state on disk."""

from __future__ import annotations

import os
from pathlib import Path


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(path: Path) -> None:
    """Makes a directory's entries (created, renamed, removed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes, flags: int, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, mode)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Creates `path` (which must not exist) with `data`, synced. The caller syncs the directory."""
    _write_synced(path, data, os.O_EXCL, mode)


def replace(directory: Path, name: str, data: bytes, mode: int = 0o644) -> None:
    """Write, fsync, rename over, fsync the directory: after a crash the file is old or new, never torn."""
    staging = directory / f".{name}.tmp"
    _write_synced(staging, data, os.O_TRUNC, mode)
    os.rename(staging, directory / name)
    fsync_dir(directory)
