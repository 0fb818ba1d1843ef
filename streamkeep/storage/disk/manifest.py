"""Reading and writing a stream's cold manifest `cold.cbor` and its segments' index sidecars (their
encoding: streamkeep/segments/manifest.py). The disk storage owns these files: it writes them when
an upload is recorded or retention drops segments, and reads them at recovery."""

from __future__ import annotations

import os

from streamkeep.segments import format as fmt
from streamkeep.segments.manifest import (
    INDEX_SUFFIX,
    MANIFEST,
    decode_index,
    decode_manifest,
    encode_index,
    encode_manifest,
)
from streamkeep.storage import files
from streamkeep.storage.files import FileSystem, PathLike


def load_manifest(fs: FileSystem, directory: PathLike) -> list[dict]:
    path = os.path.join(directory, MANIFEST)
    if not fs.exists(path):
        return []
    return decode_manifest(files.read_file(fs, path))


def save_manifest(fs: FileSystem, directory: PathLike, entries: list[dict]) -> None:
    files.replace(fs, directory, MANIFEST, encode_manifest(entries))


def write_index(fs: FileSystem, segment_path: PathLike) -> None:
    directory, name = os.path.split(os.fspath(segment_path))
    files.replace(fs, directory, name + INDEX_SUFFIX, encode_index(files.read_file(fs, segment_path), name))


def read_index(fs: FileSystem, segment_path: PathLike) -> list[fmt.Record]:
    return decode_index(files.read_file(fs, os.fspath(segment_path) + INDEX_SUFFIX))
