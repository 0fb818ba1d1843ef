"""The files beside a stream's segments that describe its cold tier (docs/segment-format.md, "Cold
tier"): the manifest `cold.cbor` (which segments are in the bucket, under which key) and one index
sidecar `<segment>.seg.idx` per uploaded segment (its record headers, so a start never needs the
object). Their encoding only, beside the segment format because the Spark source reads manifests
too; the server reads and writes the files through storage/disk/manifest.py."""

from __future__ import annotations

import cbor2

from streamkeep.segments import format as fmt

MANIFEST = "cold.cbor"
INDEX_SUFFIX = ".idx"


def encode_manifest(entries: list[dict]) -> bytes:
    return cbor2.dumps({"v": 1, "segments": entries})


def decode_manifest(data: bytes) -> list[dict]:
    return list(cbor2.loads(data)["segments"])


def encode_index(segment_bytes: bytes, name: str) -> bytes:
    """The sidecar of a sealed segment's bytes; OSError if the segment is damaged."""
    records, _valid, reason = fmt.scan(segment_bytes, keep_payload=False)
    if reason is not None:
        raise OSError(f"sealed segment {name} is damaged: {reason}")
    index = [{"h": r.header, "at": r.payload_offset, "n": r.payload_len} for r in records[1:]]
    return cbor2.dumps({"v": 1, "records": index})


def decode_index(data: bytes) -> list[fmt.Record]:
    raw = cbor2.loads(data)
    return [fmt.Record(fmt.KIND_APPEND, item["h"], 0, item["at"], item["n"], None) for item in raw["records"]]
