"""What the bucket holds beside the segments, so that a data directory can be rebuilt from the bucket
alone (`streamkeep restore --from-bucket`, streamkeep/restore.py; docs/cold-and-spark.md):

    PREFIX/meta/<stream dir>/<stream id>/stream.cbor          one per stream: its description
    PREFIX/meta/<stream dir>/<stream id>/<segment>.seg.idx    one per uploaded segment: its sidecar

The description is what recovery reads besides the records: `meta.cbor` (content type, TTL and
expiry, fork parent, cluster pins) as bytes, `floor.cbor` when retention moved the floor, and the
cold manifest. Producer state, `Stream-Seq` and the closed flag come from the records, whose
headers the index sidecars hold, so a restore downloads these small objects and no segment. A close
with no bytes after the last uploaded one sits in a segment that is never sealed (it has no bytes to
archive); the description carries it (`close`).

They live under their own root, beside `PREFIX/streams/`, so readers of the segment objects (the
Spark source, `archive verify`) never see them. The archiver writes them (archiver.py): the sidecar
with its segment, the description whenever what it says changes (a stream created, a segment
uploaded, retention moving the floor, a soft delete, a cluster pin), and once per stream at every
start. It deletes them with what they describe.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import cbor2

from streamkeep.segments import layout
from streamkeep.segments.manifest import INDEX_SUFFIX

META_ROOT = "meta"
STREAM_OBJECT = "stream.cbor"


def meta_root(prefix: str) -> str:
    """`PREFIX/meta/` (or `meta/` without a prefix): every description and sidecar lives below it."""
    return f"{prefix}/{META_ROOT}/" if prefix else f"{META_ROOT}/"


def stream_object_key(prefix: str, stream_dir: str, stream_id: str) -> str:
    return f"{meta_root(prefix)}{stream_dir}/{stream_id}/{STREAM_OBJECT}"


def index_object_key(prefix: str, stream_dir: str, stream_id: str, segment_file: str) -> str:
    return f"{meta_root(prefix)}{stream_dir}/{stream_id}/{segment_file}{INDEX_SUFFIX}"


def companions(prefix: str, keys: list[str], *, stream_gone: bool) -> list[str]:
    """The objects to delete with these segment objects: each one's sidecar, and the stream's
    description when the stream itself is gone (not when retention dropped some segments)."""
    root = layout.cold_root(prefix)
    out: list[str] = []
    for key in keys:
        parsed = layout.parse_cold_key(root, key)
        if parsed is None:
            continue  # a description or sidecar already
        stream_dir, stream_id, segment_file = parsed
        if stream_id is None:
            continue  # a format-1 key: no companions were ever written for it
        out.append(index_object_key(prefix, stream_dir, stream_id, segment_file))
        if stream_gone:
            description = stream_object_key(prefix, stream_dir, stream_id)
            if description not in out:
                out.append(description)
    return [key for key in out if key not in keys]


def parse_meta_key(prefix: str, key: str) -> tuple[str, str, str] | None:
    """(stream dir, stream id, file) of a key under `meta_root(prefix)`; file is `stream.cbor` or a
    sidecar's name."""
    root = meta_root(prefix)
    if not key.startswith(root):
        return None
    parts = key[len(root) :].split("/")
    if len(parts) != 3 or not all(parts):
        return None
    return parts[0], parts[1], parts[2]


@dataclass(frozen=True)
class Close:
    """A close that came after the last uploaded byte: restore writes it as a record again."""

    position: int
    closed_by: tuple[str, int, int] | None
    time_ms: int


@dataclass(frozen=True)
class StreamObject:
    meta: bytes  # meta.cbor, as the disk storage writes it
    floor: bytes | None  # floor.cbor, when retention moved the floor
    segments: list[dict] = field(default_factory=list)  # the cold manifest's entries
    close: Close | None = None
    # Which of two incarnations is newer. Looked up at each call (the simulation patches time.time).
    written: float = field(default_factory=lambda: time.time())

    def encode(self) -> bytes:
        close = self.close
        return cbor2.dumps(
            {
                "v": 1,
                "meta": self.meta,
                "floor": self.floor,
                "segments": self.segments,
                "close": None
                if close is None
                else {
                    "at": close.position,
                    "by": None if close.closed_by is None else list(close.closed_by),
                    "t": close.time_ms,
                },
                "written": self.written,
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> StreamObject:
        raw = cbor2.loads(data)
        if raw.get("v") != 1:
            raise ValueError(f"{STREAM_OBJECT} has version {raw.get('v')!r}; this streamkeep reads version 1")
        close = raw.get("close")
        return cls(
            meta=bytes(raw["meta"]),
            floor=None if raw.get("floor") is None else bytes(raw["floor"]),
            segments=list(raw.get("segments") or []),
            close=None
            if close is None
            else Close(
                int(close["at"]),
                None
                if close.get("by") is None
                else (str(close["by"][0]), int(close["by"][1]), int(close["by"][2])),
                int(close["t"]),
            ),
            written=float(raw.get("written") or 0.0),
        )
