"""Which segments a Spark read covers: a data directory's streams (their meta, floor and cold
manifest) or a bucket's listing, pruned by stream selection, offset range and floor, as
`PlannedSegment`s, one per partition. Nothing here needs Spark; source.py reads what this plans."""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamkeep.protocol import offsets
from streamkeep.segments import format as fmt
from streamkeep.segments import layout
from streamkeep.segments.floor import FLOOR_FILE, FloorCheckpoint
from streamkeep.segments.manifest import MANIFEST, decode_manifest


def position_of(token: str | None) -> int | None:
    """The position of an offset token (its incarnation half is not checked: Spark reads files)."""
    if not token:
        return None
    if len(token) != 33 or token[16] != "_" or not (token[:16] + token[17:]).isdigit():
        raise ValueError(f"not a streamkeep offset: {token!r}")
    return int(token[17:])


@dataclass(frozen=True)
class PlannedSegment:
    """One segment file or object to read: a partition of a read."""

    stream: str
    content_type: str
    start: int
    next_start: int | None  # where the following segment begins (None: the last one)
    last: bool  # the segment being appended to: a torn tail there is a write in flight
    path: str | None = None  # a local file
    key: str | None = None  # or an object in the bucket
    directory: str | None = None  # the stream's directory (None: read from a bucket alone)
    floor: int = 0  # the stream's floor when planned: nothing before it is returned


@dataclass(frozen=True)
class StreamInfo:
    """What the streaming source needs of a stream besides its segments."""

    name: str
    incarnation: int
    floor: int | None  # the first position readers may see; None: unknown (a bucket read alone)
    base: int = 0  # a fork's own segments start at its fork point; below it are its source's


def load_floor(directory: Path) -> int:
    """A stream directory's floor: 0 without `floor.cbor`."""
    path = directory / FLOOR_FILE
    if not path.exists():
        return 0
    try:
        return FloorCheckpoint.decode(path.read_bytes()).floor
    except (ValueError, KeyError, TypeError) as error:  # CBORDecodeError is a ValueError
        raise OSError(f"cannot read {path}: {error}") from error


def manifest_entries(directory: Path) -> list[dict]:
    """A stream directory's cold manifest entries: none without `cold.cbor`."""
    path = directory / MANIFEST
    return decode_manifest(path.read_bytes()) if path.exists() else []


def _retained(segment: PlannedSegment) -> bool:
    """False for a segment that ends at or before its stream's floor: readers never see it."""
    return segment.next_start is None or segment.next_start > segment.floor


def s3_client(options: dict[str, str]) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=options.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL") or None,
        region_name=options.get("region") or os.environ.get("AWS_REGION") or "us-east-1",
        aws_access_key_id=options.get("access_key") or None,
        aws_secret_access_key=options.get("secret_key") or None,
    )


def bucket_prefix(url: str) -> tuple[str, str]:
    rest = url.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix.strip("/")


def _wanted(name: str, patterns: list[str]) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def plan_segments(path: str, options: dict[str, str]) -> list[PlannedSegment]:
    """Every segment to read, pruned by stream selection, offset range and floor."""
    return prune(find_segments(path, options)[0], options)


def find_segments(path: str, options: dict[str, str]) -> tuple[list[PlannedSegment], dict[str, StreamInfo]]:
    """Every segment found, retained or not, and the selected streams."""
    patterns = [p.strip() for p in (options.get("streams") or "").split(",") if p.strip()]
    if path.startswith("s3://"):
        return _plan_bucket(path, options, patterns)
    return _plan_directory(Path(path), options, patterns)


def prune(segments: list[PlannedSegment], options: dict[str, str]) -> list[PlannedSegment]:
    low, high = position_of(options.get("start_offset")), position_of(options.get("end_offset"))
    kept = []
    for segment in segments:
        if not _retained(segment):  # its file or object may still be there; readers get 410 for it
            continue
        if high is not None and segment.start >= high:
            continue
        if low is not None and segment.next_start is not None and segment.next_start <= low:
            continue
        kept.append(segment)
    return kept


