"""`streamkeep restore --from-bucket`: every data directory gone, the bucket (a real moto server)
brings the streams back through a real server process, byte for byte up to what was uploaded."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from botocore.exceptions import ClientError

from ops.client import read_all
from ops.serverproc import ServerProcess, start
from streamkeep.cluster.placement import Member, Placement
from streamkeep.segments import layout
from streamkeep.storage import files
from streamkeep.storage.cold import describe
from streamkeep.storage.disk import manifest
from streamkeep.storage.disk.meta import decode_meta
from tests.conftest import segment_files
from tests.test_cold import CREDENTIALS, Moto, wait_until

TEXT = {"Content-Type": "text/plain"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def moto() -> Iterator[Moto]:
    server = Moto()
    server.start()
    yield server
    server.stop()


def cold_flags(moto: Moto) -> list[str]:
    return ["--cold-url", "s3://archive/prod", "--cold-endpoint", moto.url]


def serve(data: Path, moto: Moto) -> ServerProcess:
    return start(
        "--storage",
        "disk",
        "--data-dir",
        str(data),
        *cold_flags(moto),
        "--cold-create-bucket",
        "--segment-max-bytes",
        "64KiB",
        "--segment-max-age",
        "1s",
        env=CREDENTIALS,
    )


def restore(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "streamkeep", "restore", "--from-bucket", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **CREDENTIALS},
        timeout=60,
    )


def position(token: str) -> int:
    return int(token.rsplit("_", 1)[1])


def tail(client: httpx.Client, name: str) -> str:
    return client.head(f"/v1/stream/{name}").headers["stream-next-offset"]


def all_in_the_bucket(data: Path, bucket: Any, name: str, at: int, *, closed: bool = False) -> bool:
    """Every byte up to `at` sealed and uploaded, and the stream's description in the bucket says so."""
    local = segment_files(data, name)
    if len(local) != 1 or layout.segment_start(local[0].name) != at:
        return False
    directory = local[0].parent
    meta = decode_meta((directory / layout.META).read_bytes())
    key = describe.stream_object_key("prod", directory.name, meta.stream_id)
    try:
        body = bucket.get_object(Bucket="archive", Key=key)["Body"].read()
    except ClientError:
        return False
    described = describe.StreamObject.decode(body)
    return described.segments == manifest.load_manifest(files.OS, directory) and (
        not closed or described.close is not None
    )


