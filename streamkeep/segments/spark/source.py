"""A PySpark data source over streamkeep's segment files (hot on local disk, cold in S3).

    from streamkeep.segments.spark import source as sk
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

Spark's Python workers must import this module (so streamkeep and cbor2) and numpy and pyarrow:
`register()` picks their interpreter in local mode and checks them (workers.py, docs/cold-and-spark.md
"Spark over the archive" for clusters). `pip install 'streamkeep[spark]'` brings the Spark half's
dependencies; the server never imports this module.

Retention: a data directory is read from each stream's floor on, as the HTTP API shows it
(`floor.cbor`, docs/segment-format.md "Retention"). Segments that end at or before the floor are
skipped, local file or bucket object, even while they are still there (a fork pins them, a drop is
under way); offsets stay the stream's own positions. A bucket read alone holds no floors: it reads
every object still there, including those of dropped segments the server has yet to delete.

Structured Streaming (`spark.readStream`, `StreamkeepStreamReader`) takes `max_files` and, as
Spark's Kafka source does, `failOnDataLoss` (default `true`): when data the query has not read yet
was retained away (a stream's floor passed the query's position between two micro-batches, or while
a batch was planned or read), the query fails with an error naming the stream, the lost offsets and
the option. With `false` it logs a warning and goes on from the floor; a loss found between
batches is also counted in the query's offset (`lost`: per stream, `times` and `bytes`; visible in
the query's progress as `endOffset`), one found while a batch is listed or read is only logged.
Streams present when the query starts are read from their floor then; a stream that appears later
is expected from position 0 (a fork from its fork point), so one whose beginning was already
retained away counts as a loss. A batch read applies the same option to a segment retained away
while the job reads it. Floors are known only for a data directory, not for a bucket read alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from streamkeep.protocol import offsets
from streamkeep.segments import format as fmt
from streamkeep.segments.spark import workers
from streamkeep.segments.spark.plan import (
    PlannedSegment,
    StreamInfo,
    bucket_prefix,
    find_segments,
    load_floor,
    manifest_entries,
    plan_segments,
    position_of,
    prune,
    s3_client,
)
from streamkeep.segments.spark.workers import SparkSetupError

log = logging.getLogger(__name__)

SCHEMA = (
    "stream string, offset string, message_index long, append_time timestamp, content_type string, "
    "producer_id string, producer_epoch long, producer_seq long, payload binary, json string"
)


class DataLossError(RuntimeError):
    """Data not yet read was retained away (option `failOnDataLoss`, true by default)."""


def _option(options: Any, name: str, default: str | None = None) -> str | None:
    """An option by name, whatever its case (Spark's option maps are case-insensitive)."""
    wanted = name.lower()
    return next((value for key, value in options.items() if key.lower() == wanted), default)


def fail_on_data_loss(options: Any) -> bool:
    value = str(_option(options, "failOnDataLoss", "true")).strip().lower()
    if value not in ("true", "false"):
        raise ValueError(f"streamkeep option failOnDataLoss must be true or false, not {value!r}")
    return value == "true"


def data_lost(
    options: Any,
    stream: str,
    incarnation: int,
    begin: int,
    end: int,
    floor: int,
    when: str,
    *,
    exact: bool = True,
) -> None:
    """Positions [begin, end) of `stream` are gone (with `exact` false, perhaps only a suffix of
    them): raises DataLossError under failOnDataLoss, else logs a warning (the caller goes on from
    the floor)."""
    what = (
        f"streamkeep stream {stream!r}: offsets {offsets.encode(begin, incarnation)} up to "
        f"{offsets.encode(end, incarnation)} ({'' if exact else 'at most '}{end - begin} bytes) "
        f"{'were' if exact else 'may have been'} retained away {when}; "
        f"the stream now starts at {offsets.encode(floor, incarnation)}"
    )
    if fail_on_data_loss(options):
        raise DataLossError(
            f"{what}. Some data {'was' if exact else 'may have been'} lost. To skip it and go on "
            "from the floor, set the source option failOnDataLoss to false."
        )
    log.warning("%s; skipped, going on from there (failOnDataLoss is false)", what)


def segment_batch(segment: PlannedSegment, data: bytes, low: int | None, high: int | None) -> Any:
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


class SegmentPartition(InputPartition):
    def __init__(self, segment: PlannedSegment) -> None:
        self.segment = segment


class ProbePartition(InputPartition):
    """register()'s check: its task imports what reading a segment needs, and reads nothing."""

    def __init__(self) -> None:
        self.probe = True


def _missing(error: Exception) -> bool:
    """A file or object that is not there (any more)."""
    if isinstance(error, FileNotFoundError):
        return True
    code = (getattr(error, "response", None) or {}).get("Error", {}).get("Code")
    return code in ("NoSuchKey", "404", "NotFound")


def _get_object(path: str, options: dict[str, str], key: str) -> bytes:
    url = path if path.startswith("s3://") else options.get("cold_url")
    if not url:
        raise OSError(f"streamkeep segment {key} is in the bucket: pass the cold_url option")
    return s3_client(options).get_object(Bucket=bucket_prefix(url)[0], Key=key)["Body"].read()


def _segment_bytes(path: str, options: dict[str, str], segment: PlannedSegment) -> bytes | None:
    """A planned segment's bytes; None if retention dropped it since it was planned."""
    try:
        if segment.path is not None:
            return Path(segment.path).read_bytes()
        return _get_object(path, options, segment.key or "")
    except Exception as error:
        if segment.directory is None or not _missing(error):
            raise
        directory = Path(segment.directory)
        if segment.next_start is not None and segment.next_start <= load_floor(directory):
            return None
        if segment.path is not None:  # uploaded, its local copy dropped since it was planned
            name = Path(segment.path).name
            entry = next((e for e in manifest_entries(directory) if e["file"] == name), None)
            if entry is not None:
                return _get_object(path, options, entry["key"])
        raise


def _reading_dependencies() -> None:
    """register()'s check, in a worker: it unpickled this module to get here (so streamkeep and
    cbor2 import), but numpy and pyarrow are imported only when a segment is decoded; fail on them
    now, not mid-job."""
    import numpy  # noqa: F401
    import pyarrow  # noqa: F401


def read_partition(path: str, options: dict[str, str], partition: Any) -> Iterator[Any]:
    """The Arrow batch of one segment (local file or object), CRCs checked."""
    if isinstance(partition, ProbePartition):
        _reading_dependencies()
        return
    segment = getattr(partition, "segment", None)
    if segment is None:
        return  # nothing was planned: Spark still calls read() once, with a bare InputPartition
    data = _segment_bytes(path, options, segment)
    if data is None:
        end = segment.next_start if segment.next_start is not None else segment.start
        data_lost(options, segment.stream, 0, segment.start, end, end, "while this job read them")
        return
    low, high = position_of(options.get("start_offset")), position_of(options.get("end_offset"))
    if segment.floor > segment.start:  # never for a floor at a segment start, as the server puts it
        low = max(low or 0, segment.floor)
    batch = segment_batch(segment, data, low, high)
    if batch.num_rows:
        yield batch


class StreamkeepReader(DataSourceReader):
    def __init__(self, options: Mapping[str, str]) -> None:
        self.options = dict(options)
        self.path = self.options.get("path") or ""
        fail_on_data_loss(self.options)  # a bad value fails now, not at the first loss

    def partitions(self) -> list[SegmentPartition] | list[ProbePartition]:
        if _option(self.options, workers.PROBE_OPTION):
            return [ProbePartition()]
        return [SegmentPartition(segment) for segment in plan_segments(self.path, self.options)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return read_partition(self.path, self.options, partition)


def _offset(done: dict, read: dict, lost: dict) -> dict:
    """A streaming offset; maps left out when empty, so offsets written before they existed and
    new ones compare equal when nothing happened."""
    offset: dict = {"next": done}
    if read:
        offset["read"] = read
    if lost:
        offset["lost"] = lost
    return offset


class StreamkeepStreamReader(DataSourceStreamReader):
    """Structured Streaming over sealed segments: each micro-batch reads the segments sealed since
    the last one. The offset is a JSON map Spark checkpoints, so a restarted query continues where
    it stopped: `next`, per stream, where the next segment to read starts at the earliest (one past
    the start of the last one read); `read`, per stream, the position up to which the query has read
    or accounted for everything (its floor when the query started, where it went on after a loss);
    `lost`, per stream, the losses skipped under `failOnDataLoss=false` (`times`, `bytes`). Option
    `max_files` caps segments per micro-batch.

    Data loss (option `failOnDataLoss`, true by default) is checked when a batch is planned
    (latestOffset: has a floor passed where the query stands?), when its partitions are listed
    (did one pass it since?) and when a segment is read (was it dropped meanwhile?)."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.options = dict(options)
        self.path = self.options.get("path") or ""
        fail_on_data_loss(self.options)
        self.low = position_of(self.options.get("start_offset"))
        self.high = position_of(self.options.get("end_offset"))

    def _look(self) -> tuple[list[PlannedSegment], list[PlannedSegment], dict[str, StreamInfo]]:
        """(every segment found, the sealed ones readers may see in read order, the streams)."""
        segments, streams = find_segments(self.path, self.options)
        sealed = sorted(
            (s for s in prune(segments, self.options) if not s.last), key=lambda s: (s.start, s.stream)
        )
        return segments, sealed, streams

    def _floor(self, info: StreamInfo | None) -> int | None:
        """The floor that matters to this query: data past `end_offset` it never wants."""
        if info is None or info.floor is None:
            return None
        return info.floor if self.high is None else min(info.floor, self.high)

    def _standing(self, info: StreamInfo, start: dict, segments: list[PlannedSegment]) -> tuple[int, bool]:
        """Where the query stands in a stream at offset `start` (everything before it was read, or
        retained away before the query started, or skipped under failOnDataLoss=false), and whether
        that is exact: it is at least that for an offset written before `read` existed, whose last
        segment read is gone."""
        read, done = start.get("read", {}), start.get("next", {})
        exact = True
        if info.name in read:
            position = read[info.name]
        elif info.name in done:  # one past the start of the last segment read: where that one ends
            last = done[info.name] - 1
            ends = [s.next_start for s in segments if s.stream == info.name and s.start == last]
            exact = bool(ends) and ends[0] is not None
            position = ends[0] if exact and ends[0] is not None else done[info.name]
        else:  # a stream this query has not read: a new one starts at 0, a fork at its fork point
            position = info.base
        return max(position, self.low or 0), exact

    def initialOffset(self) -> dict:
        """Streams already there are read from their floor now: what went before is not a loss."""
        _segments, _sealed, streams = self._look()
        read = {}
        for info in streams.values():
            floor = self._floor(info)
            if floor is not None and floor > max(info.base, self.low or 0):
                read[info.name] = floor
        return _offset({}, read, {})

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxFiles

        max_files = self.options.get("max_files")
        return ReadMaxFiles(int(max_files)) if max_files else ReadAllAvailable()

    def latestOffset(self, start: dict, limit: Any) -> dict:
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxFiles

        segments, sealed, streams = self._look()
        done = dict(start.get("next", {}))
        read = dict(start.get("read", {}))
        lost = {name: dict(count) for name, count in start.get("lost", {}).items()}
        for info in streams.values():
            floor = self._floor(info)
            position, exact = self._standing(info, start, segments)
            if floor is not None and floor > position:
                data_lost(
                    self.options,
                    info.name,
                    info.incarnation,
                    position,
                    floor,
                    floor,
                    "before this query read them",
                    exact=exact,
                )
                count = lost.setdefault(info.name, {"times": 0, "bytes": 0})
                count["times"] += 1
                count["bytes"] += floor - position
                read[info.name] = floor
        fresh = [s for s in sealed if s.start >= done.get(s.stream, 0)]
        if isinstance(limit, ReadMaxFiles):
            fresh = fresh[: max(1, limit.max_files)]
        elif not isinstance(limit, ReadAllAvailable):  # a row limit: one segment is the smallest step
            fresh = fresh[:1]
        for segment in fresh:
            done[segment.stream] = max(done.get(segment.stream, 0), segment.start + 1)
            read[segment.stream] = max(read.get(segment.stream, 0), segment.next_start or 0)
        return _offset(done, read, lost)

    def partitions(self, start: dict, end: dict) -> list[SegmentPartition]:
        segments, sealed, streams = self._look()
        low, high = start.get("next", {}), end.get("next", {})
        for name in high:
            info, floor = streams.get(name), self._floor(streams.get(name))
            if info is None or floor is None or high[name] <= low.get(name, 0):
                continue
            # Where this batch begins: where the query stood, or the floor it went on from.
            skipped = end.get("lost", {}).get(name, {}).get("bytes", 0)
            skipped -= start.get("lost", {}).get(name, {}).get("bytes", 0)
            position, exact = self._standing(info, start, segments)
            begin = position + skipped
            stop = min(floor, end.get("read", {}).get(name, floor))
            if stop > begin:  # retention passed it since latestOffset (or a restart replays the batch)
                data_lost(
                    self.options,
                    name,
                    info.incarnation,
                    begin,
                    stop,
                    floor,
                    "before this micro-batch read them",
                    exact=exact,
                )
        return [
            SegmentPartition(s) for s in sealed if low.get(s.stream, 0) <= s.start < high.get(s.stream, 0)
        ]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return read_partition(self.path, self.options, partition)

    def commit(self, end: dict) -> None:
        """Nothing to release: sealed segments never change."""


class StreamkeepDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "streamkeep"

    def schema(self) -> str:
        if _option(self.options, workers.PROBE_OPTION):
            _reading_dependencies()  # runs in the driver's planner worker, at load()
        return SCHEMA

    def reader(self, schema: Any) -> StreamkeepReader:
        return StreamkeepReader(self.options)

    def streamReader(self, schema: Any) -> StreamkeepStreamReader:
        return StreamkeepStreamReader(self.options)


def register(spark: Any, *, check: bool = True) -> None:
    """Makes `spark.read.format("streamkeep")` and `spark.readStream.format("streamkeep")`
    available in this session.

    Spark runs the source in Python workers that must import streamkeep and cbor2. In local mode
    with neither PYSPARK_PYTHON nor spark.pyspark.python set, the source's workers run this
    interpreter (`sys.executable`) rather than Spark's default `python3` from PATH; the session's
    own UDFs keep Spark's choice. With `check` (the default) a tiny read through the source runs
    once per application and interpreter (about a second, most of it starting the worker the first
    real read would start anyway) and a worker that cannot load it raises SparkSetupError, whose
    one-line message says what to set; `check=False` skips it (a cluster whose workers are known
    good, or a test that wants the raw failure).
    """
    python = workers.worker_python(workers.context(spark))
    workers.register_with(spark, StreamkeepDataSource, python)
    if check:
        workers.check(spark, python)


__all__ = [
    "SCHEMA",
    "DataLossError",
    "SparkSetupError",
    "StreamkeepDataSource",
    "fail_on_data_loss",
    "register",
    "segment_batch",
]
