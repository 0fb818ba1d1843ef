"""The files beside a stream's segments that describe its cold tier (docs/segment-format.md, "Cold
tier"): the manifest `cold.cbor` (which segments are in the bucket, under which key) and one index
sidecar `<segment>.seg.idx` per uploaded segment (its record headers, so a start never needs the
object). Reading and writing them; nothing about S3."""

from __future__ import annotations

import os

import cbor2

from streamkeep.segments import format as fmt
from streamkeep.storage import files
from streamkeep.storage.files import FileSystem, PathLike

MANIFEST = "cold.cbor"
INDEX_SUFFIX = ".idx"


def load_manifest(fs: FileSystem, directory: PathLike) -> list[dict]:
    path = os.path.join(directory, MANIFEST)
    if not fs.exists(path):
        return []
    return list(cbor2.loads(files.read_file(fs, path))["segments"])


def save_manifest(fs: FileSystem, directory: PathLike, entries: list[dict]) -> None:
    files.replace(fs, directory, MANIFEST, cbor2.dumps({"v": 1, "segments": entries}))


def index_of(segment_bytes: bytes, name: str) -> bytes:
    """The sidecar of a sealed segment's bytes; OSError if the segment is damaged."""
    records, _valid, reason = fmt.scan(segment_bytes, keep_payload=False)
    if reason is not None:
        raise OSError(f"sealed segment {name} is damaged: {reason}")
    index = [{"h": r.header, "at": r.payload_offset, "n": r.payload_len} for r in records[1:]]
    return cbor2.dumps({"v": 1, "records": index})


def write_index(fs: FileSystem, segment_path: PathLike) -> None:
    directory, name = os.path.split(os.fspath(segment_path))
    files.replace(fs, directory, name + INDEX_SUFFIX, index_of(files.read_file(fs, segment_path), name))


def read_index(fs: FileSystem, segment_path: PathLike) -> list[fmt.Record]:
    raw = cbor2.loads(files.read_file(fs, os.fspath(segment_path) + INDEX_SUFFIX))
    return [fmt.Record(fmt.KIND_APPEND, item["h"], 0, item["at"], item["n"], None) for item in raw["records"]]
