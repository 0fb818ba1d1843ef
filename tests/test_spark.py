"""The PySpark data source over hot and cold segments, against a real local[2] Spark session."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ops.client import read_all
from tests.conftest import segment_files
from tests.test_cold import CREDENTIALS, Moto, cold_server, wait_until

pyspark = pytest.importorskip("pyspark", reason="pyspark is a dev dependency; make test installs it")

from streamkeep.segments import spark as sk  # noqa: E402


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
        assert f"0000000000000000_{ends[-1]:016d}" == tail
    assert {(r.producer_id, r.producer_epoch) for r in json_rows} == {("loader", 2)}
    assert sorted({r.producer_seq for r in json_rows}) == list(range(40))
    assert all(r.message_index < 5 for r in json_rows) and all(r.json is None for r in blob_rows)


def test_the_bucket_alone_is_readable(spark, archive) -> None:  # type: ignore[no-untyped-def]
    _data, moto, expected = archive
    rows = load(spark, "s3://archive/prod", moto, streams="blobs").orderBy("offset").collect()
    payload = b"".join(bytes(r.payload) for r in rows)
    assert rows and expected["blobs"].startswith(payload) and len(payload) < len(expected["blobs"])


def test_streams_and_offsets_are_pushed_down(archive) -> None:  # type: ignore[no-untyped-def]
    data, moto, _expected = archive
    options = {"endpoint": moto.url, "cold_url": "s3://archive/prod"}
    everything = sk.plan_segments(str(data), options)
    blobs = sk.plan_segments(str(data), {**options, "streams": "blob*"})
    assert {s.stream for s in blobs} == {"blobs"} and len(blobs) < len(everything)
    middle = blobs[len(blobs) // 2].start
    tail_only = sk.plan_segments(
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
