"""The on-disk format: a data directory and bucket written by format 1 still open, upgraded in
place, crash-safely and idempotently (tests/fixtures/format-v1)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest

from ops.client import read_all
from ops.serverproc import start
from streamkeep.segments import layout
from streamkeep.storage import files
from streamkeep.storage.cold import migrate
from streamkeep.storage.cold.store import ColdConfig, S3Store
from streamkeep.storage.disk.directory import DataDirectory
from tests.test_cold import CREDENTIALS, Moto

FIXTURE = Path(__file__).parent / "fixtures" / "format-v1"
T = {"Content-Type": "text/plain"}
# What the format-1 server was told (tests/fixtures/format-v1/make_v1.py.txt), stream by stream.
EXPECTED = {
    "plain": b"p0;p1;p2;p3;p4;p5;w1-0;w1-1;w1-2;",
    "closed": b"final",
    "chat/room-1": b"hi",
    "src": b"s0;s1;s2;",
    "src-fork": b"s0;s1;f0;",
    "gone-fork": b"g0;",
}


@pytest.fixture
def moto() -> Iterator[Moto]:
    server = Moto()
    server.start()
    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)
    yield server
    server.stop()


def s3(moto: Moto):  # type: ignore[no-untyped-def]
    return boto3.client(
        "s3",
        endpoint_url=moto.url,
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    )


def v1_world(tmp_path: Path, moto: Moto) -> Path:
    """The fixture's data directory copied to `tmp_path`, and its objects put in moto."""
    data = tmp_path / "data"
    shutil.copytree(FIXTURE / "data", data)
    # git keeps no empty directories; version 1 always had these two
    for empty in ("trash", "subscriptions"):
        (data / empty).mkdir(exist_ok=True)
    client = s3(moto)
    client.create_bucket(Bucket="archive")
    metadata = json.loads((FIXTURE / "bucket-metadata.json").read_text())
    for key, meta in metadata.items():
        client.put_object(
            Bucket="archive", Key=key, Body=(FIXTURE / "bucket" / key).read_bytes(), Metadata=meta
        )
    return data


def keys(moto: Moto) -> list[str]:
    return moto.keys("archive", "prod/streams/")  # the segments (descriptions live under prod/meta/)


def store(moto: Moto) -> S3Store:
    return S3Store(ColdConfig.from_url("s3://archive/prod", endpoint=moto.url, region="us-east-1"))


def assert_everything_reads_back(url: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        for name, content in EXPECTED.items():
            assert read_all(client, f"/v1/stream/{name}") == content, name
        assert client.get("/v1/stream/json", params={"offset": "-1"}).json() == [{"k": k} for k in range(4)]
        assert client.get("/v1/stream/closed", params={"offset": "-1"}).headers["stream-closed"] == "true"
        assert client.get("/v1/stream/gone-src").status_code == 410  # soft-deleted; its fork still reads it
        # State rebuilt from the records: producer w1 is at (epoch 2, seq 2), the last Stream-Seq "0005".
        producer = {**T, "Producer-Id": "w1", "Producer-Epoch": "2"}
        assert (
            client.post(
                "/v1/stream/plain", content=b"w1-2;", headers={**producer, "Producer-Seq": "2"}
            ).status_code
            == 204
        )
        assert (
            client.post(
                "/v1/stream/plain", content=b"w1-3;", headers={**producer, "Producer-Seq": "3"}
            ).status_code
            == 200
        )
        assert (
            client.post("/v1/stream/plain", content=b"x", headers={**T, "Stream-Seq": "0005"}).status_code
            == 409
        )
        assert client.post("/v1/stream/closed", content=b"x", headers=T).status_code == 409
        assert read_all(client, "/v1/stream/plain") == EXPECTED["plain"] + b"w1-3;"


def cold_args(data: Path, moto: Moto) -> list[str]:
    return [
        "--storage",
        "disk",
        "--data-dir",
        str(data),
        "--cold-url",
        "s3://archive/prod",
        "--cold-endpoint",
        moto.url,
    ]


def test_a_format_1_directory_and_bucket_are_upgraded_at_start(tmp_path: Path, moto: Moto) -> None:
    data = v1_world(tmp_path, moto)
    assert all(layout.parse_cold_key("prod/streams/", key)[1] is None for key in keys(moto))  # type: ignore[index]
    server = start(*cold_args(data, moto), env=CREDENTIALS)
    try:
        assert any("upgrading" in line and "from format 1 to 2" in line for line in server.output)
        assert (data / layout.FORMAT_FILE).read_text() == layout.FORMAT_LINE
        moved = keys(moto)
        assert len(moved) == 2 and all(
            layout.parse_cold_key("prod/streams/", k)[1] is not None for k in moved
        )  # type: ignore[index]
        assert_everything_reads_back(server.url)
    finally:
        server.stop()
    again = start(*cold_args(data, moto), env=CREDENTIALS)  # a second start has nothing to upgrade
    try:
        assert not any("upgrading" in line for line in again.output)
        assert read_all(httpx.Client(base_url=again.url, timeout=30), "/v1/stream/src") == EXPECTED["src"]
    finally:
        again.stop()


def test_a_format_1_directory_with_cold_segments_needs_its_bucket(tmp_path: Path, moto: Moto) -> None:
    data = v1_world(tmp_path, moto)
    with pytest.raises(RuntimeError) as failed:
        start("--storage", "disk", "--data-dir", str(data))
    assert "--cold-url" in str(failed.value) and "Traceback" not in str(failed.value)
    assert (data / layout.FORMAT_FILE).read_text() == "streamkeep-segments 1\n"  # nothing half-done


class CrashAfter:
    """An object store that 'crashes' (raises) after a number of mutating calls."""

    def __init__(self, real: S3Store, calls: int) -> None:
        self.real, self.left, self.config = real, calls, real.config

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        method = getattr(self.real, name)
        if name not in ("copy", "delete"):
            return method

        def call(*args):  # type: ignore[no-untyped-def]
            if self.left == 0:
                raise OSError("simulated crash")
            self.left -= 1
            return method(*args)

        return call


@pytest.mark.parametrize("crash_after", [0, 1, 2])
def test_migrate_is_idempotent_and_finishes_after_a_crash_anywhere(
    tmp_path: Path, moto: Moto, crash_after: int
) -> None:
    data = v1_world(tmp_path, moto)
    lines: list[str] = []
    with pytest.raises(OSError, match="simulated crash"):
        migrate.upgrade(files.OS, data, CrashAfter(store(moto), crash_after), lines.append)  # type: ignore[arg-type]
    assert DataDirectory(files.OS, data).format_version() == 1  # the marker is written last
    command = [
        sys.executable,
        "-m",
        "streamkeep",
        "migrate",
        "--data-dir",
        str(data),
        *cold_args(data, moto)[4:],
    ]
    env = {**os.environ, **CREDENTIALS}
    first = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert first.returncode == 0, first.stderr
    assert "[1/1] plain" in first.stderr and "is in format 2" in first.stderr
    second = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert second.returncode == 0 and "nothing to do" in second.stderr
    moved = keys(moto)
    assert len(moved) == 2, moved  # no copy left behind under the old keys
    assert all(layout.parse_cold_key("prod/streams/", k)[1] is not None for k in moved)  # type: ignore[index]
    server = start(*cold_args(data, moto), env=CREDENTIALS)
    try:
        assert_everything_reads_back(server.url)
    finally:
        server.stop()
