"""The PySpark data source over hot and cold segments, against a real local[2] Spark session."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ops.client import read_all
from tests.conftest import segment_files
from tests.test_cold import CREDENTIALS, Moto, cold_server, wait_until

pyspark = pytest.importorskip("pyspark", reason="pyspark is a dev dependency; make test installs it")

from streamkeep.segments.spark import plan  # noqa: E402
from streamkeep.segments.spark import source as sk  # noqa: E402


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    from pyspark.sql import SparkSession

    # Spark's Python workers must import streamkeep: run them on this interpreter (the venv's).
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[2]")
        .appName("streamkeep-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    sk.register(session)
    yield session
    session.stop()


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Moto, dict]]:
    """A data directory written through the HTTP API, part of it already moved to the bucket."""
    data = tmp_path_factory.mktemp("spark-data")
    moto = Moto()
    moto.start()
    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)
    server = cold_server(data, moto, "--segment-max-bytes", "64KiB")
    expected: dict = {}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        client.put("/v1/stream/events/json", headers={"Content-Type": "application/json"})
        for batch in range(40):
            body = json.dumps([{"batch": batch, "i": i, "pad": "x" * 300} for i in range(5)])
            headers = {
                "Content-Type": "application/json",
                "Producer-Id": "loader",
                "Producer-Epoch": "2",
                "Producer-Seq": str(batch),
            }
            assert client.post("/v1/stream/events/json", content=body, headers=headers).status_code == 200
        client.put("/v1/stream/blobs", headers={"Content-Type": "application/octet-stream"})
        for n in range(30):
            client.post(
                "/v1/stream/blobs",
                content=os.urandom(7_000 + n),
                headers={"Content-Type": "application/octet-stream"},
            )
        wait_until(
            lambda: len(segment_files(data, "blobs")) == 1 and len(segment_files(data, "events/json")) == 1,
            what="sealed segments to move to the bucket",
        )
        expected["json"] = client.get("/v1/stream/events/json", params={"offset": "-1"}).json()
        expected["blobs"] = read_all(client, "/v1/stream/blobs")
        expected["json_tail"] = client.head("/v1/stream/events/json").headers["stream-next-offset"]
        expected["blobs_tail"] = client.head("/v1/stream/blobs").headers["stream-next-offset"]
    server.stop()
    yield data, moto, expected
    moto.stop()


def load(spark, path: str, moto: Moto, **options: str):  # type: ignore[no-untyped-def]
    settings = {
        "endpoint": moto.url,
        "cold_url": "s3://archive/prod",
        "access_key": "test",
        "secret_key": "test",
    }
    reader = spark.read.format("streamkeep")
    for key, value in {**settings, **options}.items():
        reader = reader.option(key, value)
    return reader.load(path)


def test_rows_equal_what_the_http_api_returns(spark, archive) -> None:  # type: ignore[no-untyped-def]
    data, moto, expected = archive
    rows = load(spark, str(data), moto).orderBy("stream", "offset").collect()
    json_rows = [r for r in rows if r.stream == "events/json"]
    blob_rows = [r for r in rows if r.stream == "blobs"]
    assert [json.loads(r.json) for r in json_rows] == expected["json"]
    assert b"".join(bytes(r.payload) for r in blob_rows) == expected["blobs"]
    for stream_rows, tail in ((json_rows, expected["json_tail"]), (blob_rows, expected["blobs_tail"])):
        positions = [int(r.offset[17:]) for r in stream_rows]
        ends = [p + len(r.payload) for p, r in zip(positions, stream_rows, strict=True)]
        assert positions[0] == 0 and positions[1:] == ends[:-1]  # contiguous, in order, no gaps
        # Spark rows carry the HTTP API's tokens: same incarnation, same position
        assert stream_rows[-1].offset[:17] + f"{ends[-1]:016d}" == tail
    assert {(r.producer_id, r.producer_epoch) for r in json_rows} == {("loader", 2)}
    assert sorted({r.producer_seq for r in json_rows}) == list(range(40))
    assert all(r.message_index < 5 for r in json_rows) and all(r.json is None for r in blob_rows)


def test_the_bucket_alone_is_readable(spark, archive) -> None:  # type: ignore[no-untyped-def]
    _data, moto, expected = archive
    rows = load(spark, "s3://archive/prod", moto, streams="blobs").orderBy("offset").collect()
    payload = b"".join(bytes(r.payload) for r in rows)
    assert rows and expected["blobs"].startswith(payload) and len(payload) < len(expected["blobs"])


def test_an_empty_selection_is_an_empty_frame(spark, archive) -> None:  # type: ignore[no-untyped-def]
    data, moto, _expected = archive
    assert load(spark, str(data), moto, streams="no-such-stream*").count() == 0


def test_streams_and_offsets_are_pushed_down(archive) -> None:  # type: ignore[no-untyped-def]
    data, moto, _expected = archive
    options = {"endpoint": moto.url, "cold_url": "s3://archive/prod"}
    everything = plan.plan_segments(str(data), options)
    blobs = plan.plan_segments(str(data), {**options, "streams": "blob*"})
    assert {s.stream for s in blobs} == {"blobs"} and len(blobs) < len(everything)
    middle = blobs[len(blobs) // 2].start
    tail_only = plan.plan_segments(
        str(data), {**options, "streams": "blobs", "start_offset": f"0000000000000000_{middle:016d}"}
    )
    assert len(tail_only) < len(blobs) and tail_only[0].start <= middle


def test_a_damaged_sealed_segment_fails_the_job_naming_it(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from ops.serverproc import start

    server = start("--storage", "disk", "--data-dir", str(tmp_path), "--segment-max-messages", "2")
    for i in range(5):
        httpx.put(f"{server.url}/v1/stream/bad", headers={"Content-Type": "text/plain"})
        httpx.post(
            f"{server.url}/v1/stream/bad", content=b"row-%d" % i, headers={"Content-Type": "text/plain"}
        )
    server.stop(signal.SIGKILL)
    sealed = segment_files(tmp_path, "bad")[0]
    damaged = bytearray(sealed.read_bytes())
    damaged[-1] ^= 0xFF
    sealed.write_bytes(bytes(damaged))
    with pytest.raises(Exception) as caught:
        spark.read.format("streamkeep").load(str(tmp_path)).collect()
    assert sealed.name in str(caught.value) and "damaged" in str(caught.value)


def stream_to_parquet(spark, data: Path, out: Path, checkpoint: Path, **options: str):  # type: ignore[no-untyped-def]
    """One availableNow run of the streaming source over `data` into parquet at `out`."""
    reader = spark.readStream.format("streamkeep")
    for key, value in options.items():
        reader = reader.option(key, value)
    query = (
        reader.load(str(data))
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return query


def test_streaming_picks_up_new_sealed_segments_and_resumes(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from ops.serverproc import start

    data, out, checkpoint = tmp_path / "data", tmp_path / "out", tmp_path / "checkpoint"
    server = start("--storage", "disk", "--data-dir", str(data), "--segment-max-messages", "2")
    url = f"{server.url}/v1/stream/live"

    def append(first: int, count: int) -> None:
        for i in range(first, first + count):
            assert (
                httpx.post(url, content=b"m%02d" % i, headers={"Content-Type": "text/plain"}).status_code
                == 204
            )

    def run_query() -> list[str]:
        stream_to_parquet(spark, data, out, checkpoint)
        return sorted(bytes(r.payload).decode() for r in spark.read.parquet(str(out)).collect())

    try:
        httpx.put(url, headers={"Content-Type": "text/plain"})
        append(0, 5)  # sealed: m00-m03; m04 is in the open segment
        assert run_query() == [f"m{i:02d}" for i in range(4)]
        append(5, 4)  # sealed now: m00-m07
        assert run_query() == [f"m{i:02d}" for i in range(8)]  # a restarted query: each message once
    finally:
        server.stop()


def _fold(messages: list) -> dict[tuple[str, str], object]:
    """The State Protocol applied the plain way, one message after another (seed 001 §5-6)."""
    state: dict[tuple[str, str], object] = {}
    for message in messages:
        if not isinstance(message, dict):
            continue
        headers = message.get("headers", {})
        if headers.get("control") == "reset":
            state.clear()
            continue
        kind, key, operation = message.get("type"), message.get("key"), headers.get("operation")
        if not (isinstance(kind, str) and kind and isinstance(key, str) and key):
            continue  # a change needs a non-empty type and key
        if operation in ("insert", "update") and "value" in message:
            state[(kind, key)] = message["value"]
        elif operation == "delete":
            state.pop((kind, key), None)
    return state


def test_state_protocol_job_matches_a_sequential_fold(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from ops.serverproc import start
    from ops.spark import state_materialize

    rng = __import__("random").Random(7)
    data = tmp_path / "data"
    server = start("--storage", "disk", "--data-dir", str(data), "--segment-max-messages", "7")
    streams: dict[str, list] = {"state/users": [], "state/orders": []}
    try:
        for name in streams:
            httpx.put(f"{server.url}/v1/stream/{name}", headers={"Content-Type": "application/json"})
        for step in range(300):
            name = rng.choice(list(streams))
            roll = rng.random()
            key = f"k{rng.randrange(12)}"
            if roll < 0.55:
                message: object = {
                    "type": "row",
                    "key": key,
                    "value": {"v": step},
                    "headers": {"operation": rng.choice(["insert", "update"])},
                }
            elif roll < 0.8:
                message = {"type": "row", "key": key, "headers": {"operation": "delete"}}
            elif roll < 0.83:
                message = {"headers": {"control": "reset"}}
            elif roll < 0.9:
                message = {"headers": {"control": "snapshot-start"}}
            else:
                message = rng.choice(
                    [
                        {"type": "row", "key": key},
                        {"headers": {"operation": "upsert"}},
                        {"type": "", "key": key, "value": 1, "headers": {"operation": "insert"}},
                        42,
                    ]
                )
            streams[name].append(message)
            body = json.dumps([message])
            assert (
                httpx.post(
                    f"{server.url}/v1/stream/{name}",
                    content=body,
                    headers={"Content-Type": "application/json"},
                ).status_code
                == 204
            )
    finally:
        server.stop()
    out = tmp_path / "state"
    state, rejected = state_materialize.materialize(
        spark.read.format("streamkeep").option("streams", "state/*").load(str(data))
    )
    state.write.mode("overwrite").parquet(str(out))
    got = {(r.stream, r.type, r.key): json.loads(r.value) for r in spark.read.parquet(str(out)).collect()}
    expected = {
        (name, kind, key): value
        for name, messages in streams.items()
        for (kind, key), value in _fold(messages).items()
    }
    assert got == expected
    invalid = sum(
        1
        for messages in streams.values()
        for m in messages
        if state_materialize.classify(json.dumps(m))[0] == "rejected"
    )
    assert rejected == invalid > 0


def test_export_job_partitions_by_stream_and_day(tmp_path: Path, spark) -> None:  # type: ignore[no-untyped-def]
    from ops.serverproc import start
    from ops.spark import export_parquet

    data = tmp_path / "data"
    # Without __registry__: it would be exported too (a partition and two rows more).
    server = start("--storage", "disk", "--data-dir", str(data), "--no-registry")
    for name in ("exp/a", "exp/b"):
        httpx.put(f"{server.url}/v1/stream/{name}", headers={"Content-Type": "text/plain"})
        for i in range(3):
            httpx.post(
                f"{server.url}/v1/stream/{name}", content=b"%d" % i, headers={"Content-Type": "text/plain"}
            )
    server.stop()
    out = tmp_path / "export"
    assert export_parquet.main([str(data), str(out)]) == 0
    partitions = sorted(p.relative_to(out).as_posix() for p in out.glob("stream=*/day=*"))
    assert len(partitions) == 2 and all(p.count("/") == 1 for p in partitions)
    assert spark.read.parquet(str(out)).count() == 6


def test_buckets_of_both_key_layouts_read_the_same(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Format 1 keys (`<stream dir>/<segment>`) and format 2 keys (with the incarnation) both read."""
    from streamkeep.storage import files
    from streamkeep.storage.cold import migrate
    from tests.test_format import store, v1_world

    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)
    moto = Moto()
    moto.start()
    try:
        data = v1_world(tmp_path, moto)

        def plain_bytes() -> bytes:
            rows = load(spark, "s3://archive/prod", moto, streams="plain").orderBy("offset").collect()
            return b"".join(bytes(r.payload) for r in rows)

        assert plain_bytes() == b"p0;p1;p2;p3;p4;p5;"  # the two segments format 1 moved to the bucket
        migrate.upgrade(files.OS, data, store(moto), lambda line: None)
        assert all("/plain/" in key and key.count("/") == 4 for key in moto.keys("archive"))
        assert plain_bytes() == b"p0;p1;p2;p3;p4;p5;"
    finally:
        moto.stop()