def _plan_directory(
    root: Path, options: dict[str, str], patterns: list[str]
) -> tuple[list[PlannedSegment], dict[str, StreamInfo]]:
    import cbor2

    streams_dir = root / layout.STREAMS
    if not streams_dir.is_dir():
        raise FileNotFoundError(f"{root} is not a streamkeep data directory (no {layout.STREAMS}/)")
    out: list[PlannedSegment] = []
    streams: dict[str, StreamInfo] = {}
    for directory in sorted(streams_dir.iterdir()):
        meta_file = directory / layout.META
        if directory.name.startswith(".") or not meta_file.exists():
            continue
        meta = cbor2.loads(meta_file.read_bytes())
        if meta.get("deleted") or not _wanted(meta["name"], patterns):
            continue
        manifest = {e["file"]: e for e in manifest_entries(directory)}  # keys of either format: it names them
        local = {p.name for p in directory.glob("*" + layout.SEGMENT_SUFFIX)}
        # The floor after the manifest and the listing: a drop writes floor.cbor before it removes
        # anything, so a segment a drop took from under this listing ends at or before this floor.
        floor = load_floor(directory)
        streams[meta["name"]] = StreamInfo(
            meta["name"], offsets.incarnation_of(meta["id"]), floor, meta.get("base") or 0
        )
        names = sorted(local | set(manifest))
        for number, name in enumerate(names):
            start = layout.segment_start(name)
            following = layout.segment_start(names[number + 1]) if number + 1 < len(names) else None
            last = following is None
            where = {"path": str(directory / name)} if name in local else {"key": manifest[name]["key"]}
            out.append(
                PlannedSegment(
                    meta["name"],
                    meta["ct"],
                    start,
                    following,
                    last,
                    directory=str(directory),
                    floor=floor,
                    **where,
                )
            )
    return out, streams


def _plan_bucket(
    url: str, options: dict[str, str], patterns: list[str]
) -> tuple[list[PlannedSegment], dict[str, StreamInfo]]:
    """Segments straight from a bucket listing, in either key layout: format 2
    (`<stream dir>/<stream id>/<segment>`) and format 1 (`<stream dir>/<segment>`). If a stream
    directory holds objects of several incarnations (a stream deleted and created again, its old
    objects not yet deleted by the server), only the incarnation written last is read. The bucket
    holds no floors (they live in the data directory): every object still there is read."""
    from urllib.parse import unquote

    bucket, prefix = bucket_prefix(url)
    client = s3_client(options)
    root = layout.cold_root(prefix)
    incarnations: dict[str, dict[str | None, list[tuple[str, float]]]] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=root):
        for item in page.get("Contents", []):
            parsed = layout.parse_cold_key(root, item["Key"])
            if parsed is not None:
                directory, stream_id, file = parsed
                found = incarnations.setdefault(directory, {}).setdefault(stream_id, [])
                found.append((file, item["LastModified"].timestamp()))
    out: list[PlannedSegment] = []
    streams: dict[str, StreamInfo] = {}
    for directory, by_id in sorted(incarnations.items()):
        stream_id, objects = max(by_id.items(), key=lambda item: max(modified for _, modified in item[1]))
        names = sorted(file for file, _ in objects)
        base = f"{root}{directory}/" + (f"{stream_id}/" if stream_id is not None else "")
        head = client.get_object(Bucket=bucket, Key=base + names[0], Range="bytes=0-4095")["Body"].read()
        header = fmt.decode_at(head, 0).header
        name = header.get("name") or unquote(directory)
        if not _wanted(name, patterns):
            continue
        streams[name] = StreamInfo(name, offsets.incarnation_of(header.get("id", "")), None)
        for number, file in enumerate(names):
            following = layout.segment_start(names[number + 1]) if number + 1 < len(names) else None
            out.append(
                PlannedSegment(
                    name, header["ct"], layout.segment_start(file), following, False, key=base + file
                )
            )
    return out, streams
