"""The cold tier against a real S3-compatible server process (moto_server on loopback)."""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest

from ops.client import read_all as client_read_all
from ops.serverproc import ServerProcess, start
from tests.conftest import segment_files

OCTETS = {"Content-Type": "application/octet-stream"}
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}


class Moto:
    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
        self.process = subprocess.Popen(
            [binary, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60  # two test workers share the machine
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url, timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("moto_server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None

    def client(self, config: Any = None) -> Any:
        """A boto3 S3 client of this server (`config`: a botocore Config, e.g. for retries)."""
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
            config=config,
        )

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]


@pytest.fixture
def moto() -> Iterator[Moto]:
    server = Moto()
    server.start()
    yield server
    server.stop()


def cold_server(data: Path, moto: Moto, *extra: str) -> ServerProcess:
    return start(
        "--storage",
        "disk",
        "--data-dir",
        str(data),
        "--cold-url",
        "s3://archive/prod",
        "--cold-endpoint",
        moto.url,
        "--cold-create-bucket",
        "--segment-max-bytes",
        "1MiB",
        *extra,
        env=CREDENTIALS,
    )


def read_all(url: str, offset: str = "-1") -> bytes:
    with httpx.Client(timeout=30) as client:
        return client_read_all(client, url, offset)


def wait_until(predicate, timeout: float = 60, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_fifty_megabytes_move_to_the_bucket_and_read_back_identically(tmp_path: Path, moto: Moto) -> None:
    rng = random.Random(5)
    server = cold_server(tmp_path, moto)
    written: dict[str, bytes] = {}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for s in range(5):
            name = f"tenant/s{s}"
            client.put(f"/v1/stream/{name}", headers=OCTETS)
            chunks = [rng.randbytes(100_000) for _ in range(100)]  # 10 MB per stream, 50 MB in all
            for chunk in chunks:
                assert client.post(f"/v1/stream/{name}", content=chunk, headers=OCTETS).status_code == 204
            written[name] = b"".join(chunks)
    for name in written:
        wait_until(lambda name=name: len(segment_files(tmp_path, name)) == 1, what=f"{name} to move out")
    objects = moto.keys("archive", "prod/streams/")
    assert len(objects) >= 5 * 9 and all(key.endswith(".seg") for key in objects)
    server.stop(signal.SIGKILL)

    server = cold_server(tmp_path, moto)
    try:
        for name, data in written.items():
            url = f"{server.url}/v1/stream/{name}"
            assert hashlib.sha256(read_all(url)).digest() == hashlib.sha256(data).digest()
            for _ in range(5):
                position = rng.randrange(len(data))
                offset = f"0000000000000000_{position:016d}"
                assert read_all(url, offset) == data[position:]
    finally:
        server.stop()


def test_s3_outage_keeps_appends_and_hot_reads_going_and_rotation_retries(tmp_path: Path, moto: Moto) -> None:
    server = cold_server(tmp_path, moto, "--cold-high-water-bytes", "3MiB")
    url = f"{server.url}/v1/stream/outage"
    try:
        httpx.put(url, headers=OCTETS)
        first = os.urandom(1_500_000)
        httpx.post(url, content=first, headers=OCTETS)  # segment 1 (sealed at the next append)
        httpx.post(url, content=b"x" * 10, headers=OCTETS)
        wait_until(lambda: len(segment_files(tmp_path, "outage")) == 1, what="the first segment to move out")
        moto.stop()  # S3 goes away, taking its objects with it (moto keeps them in memory)
        appended = b""
        statuses = []
        for _ in range(6):  # each append fills a 1 MiB segment; sealed ones cannot move out
            chunk = os.urandom(1_100_000)
            response = httpx.post(url, content=chunk, headers=OCTETS, timeout=30)
            statuses.append(response.status_code)
            if response.status_code == 204:
                appended += chunk
            else:
                assert response.status_code == 503 and response.headers["retry-after"] == "1"
                assert "retry" in response.json()["error"]["message"]
            time.sleep(1.2)  # the archiver notices the backlog between passes
        assert statuses[0] == 204 and 503 in statuses  # hot tier first, then the high-water mark
        tail_read = httpx.get(url, params={"offset": f"0000000000000000_{1_500_010:016d}"}, timeout=30)
        assert tail_read.status_code == 200 and tail_read.content == appended[: len(tail_read.content)]
        cold_read = httpx.get(url, params={"offset": "-1"}, timeout=60)
        assert cold_read.status_code == 503 and cold_read.headers["retry-after"] == "1"  # never partial data
        moto.start()  # an empty S3 again: the bucket is re-created and the backlog uploaded
        wait_until(lambda: len(segment_files(tmp_path, "outage")) == 1, what="the backlog to move out")
        assert httpx.post(url, content=b"after", headers=OCTETS).status_code == 204
    finally:
        server.stop()


def test_deleting_a_stream_deletes_its_objects(tmp_path: Path, moto: Moto) -> None:
    server = cold_server(tmp_path, moto)
    url = f"{server.url}/v1/stream/doomed"
    try:
        httpx.put(url, headers=OCTETS)
        for _ in range(3):
            httpx.post(url, content=os.urandom(1_100_000), headers=OCTETS, timeout=30)
        prefix = "prod/streams/doomed/"
        wait_until(lambda: len(moto.keys("archive", prefix)) >= 2, what="uploads")
        assert httpx.delete(url).status_code == 204
        wait_until(lambda: moto.keys("archive", prefix) == [], what="the objects to be deleted")
    finally:
        server.stop()


def test_archive_status_and_verify_find_orphans(tmp_path: Path, moto: Moto) -> None:
    server = cold_server(tmp_path, moto)
    url = f"{server.url}/v1/stream/listed"
    httpx.put(url, headers=OCTETS)
    for _ in range(3):
        httpx.post(url, content=os.urandom(1_100_000), headers=OCTETS, timeout=30)
    wait_until(lambda: len(segment_files(tmp_path, "listed")) == 1, what="uploads")
    server.stop()
    command = [sys.executable, "-m", "streamkeep", "archive"]
    where = ["--data-dir", str(tmp_path)]
    bucket = ["--cold-url", "s3://archive/prod", "--cold-endpoint", moto.url]
    env = {**os.environ, **CREDENTIALS}
    status = subprocess.run([*command, "status", *where], capture_output=True, text=True, env=env, timeout=60)
    assert status.returncode == 0 and "listed" in status.stdout and "2 segments cold" in status.stdout
    boto3.client(
        "s3",
        endpoint_url=moto.url,
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    ).put_object(Bucket="archive", Key="prod/streams/ghost/x.seg", Body=b"x")
    verify = subprocess.run(
        [*command, "verify", *where, *bucket], capture_output=True, text=True, env=env, timeout=60
    )
    assert verify.returncode == 0 and "0 problems; 1 orphaned objects" in verify.stdout
    cleaned = subprocess.run(
        [*command, "verify", *where, *bucket, "--delete-orphans"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert "deleted 1 orphaned objects" in cleaned.stdout
    assert moto.keys("archive", "prod/streams/ghost/") == []
    # Members of a cluster share the bucket: one member's verify leaves the others' objects alone.
    from streamkeep.cluster.placement import Member, Placement

    toml = tmp_path / "cluster.toml"
    toml.write_text(
        '[cluster]\nmembers = [{id = "a", address = "127.0.0.1:1"}, {id = "b", address = "127.0.0.1:2"}]\n'
    )
    placement = Placement.of([Member("a", "127.0.0.1:1"), Member("b", "127.0.0.1:2")], 1)
    theirs = next(n for n in (f"theirs{i}" for i in range(100)) if placement.owner(n).id == "b")
    ours = next(n for n in (f"ghost{i}" for i in range(100)) if placement.owner(n).id == "a")
    s3 = boto3.client("s3", endpoint_url=moto.url, aws_access_key_id="test", aws_secret_access_key="test",
                      region_name="us-east-1")  # fmt: skip
    for name in (theirs, ours):
        s3.put_object(Bucket="archive", Key=f"prod/streams/{name}/0123456789ab/{0:016d}.seg", Body=b"x")
    clustered = [*command, "verify", *where, *bucket, "--config", str(toml), "--delete-orphans"]
    unnamed = subprocess.run(clustered, capture_output=True, text=True, env=env, timeout=60)
    assert unnamed.returncode == 2 and "--cluster-member" in unnamed.stderr
    cleaned = subprocess.run(
        [*clustered, "--cluster-member", "a"], capture_output=True, text=True, env=env, timeout=60
    )
    assert "1 objects belong to other cluster members' streams" in cleaned.stdout, (
        cleaned.stdout + cleaned.stderr
    )
    assert "deleted 1 orphaned objects" in cleaned.stdout
    assert moto.keys("archive", f"prod/streams/{ours}/") == []
    assert moto.keys("archive", f"prod/streams/{theirs}/") != []


def test_idle_streams_are_sealed_by_age_and_reach_the_bucket(tmp_path: Path, moto: Moto) -> None:
    server = cold_server(tmp_path, moto, "--segment-max-age", "1")
    url = f"{server.url}/v1/stream/quiet"
    try:
        httpx.put(url, headers=OCTETS)
        httpx.post(url, content=b"small and idle", headers=OCTETS)  # far below the size limit
        wait_until(
            lambda: len(moto.keys("archive", "prod/streams/quiet/")) == 1, timeout=20, what="age sealing"
        )
        wait_until(
            lambda: [p.name for p in segment_files(tmp_path, "quiet")] == [f"{14:016d}.seg"],
            timeout=20,
            what="the local copy to go",
        )
        assert read_all(url) == b"small and idle"
        assert httpx.post(url, content=b"; more", headers=OCTETS).status_code == 204
        server.stop(signal.SIGKILL)
        server = cold_server(tmp_path, moto)
        assert read_all(f"{server.url}/v1/stream/quiet") == b"small and idle; more"
    finally:
        server.stop()


def test_forks_read_inherited_ranges_from_the_bucket(tmp_path: Path, moto: Moto) -> None:
    server = cold_server(tmp_path, moto)
    url = f"{server.url}/v1/stream/origin"
    try:
        httpx.put(url, headers=OCTETS)
        history = [os.urandom(1_100_000) for _ in range(3)]
        for chunk in history:
            httpx.post(url, content=chunk, headers=OCTETS, timeout=30)
        wait_until(
            lambda: len(segment_files(tmp_path, "origin")) == 1, what="the origin's segments to move out"
        )
        fork = httpx.put(
            f"{server.url}/v1/stream/branch", headers={**OCTETS, "Stream-Forked-From": "/v1/stream/origin"}
        )
        assert fork.status_code == 201
        httpx.post(f"{server.url}/v1/stream/branch", content=b"own", headers=OCTETS)
        assert read_all(f"{server.url}/v1/stream/branch") == b"".join(history) + b"own"
    finally:
        server.stop()


def test_archive_verify_keeps_what_a_live_server_may_still_be_recording(tmp_path: Path, moto: Moto) -> None:
    """`archive verify --delete-orphans` beside a running server deleted an object uploaded but not
    yet in its manifest. Objects a live stream can still claim are kept until they are old."""
    server = cold_server(tmp_path, moto)
    url = f"{server.url}/v1/stream/live"
    try:
        httpx.put(url, headers=OCTETS)
        for _ in range(3):
            httpx.post(url, content=os.urandom(1_100_000), headers=OCTETS, timeout=30)
        wait_until(lambda: len(segment_files(tmp_path, "live")) == 1, what="uploads")
        live_key = next(k for k in moto.keys("archive", "prod/streams/live/"))
        in_flight = (
            live_key.rsplit("/", 1)[0] + "/0000000099999999.seg"
        )  # this incarnation, no manifest entry
        dead = "prod/streams/live/0123456789ab/0000000000000000.seg"  # another incarnation of the name
        client = boto3.client(
            "s3",
            endpoint_url=moto.url,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
        )
        for key in (in_flight, dead):
            client.put_object(Bucket="archive", Key=key, Body=b"x")
        command = [sys.executable, "-m", "streamkeep", "archive", "verify", "--data-dir", str(tmp_path)]
        command += ["--cold-url", "s3://archive/prod", "--cold-endpoint", moto.url, "--delete-orphans"]
        env = {**os.environ, **CREDENTIALS}
        verify = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
        assert verify.returncode == 0, verify.stderr
        assert "1 recent objects of live streams" in verify.stdout and "deleted 1 orphaned" in verify.stdout
        remaining = moto.keys("archive", "prod/streams/live/")
        assert in_flight in remaining and dead not in remaining
        old_enough = subprocess.run(
            [*command, "--orphan-min-age", "0"], capture_output=True, text=True, env=env, timeout=60
        )
        assert "deleted 1 orphaned" in old_enough.stdout and in_flight not in moto.keys(
            "archive", "prod/streams/live/"
        )
        assert read_all(url) is not None and len(read_all(url)) == 3_300_000
    finally:
        server.stop()


async def test_objects_a_bucket_refuses_to_delete_are_retried(tmp_path: Path, moto: Moto) -> None:
    """DeleteObjects answers 200 with per-key Errors; those keys were forgotten. They are retried,
    and the durable list of what is left to delete stays until it is done."""
    import trio

    from streamkeep.protocol.stream import StreamMeta
    from streamkeep.storage.base import AppendRecord, ByteBudget
    from streamkeep.storage.cold.archiver import Archiver
    from streamkeep.storage.cold.store import ColdConfig, S3Store
    from streamkeep.storage.disk.storage import DiskStorage

    for name, value in CREDENTIALS.items():
        os.environ.setdefault(name, value)
    config = ColdConfig.from_url(
        "s3://archive/prod", endpoint=moto.url, region="us-east-1", create_bucket=True
    )

    class Refusing(S3Store):
        refused = 0

        def delete(self, keys: list[str]) -> list[str]:
            if self.refused < 2:  # the first two calls refuse one key each, as S3 can
                self.refused += 1
                return [*super().delete(keys[1:]), keys[0]]
            return super().delete(keys)

    storage = DiskStorage(
        tmp_path, budget=ByteBudget(max_stream_bytes=1 << 26, max_total_bytes=1 << 28), segment_max_messages=1
    )
    store = Refusing(config)
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        archiver = Archiver(storage, store, config)
        storage.cold = archiver
        nursery.start_soon(archiver.run)
        meta = StreamMeta(name="gone", stream_id="a1b2c3d4e5f6", content_type="text/plain", created_at=0.0)
        log = await storage.create(meta, [b"0;"])
        for i in range(1, 4):
            await log.submit(AppendRecord([b"%d;" % i], log.meta, None, False, None)).wait()
        with trio.fail_after(30):
            while len(log.cold_entries) < 3:
                await trio.sleep(0.1)
        await storage.delete("gone")
        assert len(list((tmp_path / "trash").glob("*.objects"))) == 1
        with trio.fail_after(30):
            while moto.keys("archive", "prod/streams/gone/") or list((tmp_path / "trash").glob("*.objects")):
                await trio.sleep(0.2)
        assert store.refused == 2
        nursery.cancel_scope.cancel()


def test_retention_removes_objects_from_the_bucket_and_survives_kill_9(tmp_path: Path, moto: Moto) -> None:
    """Age retention on the cold tier: the floor moves, the dropped segments' objects leave the
    bucket, the manifest lists only what is kept, and a kill -9 changes none of it."""
    # Filled without retention first: with it on, a pass may drop a sealed segment before its
    # upload (nothing to archive past the limit), and how many objects ever reach the bucket
    # would depend on timing.
    server = cold_server(tmp_path, moto, "--segment-max-messages", "2")
    url = f"{server.url}/v1/stream/kept"
    try:
        httpx.put(url, headers=OCTETS)
        for n in range(20):
            assert httpx.post(url, content=b"%09d;" % n, headers=OCTETS).status_code == 204
        wait_until(lambda: len(moto.keys("archive", "prod/streams/kept/")) >= 6, what="uploads")
        server.stop()
        extra = ("--segment-max-messages", "2", "--retention-max-bytes", "40", "--retention-interval", "0.3")
        server = cold_server(tmp_path, moto, *extra)
        url = f"{server.url}/v1/stream/kept"

        def floor() -> int:
            token = httpx.head(url).headers["stream-earliest-offset"]
            return int(token.rsplit("_", 1)[1])

        wait_until(lambda: floor() >= 100, what="the floor to move")
        wait_until(lambda: len(moto.keys("archive", "prod/streams/kept/")) <= 3, what="objects to go")
        kept = read_all(url)
        assert kept == b"".join(b"%09d;" % n for n in range(floor() // 10, 20))
        server.stop(signal.SIGKILL)
        server = cold_server(tmp_path, moto, *extra)
        url = f"{server.url}/v1/stream/kept"
        assert read_all(url) == kept
        old = httpx.get(url, params={"offset": "0000000000000000_0000000000000000"})
        assert old.status_code == 410 and old.json()["error"]["code"] == "offset_before_floor"
        server.stop()
        verify = subprocess.run(
            [sys.executable, "-m", "streamkeep", "archive", "verify", "--data-dir", str(tmp_path),
             "--cold-url", "s3://archive/prod", "--cold-endpoint", moto.url],
            capture_output=True, text=True, env={**os.environ, **CREDENTIALS}, timeout=60,
        )  # fmt: skip
        assert verify.returncode == 0 and "0 problems" in verify.stdout, verify.stdout + verify.stderr
    finally:
        server.stop()


def test_archive_verify_checks_descriptions_and_sidecars_and_their_orphans(
    tmp_path: Path, moto: Moto
) -> None:
    """`archive verify` checks what `restore --from-bucket` needs under `PREFIX/meta/` (each stream's
    description, each segment's sidecar) and judges the objects there as it judges segment objects."""
    server = cold_server(tmp_path, moto, "--segment-max-age", "1")
    url = f"{server.url}/v1/stream/described"
    meta = "prod/meta/described/"
    try:
        httpx.put(url, headers=OCTETS)
        for part in (b"one", b"two", b"three"):
            assert httpx.post(url, content=part, headers=OCTETS).status_code == 204
            count = len(moto.keys("archive", "prod/streams/described/"))
            wait_until(
                lambda count=count: len(moto.keys("archive", "prod/streams/described/")) > count,
                timeout=30,
                what="age sealing and an upload",
            )
        wait_until(
            lambda: (
                sum(k.endswith("/stream.cbor") for k in moto.keys("archive", meta)) == 1
                and sum(k.endswith(".seg.idx") for k in moto.keys("archive", meta)) == 3
            ),
            timeout=30,
            what="the description and the sidecars",
        )
    finally:
        server.stop()
    command = [sys.executable, "-m", "streamkeep", "archive", "verify", "--data-dir", str(tmp_path)]
    command += ["--cold-url", "s3://archive/prod", "--cold-endpoint", moto.url]
    env = {**os.environ, **CREDENTIALS}

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*command, *extra], capture_output=True, text=True, env=env, timeout=60)

    clean = run()
    assert clean.returncode == 0, clean.stdout + clean.stderr
    # (The server's own __registry__ stream uploads segments too.)
    checked = re.search(
        r"(\d+) descriptions and (\d+) sidecars checked, 0 problems; 0 orphaned", clean.stdout
    )
    assert checked and int(checked[1]) >= 1 and int(checked[2]) >= 3, clean.stdout
    description = next(k for k in moto.keys("archive", meta) if k.endswith("/stream.cbor"))
    incarnation = description.rsplit("/", 2)[1]
    sidecars = sorted(k for k in moto.keys("archive", meta) if k.endswith(".seg.idx"))

    # Strays: a gone stream's objects are orphans at once; a live stream's sidecar with no manifest
    # entry (an upload in flight) only once older than --orphan-min-age; another incarnation's
    # description at once.
    ghost = ["prod/meta/ghost/0123456789ab/stream.cbor", f"prod/meta/ghost/0123456789ab/{0:016d}.seg.idx"]
    in_flight = f"{meta}{incarnation}/{99:016d}.seg.idx"
    old_incarnation = f"{meta}0123456789ab/stream.cbor"
    s3 = moto.client()
    for key in (*ghost, in_flight, old_incarnation):
        s3.put_object(Bucket="archive", Key=key, Body=b"x")
    listed = run()
    assert listed.returncode == 0 and "0 problems; 3 orphaned objects" in listed.stdout, listed.stdout
    assert all(f"orphan: {key}" in listed.stdout for key in (*ghost, old_incarnation))
    assert "1 recent objects of live streams" in listed.stdout
    cleaned = run("--delete-orphans")
    assert "deleted 3 orphaned objects" in cleaned.stdout, cleaned.stdout
    remaining = moto.keys("archive", "prod/meta/")
    assert in_flight in remaining and not {*ghost, old_incarnation} & set(remaining)
    old_enough = run("--delete-orphans", "--orphan-min-age", "0")
    assert "deleted 1 orphaned objects" in old_enough.stdout, old_enough.stdout
    assert sorted(moto.keys("archive", meta)) == sorted([description, *sidecars])

    # Damage: a description and a (not the first) sidecar deleted. The description of a stream that
    # uploaded within --orphan-min-age may not be written yet: it counts once that is over.
    s3.delete_object(Bucket="archive", Key=description)
    s3.delete_object(Bucket="archive", Key=sidecars[1])
    recent = run()
    assert recent.returncode == 1 and "1 problems" in recent.stdout, recent.stdout + recent.stderr
    assert f"MISSING sidecar described/{sidecars[1].rsplit('/', 1)[1][:-4]} ({sidecars[1]})" in recent.stderr
    assert "MISSING description" not in recent.stderr and "no description in the bucket yet" in recent.stdout
    damaged = run("--orphan-min-age", "0")
    assert damaged.returncode == 1 and "2 problems" in damaged.stdout, damaged.stdout + damaged.stderr
    assert f"MISSING description described ({description})" in damaged.stderr
    assert f"({sidecars[1]})" in damaged.stderr
    # Sidecars missing only before the first one there: segments uploaded before sidecars went to
    # the bucket (restore indexes those itself), noted but no problem.
    s3.put_object(Bucket="archive", Key=description, Body=b"x")
    s3.delete_object(Bucket="archive", Key=sidecars[0])
    upgraded = run("--orphan-min-age", "0")
    assert upgraded.returncode == 0 and "0 problems" in upgraded.stdout, upgraded.stdout + upgraded.stderr
    assert "2 segments have no sidecar in the bucket" in upgraded.stdout