# ---- retention: readers see a stream from its floor on ------------------------------------------

TEXT = {"Content-Type": "text/plain"}
RETAINED = ("--segment-max-messages", "2", "--retention-max-bytes", "20", "--retention-interval", "0.2")


def _floor(client: httpx.Client, name: str) -> int:
    return int(client.head(f"/v1/stream/{name}").headers["stream-earliest-offset"].rsplit("_", 1)[1])


def _pinned_and_dropped(client: httpx.Client) -> dict[str, bytes]:
    """Stream `src` keeps its segments below the floor (a fork pins them), `plain` lost them: each
    of 20 three-byte messages, two per segment, the floor at 36 (20 bytes kept, one segment more).
    Returns what `offset=-1` reads of each."""
    for name in ("src", "plain"):
        assert client.put(f"/v1/stream/{name}", headers=TEXT).status_code == 201
    for n in range(20):
        if n == 4:  # the fork reads src's first 6 bytes: src's bytes from 0 stay while it exists
            incarnation = client.head("/v1/stream/src").headers["stream-next-offset"][:16]
            fork = {
                **TEXT,
                "Stream-Forked-From": "/v1/stream/src",
                "Stream-Fork-Offset": f"{incarnation}_{6:016d}",
            }
            assert client.put("/v1/stream/fork", headers=fork).status_code == 201
        for name in ("src", "plain"):
            assert (
                client.post(
                    f"/v1/stream/{name}", content=b"%s%02d" % (name[0].encode(), n), headers=TEXT
                ).status_code
                == 204
            )
    wait_until(lambda: _floor(client, "src") == 36 and _floor(client, "plain") == 36, 20, "floors to move")
    return {name: read_all(client, f"/v1/stream/{name}") for name in ("src", "plain")}


