"""A PySpark data source over streamkeep's segment files (hot on local disk, cold in S3).

    from streamkeep.segments import spark as sk
    sk.register(spark)
    df = spark.read.format("streamkeep").load("/var/lib/streamkeep")           # a data directory
    df = spark.read.format("streamkeep").option("endpoint", "http://minio:9000").load("s3://bucket/prefix")

Spark reads the files, not the HTTP API, so analytics never load the server. One partition per
segment; rows come as Arrow record batches. Options: `streams` (comma-separated names or globs),
`start_offset` / `end_offset` (offset tokens; segments wholly outside are never opened), and for S3
`endpoint`, `region`, `access_key`, `secret_key` (else the standard AWS_* variables). A local data
directory's cold segments are read from its bucket (`cold_url` option, plus the same S3 options).
Every record's CRC is checked; a damaged sealed segment fails the job naming the file or object.
S3 access goes through boto3 inside the reader: `s3a://` needs hadoop-aws jars the pyspark wheel
does not ship.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamkeep.protocol import offsets
from streamkeep.segments import format as fmt
from streamkeep.segments import layout

SCHEMA = (
    "stream string, offset string, message_index long, append_time timestamp, content_type string, "
    "producer_id string, producer_epoch long, producer_seq long, payload binary, json string"
)


def _position(token: str | None) -> int | None:
    """The position of an offset token (its incarnation half is not checked: Spark reads files)."""
    if not token:
        return None
    if len(token) != 33 or token[16] != "_" or not (token[:16] + token[17:]).isdigit():
        raise ValueError(f"not a streamkeep offset: {token!r}")
    return int(token[17:])


@dataclass(frozen=True)
class Segment:
    stream: str
    content_type: str
    start: int
    next_start: int | None  # where the following segment begins (None: the last one)
    last: bool  # the segment being appended to: a torn tail there is a write in flight
    path: str | None = None  # a local file
    key: str | None = None  # or an object in the bucket


def _s3(options: dict[str, str]) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=options.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL") or None,
        region_name=options.get("region") or os.environ.get("AWS_REGION") or "us-east-1",
        aws_access_key_id=options.get("access_key") or None,
        aws_secret_access_key=options.get("secret_key") or None,
    )


def _bucket_prefix(url: str) -> tuple[str, str]:
    rest = url.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix.strip("/")


def _wanted(name: str, patterns: list[str]) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def plan_segments(path: str, options: dict[str, str]) -> list[Segment]:
    """Every segment to read, pruned by stream selection and offset range."""
    patterns = [p.strip() for p in (options.get("streams") or "").split(",") if p.strip()]
    if path.startswith("s3://"):
        segments = _plan_bucket(path, options, patterns)
    else:
        segments = _plan_directory(Path(path), options, patterns)
    low, high = _position(options.get("start_offset")), _position(options.get("end_offset"))
    kept = []
    for segment in segments:
        if high is not None and segment.start >= high:
            continue
        if low is not None and segment.next_start is not None and segment.next_start <= low:
            continue
        kept.append(segment)
    return kept


def _plan_directory(root: Path, options: dict[str, str], patterns: list[str]) -> list[Segment]:
    import cbor2

    streams_dir = root / layout.STREAMS
    if not streams_dir.is_dir():
        raise FileNotFoundError(f"{root} is not a streamkeep data directory (no {layout.STREAMS}/)")
    out: list[Segment] = []
    for directory in sorted(streams_dir.iterdir()):
        meta_file = directory / layout.META
        if directory.name.startswith(".") or not meta_file.exists():
            continue
        meta = cbor2.loads(meta_file.read_bytes())
        if meta.get("deleted") or not _wanted(meta["name"], patterns):
            continue
        manifest = {}
        if (directory / "cold.cbor").exists():  # keys of either format: the manifest names them
            manifest = {e["file"]: e for e in cbor2.loads((directory / "cold.cbor").read_bytes())["segments"]}
        local = {p.name for p in directory.glob("*" + layout.SEGMENT_SUFFIX)}
        names = sorted(local | set(manifest))
        for number, name in enumerate(names):
            start = layout.segment_start(name)
            following = layout.segment_start(names[number + 1]) if number + 1 < len(names) else None
            last = following is None
            if name in local:
                out.append(
                    Segment(meta["name"], meta["ct"], start, following, last, path=str(directory / name))
                )
            else:
                out.append(
                    Segment(meta["name"], meta["ct"], start, following, last, key=manifest[name]["key"])
                )
    return out


def _plan_bucket(url: str, options: dict[str, str], patterns: list[str]) -> list[Segment]:
    """Segments straight from a bucket listing, in either key layout: format 2
    (`<stream dir>/<stream id>/<segment>`) and format 1 (`<stream dir>/<segment>`). If a stream
    directory holds objects of several incarnations (a stream deleted and created again, its old
    objects not yet deleted by the server), only the incarnation written last is read."""
    from urllib.parse import unquote

    bucket, prefix = _bucket_prefix(url)
    client = _s3(options)
    root = layout.cold_root(prefix)
    incarnations: dict[str, dict[str | None, list[tuple[str, float]]]] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=root):
        for item in page.get("Contents", []):
            parsed = layout.parse_cold_key(root, item["Key"])
            if parsed is not None:
                directory, stream_id, file = parsed
                found = incarnations.setdefault(directory, {}).setdefault(stream_id, [])
                found.append((file, item["LastModified"].timestamp()))
    out: list[Segment] = []
    for directory, by_id in sorted(incarnations.items()):
        stream_id, objects = max(by_id.items(), key=lambda item: max(modified for _, modified in item[1]))
        names = sorted(file for file, _ in objects)
        base = f"{root}{directory}/" + (f"{stream_id}/" if stream_id is not None else "")
        head = client.get_object(Bucket=bucket, Key=base + names[0], Range="bytes=0-4095")["Body"].read()
        header = fmt.decode_at(head, 0).header
        name = header.get("name") or unquote(directory)
        if not _wanted(name, patterns):
            continue
        for number, file in enumerate(names):
            following = layout.segment_start(names[number + 1]) if number + 1 < len(names) else None
            out.append(
                Segment(name, header["ct"], layout.segment_start(file), following, False, key=base + file)
            )
    return out


def segment_batch(segment: Segment, data: bytes, low: int | None, high: int | None) -> Any:
    """One segment's rows as an Arrow RecordBatch, built without a Python step per message.

    Append records are contiguous in stream positions, so the joined payloads of all records are
    the payload column's data buffer and the cumulative message lengths its offsets; positions,
    per-append indexes, times and offset strings are derived from those with numpy and Arrow.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    records, _valid, problem = fmt.scan(data, keep_payload=True)
    where = segment.path or segment.key
    if problem is not None and not segment.last:
        raise OSError(f"streamkeep segment {where} is damaged: {problem}")
    if not records or records[0].kind != fmt.KIND_SEGMENT:
        raise OSError(f"streamkeep segment {where} has no header record")
    appends = [r for r in records[1:] if r.payload_len]
    incarnation = offsets.incarnation_of(records[0].header.get("id", ""))
    json_mode = segment.content_type.split(";")[0].strip().lower() == "application/json"
    lengths = np.fromiter((n for r in appends for n in r.message_lengths), dtype=np.int64)
    counts = np.fromiter((len(r.message_lengths) for r in appends), dtype=np.int64, count=len(appends))
    total = int(lengths.size)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    first = appends[0].start if appends else segment.start
    positions = first + starts
    record_first = np.repeat(np.cumsum(counts) - counts, counts)
    producers = [r.producer for r in appends]
    column_data = b"".join(r.payload or b"" for r in appends)
    payload = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(),
        total,
        [None, pa.py_buffer(np.concatenate([[0], ends]).astype(np.int64)), pa.py_buffer(column_data)],
    ).cast(pa.binary())
    digits = pc.utf8_lpad(pc.cast(pa.array(positions), pa.string()), 16, "0")
    batch = pa.RecordBatch.from_arrays(
        [
            pa.array(np.full(total, segment.stream, dtype=object), pa.string()),
            pc.binary_join_element_wise(offsets.encode(0, incarnation)[:17], digits, ""),
            pa.array(np.arange(total) - record_first, pa.int64()),
            pa.array(np.repeat([r.time_ms * 1000 for r in appends], counts).astype("datetime64[us]")).cast(
                pa.timestamp("us", tz="UTC")
            ),
            pa.array(np.full(total, segment.content_type, dtype=object), pa.string()),
            pa.array(
                np.repeat(np.array([p[0] if p else None for p in producers], dtype=object), counts),
                pa.string(),
            ),
            pa.array(
                np.repeat(np.array([p[1] if p else None for p in producers], dtype=object), counts),
                pa.int64(),
            ),
            pa.array(
                np.repeat(np.array([p[2] if p else None for p in producers], dtype=object), counts),
                pa.int64(),
            ),
            payload,
            payload.cast(pa.string()) if json_mode else pa.nulls(total, pa.string()),
        ],
        names=[
            "stream",
            "offset",
            "message_index",
            "append_time",
            "content_type",
            "producer_id",
            "producer_epoch",
            "producer_seq",
            "payload",
            "json",
        ],
    )
    if low is not None or high is not None:
        keep = np.ones(total, dtype=bool)
        if low is not None:
            keep &= positions >= low
        if high is not None:
            keep &= positions < high
        batch = batch.filter(pa.array(keep))
    return batch


