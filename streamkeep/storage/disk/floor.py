"""Reading and writing a stream's `floor.cbor` (its codec: streamkeep/segments/floor.py)."""

from __future__ import annotations

import os

from streamkeep.segments.floor import FLOOR_FILE, FloorCheckpoint
from streamkeep.storage import files
from streamkeep.storage.files import FileSystem, PathLike


def load(fs: FileSystem, directory: PathLike) -> FloorCheckpoint | None:
    path = os.path.join(directory, FLOOR_FILE)
    if not fs.exists(path):
        return None
    return FloorCheckpoint.decode(files.read_file(fs, path))


def save(fs: FileSystem, directory: PathLike, checkpoint: FloorCheckpoint) -> None:
    """Durably (write, fsync, rename, fsync the directory): before any file below it goes."""
    files.replace(fs, directory, FLOOR_FILE, checkpoint.encode())