def _payloads(rows: list) -> dict[str, bytes]:
    """Each stream's payloads joined, in the order of `rows`."""
    out: dict[str, bytes] = {}
    for row in rows:
        out[row.stream] = out.get(row.stream, b"") + bytes(row.payload)
    return out


def test_batch_reads_start_at_the_floor_even_with_files_below_it(spark, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from ops.serverproc import start
    from streamkeep import archive as archive_command

    server = start("--storage", "disk", "--data-dir", str(tmp_path), *RETAINED)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            expected = _pinned_and_dropped(client)
    finally:
        server.stop()
    assert expected["src"] == b"".join(b"s%02d" % n for n in range(12, 20))
    assert expected["plain"] == b"".join(b"p%02d" % n for n in range(12, 20))
    below = [p.name for p in segment_files(tmp_path, "src") if int(p.stem) < 36]
    assert len(below) == 6  # still there for the fork, but no reader of src may see them
    assert int(segment_files(tmp_path, "plain")[0].stem) == 36  # dropped: nothing pins them
    planned = plan.plan_segments(str(tmp_path), {"streams": "src,plain"})
    assert {s.start for s in planned} == {36, 42, 48, 54}
    rows = (
        spark.read.format("streamkeep")
        .option("streams", "src,plain")
        .load(str(tmp_path))
        .orderBy("stream", "offset")
        .collect()
    )
    assert _payloads(rows) == expected
    assert min(int(r.offset[17:]) for r in rows) == 36  # positions are the stream's own
    # A fork's own data starts at its fork point: the fork has none, and reads nothing of src.
    assert spark.read.format("streamkeep").option("streams", "fork").load(str(tmp_path)).count() == 0

    archive_command.status(SimpleNamespace(storage=SimpleNamespace(data_dir=str(tmp_path))))
    table = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:-1]}
    # local segs, local bytes, cold segs, cold bytes, to upload, floor, below floor
    assert table["src"][1] == "4" and table["src"][6:] == ["36", "6"]
    assert table["plain"][1] == "4" and table["plain"][6:] == ["36", "0"]
    assert table["fork"][6:] == ["-", "0"]