try:
    from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
except ImportError:  # the server does not need Spark; only this module's Spark half does
    DataSource = DataSourceReader = DataSourceStreamReader = InputPartition = object  # type: ignore[assignment,misc]


class SegmentPartition(InputPartition):  # type: ignore[misc,valid-type]
    def __init__(self, segment: Segment) -> None:
        self.segment = segment


def read_partition(path: str, options: dict[str, str], partition: Any) -> Iterator[Any]:
    """The Arrow batch of one segment (local file or object), CRCs checked."""
    segment = getattr(partition, "segment", None)
    if segment is None:
        return  # nothing was planned: Spark still calls read() once, with a bare InputPartition
    if segment.path is not None:
        data = Path(segment.path).read_bytes()
    else:
        bucket = _bucket_prefix(path if path.startswith("s3://") else options["cold_url"])[0]
        data = _s3(options).get_object(Bucket=bucket, Key=segment.key)["Body"].read()
    low, high = _position(options.get("start_offset")), _position(options.get("end_offset"))
    batch = segment_batch(segment, data, low, high)
    if batch.num_rows:
        yield batch


class StreamkeepReader(DataSourceReader):  # type: ignore[misc,valid-type]
    def __init__(self, options: dict[str, str]) -> None:
        self.options = dict(options)
        self.path = self.options.get("path") or ""

    def partitions(self) -> list[SegmentPartition]:
        return [SegmentPartition(segment) for segment in plan_segments(self.path, self.options)]

    def read(self, partition: SegmentPartition) -> Iterator[Any]:
        return read_partition(self.path, self.options, partition)