def test_every_copy_gone_the_bucket_restores_what_was_uploaded(tmp_path: Path, moto: Moto) -> None:
    data, restored = tmp_path / "data", tmp_path / "restored"
    bucket = moto.client()  # one client for every poll: making one costs more than the call
    server = serve(data, moto)
    chunks = [os.urandom(40_000) for _ in range(5)]  # 64 KiB segments: several per stream
    offsets: list[str] = []  # the token after each append, to read from after the restore
    producer = {**TEXT, "Producer-Id": "w", "Producer-Epoch": "1"}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.put("/v1/stream/plain", headers=TEXT).status_code == 201
        for number, chunk in enumerate(chunks, 1):
            answer = client.post(
                "/v1/stream/plain", content=chunk, headers={**TEXT, "Stream-Seq": f"{number:04d}"}
            )
            assert answer.status_code == 204
            offsets.append(answer.headers["stream-next-offset"])
        assert client.put("/v1/stream/events", headers=JSON).status_code == 201
        client.post("/v1/stream/events", content=b'[{"k": 0}, {"k": 1}]', headers=JSON)
        client.post("/v1/stream/events", content=b'{"k": 2}', headers=JSON)
        assert client.put("/v1/stream/orders", headers=TEXT).status_code == 201
        for seq in range(5):
            answer = client.post(
                "/v1/stream/orders",
                content=f"o{seq};".encode(),
                headers={**producer, "Producer-Seq": str(seq)},
            )
            assert answer.status_code == 200
        client.put("/v1/stream/done", headers=TEXT)
        client.post("/v1/stream/done", content=b"bye", headers=TEXT)
        client.put("/v1/stream/closed-with-data", headers=TEXT)
        assert (
            client.post(
                "/v1/stream/closed-with-data", content=b"last", headers={**TEXT, "Stream-Closed": "true"}
            ).status_code
            == 204
        )
        client.put("/v1/stream/ttl", content=b"short-lived", headers={**TEXT, "Stream-TTL": "3600"})
        client.put("/v1/stream/empty", headers=TEXT)
        fork_headers = {**TEXT, "Stream-Forked-From": "/v1/stream/plain", "Stream-Fork-Offset": offsets[1]}
        assert client.put("/v1/stream/plain-fork", headers=fork_headers).status_code == 201
        client.post("/v1/stream/plain-fork", content=b"F;", headers=TEXT)
        client.put("/v1/stream/gone", content=os.urandom(70_000), headers=TEXT)  # a segment in the bucket
        client.put("/v1/stream/gone-empty", headers=TEXT)  # only a description
        names = ["plain", "events", "orders", "done", "closed-with-data", "ttl", "empty", "plain-fork"]
        tails = {name: tail(client, name) for name in names}
        for name in names:
            wait_until(
                lambda name=name: all_in_the_bucket(data, bucket, name, position(tails[name])),
                30,
                f"{name} uploaded",
            )
        # A delete takes the description and the sidecars with the segments.
        for name in ("gone", "gone-empty"):
            wait_until(
                lambda name=name: all_in_the_bucket(data, bucket, name, position(tail(client, name))),
                30,
                f"{name} uploaded",
            )
            assert moto.keys("archive", f"prod/meta/{name}/")
            assert client.delete(f"/v1/stream/{name}").status_code == 204
        for prefix in ("prod/meta/gone/", "prod/streams/gone/", "prod/meta/gone-empty/"):
            wait_until(lambda prefix=prefix: moto.keys("archive", prefix) == [], 30, f"{prefix} deleted")
        # A close after the last uploaded byte sits in a segment that is never sealed: the description carries it.
        assert client.post("/v1/stream/done", headers={"Stream-Closed": "true"}).status_code == 204
        wait_until(
            lambda: all_in_the_bucket(data, bucket, "done", position(tails["done"]), closed=True),
            30,
            "the close described",
        )
        # Acknowledged, but younger than --segment-max-age when every copy goes: not in the bucket.
        assert client.post("/v1/stream/plain", content=b"late", headers=TEXT).status_code == 204
    stream_dirs = sorted(p.name for p in (data / layout.STREAMS).iterdir() if not p.name.startswith("."))
    server.stop(signal.SIGKILL)
    shutil.rmtree(data)

    done = restore("--data-dir", str(restored), *cold_flags(moto))
    assert done.returncode == 0, done.stderr
    assert f"{len(stream_dirs)}/{len(stream_dirs)} streams" in done.stderr
    assert f"restored {len(stream_dirs)} streams" in done.stderr
    assert sorted(p.name for p in (restored / layout.STREAMS).iterdir()) == stream_dirs
    # No segment was downloaded: what is local is one empty active segment per stream (a close at most).
    local = list(restored.rglob("*" + layout.SEGMENT_SUFFIX))
    assert len(local) == len(stream_dirs) and all(path.stat().st_size < 200 for path in local)

    server = serve(restored, moto)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            acked = b"".join(chunks)
            plain = read_all(client, "/v1/stream/plain")
            assert plain in (acked, acked + b"late")  # "late" only if it was sealed before the kill
            for number, token in enumerate(offsets):  # the same tokens read the same bytes
                assert (
                    read_all(client, "/v1/stream/plain", token)
                    == plain[len(b"".join(chunks[: number + 1])) :]
                )
            assert (
                client.post(
                    "/v1/stream/plain", content=b"x", headers={**TEXT, "Stream-Seq": "0005"}
                ).status_code
                == 409
            )
            assert (
                client.post(
                    "/v1/stream/plain", content=b"more", headers={**TEXT, "Stream-Seq": "0006"}
                ).status_code
                == 204
            )
            assert read_all(client, "/v1/stream/plain", tails["plain"]).endswith(b"more")

            assert client.get("/v1/stream/events", params={"offset": "-1"}).json() == [
                {"k": 0},
                {"k": 1},
                {"k": 2},
            ]

            assert read_all(client, "/v1/stream/orders") == b"o0;o1;o2;o3;o4;"
            duplicate = client.post(
                "/v1/stream/orders", content=b"o4;", headers={**producer, "Producer-Seq": "4"}
            )
            assert duplicate.status_code == 204 and tail(client, "orders") == tails["orders"]
            assert (
                client.post(
                    "/v1/stream/orders", content=b"o6;", headers={**producer, "Producer-Seq": "6"}
                ).status_code
                == 409
            )
            assert (
                client.post(
                    "/v1/stream/orders", content=b"o5;", headers={**producer, "Producer-Seq": "5"}
                ).status_code
                == 200
            )
            assert read_all(client, "/v1/stream/orders") == b"o0;o1;o2;o3;o4;o5;"

            for name, content in (("done", b"bye"), ("closed-with-data", b"last")):
                answer = client.get(f"/v1/stream/{name}", params={"offset": "-1"})
                assert answer.content == content and answer.headers["stream-closed"] == "true", name
                assert client.post(f"/v1/stream/{name}", content=b"x", headers=TEXT).status_code == 409

            ttl = client.head("/v1/stream/ttl")
            assert ttl.status_code == 200 and ttl.headers["stream-ttl"] == "3600"
            assert read_all(client, "/v1/stream/ttl") == b"short-lived"
            assert read_all(client, "/v1/stream/empty") == b"" and tail(client, "empty") == tails["empty"]
            assert read_all(client, "/v1/stream/plain-fork") == b"".join(chunks[:2]) + b"F;"
    finally:
        server.stop()

    # One member of a cluster sharing the bucket takes only the streams it owns.
    config = tmp_path / "cluster.toml"
    config.write_text(
        '[cluster]\nmembers = [{id = "a", address = "127.0.0.1:7001"}, {id = "b", address = "127.0.0.1:7002"}]\n'
    )
    member_dir = tmp_path / "member-a"
    done = restore(
        "--config", str(config), "--cluster-member", "a", "--data-dir", str(member_dir), *cold_flags(moto)
    )
    assert done.returncode == 0, done.stderr
    placement = Placement.of([Member("a", "127.0.0.1:7001"), Member("b", "127.0.0.1:7002")], 1)
    everything = [
        decode_meta((restored / layout.STREAMS / d / layout.META).read_bytes()).name for d in stream_dirs
    ]
    mine = sorted(layout.stream_dirname(n) for n in everything if placement.owner(n).id == "a")
    assert 0 < len(mine) < len(everything)
    assert sorted(p.name for p in (member_dir / layout.STREAMS).iterdir()) == mine


def test_restore_refuses_a_directory_that_is_not_empty(tmp_path: Path) -> None:
    (tmp_path / "left-over").write_text("x")
    done = restore("--data-dir", str(tmp_path), "--cold-url", "s3://archive/prod")
    assert done.returncode == 2
    assert "is not empty" in done.stderr and f"mv {tmp_path} {tmp_path}.old" in done.stderr
    assert (tmp_path / "left-over").read_text() == "x" and not (tmp_path / layout.STREAMS).exists()