def test_cold_segments_below_the_floor_are_skipped_and_their_leftovers_are_orphans(
    spark, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    import cbor2

    moto = Moto()
    moto.start()
    try:
        server = cold_server(tmp_path, moto, *RETAINED)
        try:
            with httpx.Client(base_url=server.url, timeout=10) as client:
                expected = _pinned_and_dropped(client)
                wait_until(
                    lambda: len(segment_files(tmp_path, "src")) == 1, what="src's sealed segments to move"
                )
        finally:
            server.stop()
        directory = tmp_path / "streams" / "src"
        entries = cbor2.loads((directory / "cold.cbor").read_bytes())["segments"]
        assert sum(1 for e in entries if e["start"] < 36) == 6  # pinned by the fork: listed, in the bucket
        rows = load(spark, str(tmp_path), moto, streams="src").orderBy("offset").collect()
        assert _payloads(rows) == {"src": expected["src"]}
        # A drop cut short after the manifest (step 2): the objects stay, no manifest lists them.
        kept = [e for e in entries if e["start"] >= 36]
        (directory / "cold.cbor").write_bytes(cbor2.dumps({"v": 1, "segments": kept}))
        rows = load(spark, str(tmp_path), moto, streams="src").orderBy("offset").collect()
        assert _payloads(rows) == {"src": expected["src"]}
        verify = subprocess.run(
            [sys.executable, "-m", "streamkeep", "archive", "verify", "--data-dir", str(tmp_path),
             "--cold-url", "s3://archive/prod", "--cold-endpoint", moto.url],
            capture_output=True, text=True, env={**os.environ, **CREDENTIALS}, timeout=60,
        )  # fmt: skip
        # Young as they are, they are orphans: below the floor with no local file, nothing records
        # them. (Objects of `plain` the server had not deleted yet when it stopped count too.)
        found = re.search(
            r"0 problems; (\d+) orphaned objects \((\d+) of segments retention dropped\)", verify.stdout
        )
        assert found and found[1] == found[2] and int(found[1]) >= 6, verify.stdout
        assert all(f"orphan: {e['key']}" in verify.stdout for e in entries if e["start"] < 36)
    finally:
        moto.stop()


def test_streaming_fails_on_data_loss_unless_told_to_go_on(spark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from pyspark.errors import StreamingQueryException

    from ops.serverproc import start

    data, out, checkpoint = tmp_path / "data", tmp_path / "out", tmp_path / "checkpoint"
    # 12 bytes kept at least: 5 messages of 3 bytes leave the floor at 0, 12 move it to 24.
    server = start(
        "--storage",
        "disk",
        "--data-dir",
        str(data),
        *RETAINED[:2],
        "--retention-max-bytes",
        "12",
        *RETAINED[4:],
    )

    def run_query(**options: str):  # type: ignore[no-untyped-def]
        return stream_to_parquet(spark, data, out, checkpoint, **options)

    def written() -> list[str]:
        return sorted(bytes(r.payload).decode() for r in spark.read.parquet(str(out)).collect())

    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            client.put("/v1/stream/live", headers=TEXT)
            for n in range(5):
                client.post("/v1/stream/live", content=b"m%02d" % n, headers=TEXT)
            run_query()
            assert written() == ["m00", "m01", "m02", "m03"]  # m04 is in the open segment
            incarnation = client.head("/v1/stream/live").headers["stream-next-offset"][:16]
            for n in range(5, 12):
                client.post("/v1/stream/live", content=b"m%02d" % n, headers=TEXT)
            wait_until(lambda: _floor(client, "live") == 24, 20, "the floor to pass the query")
            assert read_all(client, "/v1/stream/live") == b"m08m09m10m11"
        with pytest.raises(StreamingQueryException) as caught:
            run_query()  # failOnDataLoss defaults to true
        message = str(caught.value)
        assert "'live'" in message and "failOnDataLoss" in message
        assert f"{incarnation}_{12:016d} up to {incarnation}_{24:016d} (12 bytes)" in message
        assert written() == ["m00", "m01", "m02", "m03"]
        query = run_query(failOnDataLoss="false")
        assert written() == ["m00", "m01", "m02", "m03", "m08", "m09"]  # m04-m07 lost, m10-m11 open
        end = query.lastProgress["sources"][0]["endOffset"]
        end = json.loads(end) if isinstance(end, str) else end
        assert end["lost"] == {"live": {"times": 1, "bytes": 12}} and end["read"] == {"live": 30}
        run_query()  # the loss is behind the checkpoint now: nothing new, no failure
        assert len(written()) == 6
    finally:
        server.stop()


def test_a_floor_passing_a_planned_batch_and_old_checkpoints(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """The stream reader's own calls, without a query: retention passing a batch between its
    planning and its partitions, or while a segment is read; and offsets written before `read`."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from ops.serverproc import start
    from streamkeep.segments.floor import FloorCheckpoint
    from streamkeep.storage import files
    from streamkeep.storage.disk import floor as floors

    server = start("--storage", "disk", "--data-dir", str(tmp_path), "--segment-max-messages", "2")
    try:
        httpx.put(f"{server.url}/v1/stream/live", headers=TEXT)
        for n in range(9):  # segments at 0, 6, 12, 18 sealed; m08 in the open one at 24
            httpx.post(f"{server.url}/v1/stream/live", content=b"m%02d" % n, headers=TEXT)
        incarnation = httpx.head(f"{server.url}/v1/stream/live").headers["stream-next-offset"][:16]
    finally:
        server.stop()
    directory = tmp_path / "streams" / "live"

    def retain(floor: int) -> None:  # what a retention pass does: the floor first, then the files
        floors.save(files.OS, directory, FloorCheckpoint(floor))
        for path in segment_files(tmp_path, "live"):
            if int(path.stem) < floor:
                path.unlink()

    strict = sk.StreamkeepStreamReader({"path": str(tmp_path)})
    lenient = sk.StreamkeepStreamReader({"path": str(tmp_path), "failondataloss": "false"})
    begin = strict.initialOffset()
    assert begin == {"next": {}}
    end = strict.latestOffset(begin, ReadAllAvailable())
    assert end == {"next": {"live": 19}, "read": {"live": 24}}
    retain(12)
    with pytest.raises(sk.DataLossError, match=f"{incarnation}_{0:016d} up to {incarnation}_{12:016d}"):
        strict.partitions(begin, end)
    with caplog.at_level("WARNING", logger="streamkeep.segments.spark.source"):
        planned = lenient.partitions(begin, end)
    assert [p.segment.start for p in planned] == [12, 18] and "failOnDataLoss is false" in caplog.text
    retain(18)  # while the batch reads: the segment at 12 goes
    with pytest.raises(sk.DataLossError, match="while this job read them"):
        list(sk.read_partition(str(tmp_path), strict.options, planned[0]))
    assert list(sk.read_partition(str(tmp_path), lenient.options, planned[0])) == []
    assert [b.num_rows for b in sk.read_partition(str(tmp_path), strict.options, planned[1])] == [2]
    # A query that had read up to 18 (`read`) lost nothing; one at 12 lost [12, 18).
    assert strict.latestOffset({"next": {"live": 13}, "read": {"live": 18}}, ReadAllAvailable())["next"] == {
        "live": 19
    }
    with pytest.raises(sk.DataLossError, match=r"\(6 bytes\) were retained away"):
        strict.latestOffset({"next": {"live": 7}, "read": {"live": 12}}, ReadAllAvailable())
    # An offset of the previous version ("next" only: one past the last segment start read) whose
    # last segment is gone: where it ended is unknown, so the loss is reported as possible.
    with pytest.raises(sk.DataLossError, match=r"at most 5 bytes\) may have been retained away"):
        strict.latestOffset({"next": {"live": 13}}, ReadAllAvailable())
    moved = lenient.latestOffset({"next": {"live": 13}}, ReadAllAvailable())
    assert moved == {"next": {"live": 19}, "read": {"live": 24}, "lost": {"live": {"times": 1, "bytes": 5}}}
    # ...and when it is still there, exact: nothing was lost.
    assert strict.latestOffset({"next": {"live": 19}}, ReadAllAvailable()) == {"next": {"live": 19}}
    # A query starting now reads from the floor: what went before is no loss.
    assert strict.initialOffset() == {"next": {}, "read": {"live": 18}}
    with pytest.raises(ValueError, match="failOnDataLoss must be true or false"):
        sk.StreamkeepStreamReader({"path": str(tmp_path), "failOnDataLoss": "maybe"})