class StreamkeepStreamReader(DataSourceStreamReader):  # type: ignore[misc,valid-type]
    """Structured Streaming over sealed segments: each micro-batch reads the segments sealed since
    the last one. The offset is, per stream, the first segment start not yet read, a plain JSON map
    Spark checkpoints, so a restarted query continues where it stopped. Option `max_files` caps
    segments per micro-batch."""

    def __init__(self, options: dict[str, str]) -> None:
        self.options = dict(options)
        self.path = self.options.get("path") or ""

    def _sealed(self) -> list[Segment]:
        return sorted(
            (s for s in plan_segments(self.path, self.options) if not s.last),
            key=lambda s: (s.start, s.stream),
        )

    def initialOffset(self) -> dict:
        return {"next": {}}

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxFiles

        max_files = self.options.get("max_files")
        return ReadMaxFiles(int(max_files)) if max_files else ReadAllAvailable()

    def latestOffset(self, start: dict, limit: Any) -> dict:
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxFiles

        done = start.get("next", {})
        fresh = [s for s in self._sealed() if s.start >= done.get(s.stream, 0)]
        if isinstance(limit, ReadMaxFiles):
            fresh = fresh[: max(1, limit.max_files)]
        elif not isinstance(limit, ReadAllAvailable):  # a row limit: one segment is the smallest step
            fresh = fresh[:1]
        following = dict(done)
        for segment in fresh:
            following[segment.stream] = max(following.get(segment.stream, 0), segment.start + 1)
        return {"next": following}

    def partitions(self, start: dict, end: dict) -> list[SegmentPartition]:
        low, high = start.get("next", {}), end.get("next", {})
        return [
            SegmentPartition(s)
            for s in self._sealed()
            if low.get(s.stream, 0) <= s.start < high.get(s.stream, 0)
        ]

    def read(self, partition: SegmentPartition) -> Iterator[Any]:
        return read_partition(self.path, self.options, partition)

    def commit(self, end: dict) -> None:
        """Nothing to release: sealed segments never change."""


class StreamkeepDataSource(DataSource):  # type: ignore[misc,valid-type]
    @classmethod
    def name(cls) -> str:
        return "streamkeep"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: Any) -> StreamkeepReader:
        return StreamkeepReader(self.options)

    def streamReader(self, schema: Any) -> StreamkeepStreamReader:
        return StreamkeepStreamReader(self.options)


def register(spark: Any) -> None:
    """Makes `spark.read.format("streamkeep")` available in this session."""
    spark.dataSource.register(StreamkeepDataSource)


__all__ = ["SCHEMA", "StreamkeepDataSource", "plan_segments", "register", "segment_batch"]
