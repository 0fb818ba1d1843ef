"""Disk storage: crashes, torn and corrupt tails, rotation, deletes, disk-full errors, recovery."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
import trio

from ops import crash_test
from ops.client import read_all as client_read_all
from ops.serverproc import ServerProcess, start
from streamkeep.protocol.stream import StreamMeta
from streamkeep.segments import format as fmt
from streamkeep.segments import layout
from streamkeep.storage.base import AppendRecord, ByteBudget
from streamkeep.storage.disk.storage import DiskStorage
from streamkeep.storage.errors import StorageUnavailable
from tests.conftest import segment_files
from tests.faultyfs import FaultyFS, enospc, half_then_enospc

CT = {"Content-Type": "text/plain"}


def disk_server(data_dir: Path, *extra: str) -> ServerProcess:
    return start("--storage", "disk", "--data-dir", str(data_dir), *extra)


def read_all(url: str, offset: str = "-1") -> bytes:
    with httpx.Client(timeout=30) as client:
        return client_read_all(client, url, offset)


def test_twenty_kills_lose_and_duplicate_nothing() -> None:
    lines: list[str] = []
    crash_test.run(kills=20, writers=8, seed=20261122, log=lines.append)
    assert len(lines) == 20 and all("all present once, in order" in line for line in lines)


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "garbage"])
def test_torn_or_corrupt_tail_is_cut_and_never_served(tmp_path: Path, damage: str) -> None:
    server = disk_server(tmp_path)
    url = f"{server.url}/v1/stream/torn"
    httpx.put(url, headers=CT)
    for i in range(5):
        assert httpx.post(url, content=f"record-{i};".encode(), headers=CT).status_code == 204
    server.stop(signal.SIGKILL)
    last = segment_files(tmp_path, "torn")[-1]
    data = bytearray(last.read_bytes())
    if damage == "truncate":
        data = data[:-3]  # the last record is torn
    elif damage == "corrupt":
        data[-2] ^= 0xFF  # a flipped payload byte: the CRC no longer matches
    else:
        data += b"SK\x01\x01" + os.urandom(40)  # a half-written record after the last good one
    last.write_bytes(bytes(data))

    server = disk_server(tmp_path)
    try:
        body = read_all(f"{server.url}/v1/stream/torn")
        expected = b"".join(f"record-{i};".encode() for i in range(5 if damage == "garbage" else 4))
        assert body == expected
        assert any("truncated torn tail" in line for line in server.output)
        appended = httpx.post(f"{server.url}/v1/stream/torn", content=b"after;", headers=CT)
        assert appended.status_code == 204
        assert read_all(f"{server.url}/v1/stream/torn") == expected + b"after;"
    finally:
        server.stop()


def test_segments_rotate_and_reads_span_them_after_restart(tmp_path: Path) -> None:
    server = disk_server(tmp_path, "--segment-max-messages", "3")
    url = f"{server.url}/v1/stream/rot"
    httpx.put(url, headers={"Content-Type": "application/json"})
    offsets = []
    for i in range(10):
        response = httpx.post(
            url, content=f'{{"i":{i}}}'.encode(), headers={"Content-Type": "application/json"}
        )
        offsets.append(response.headers["stream-next-offset"])
    server.stop(signal.SIGKILL)
    files = segment_files(tmp_path, "rot")
    assert len(files) == 4
    assert [layout.segment_start(f.name) for f in files] == sorted(
        layout.segment_start(f.name) for f in files
    )
    server = disk_server(tmp_path)
    try:
        everything = httpx.get(f"{server.url}/v1/stream/rot", params={"offset": "-1"}).json()
        assert everything == [{"i": i} for i in range(10)]
        middle = httpx.get(f"{server.url}/v1/stream/rot", params={"offset": offsets[4]}).json()
        assert middle == [{"i": i} for i in range(5, 10)]
    finally:
        server.stop()


def test_deleted_streams_never_come_back(tmp_path: Path) -> None:
    server = disk_server(tmp_path)
    for name in ("gone", "half-deleted", "kept"):
        httpx.put(f"{server.url}/v1/stream/{name}", content=b"x", headers=CT)
    assert httpx.delete(f"{server.url}/v1/stream/gone").status_code == 204
    assert not (tmp_path / layout.STREAMS / "gone").exists()  # files go with the delete, not later
    server.stop(signal.SIGKILL)
    # A crash after a delete's rename into trash/ but before its files were removed:
    (tmp_path / layout.STREAMS / "half-deleted").rename(tmp_path / layout.TRASH / "crashed-delete")
    # A crash in the middle of a create, before its directory was renamed into place:
    (tmp_path / layout.STREAMS / ".tmp-crashed-create").mkdir()
    server = disk_server(tmp_path)
    try:
        assert httpx.get(f"{server.url}/v1/stream/gone").status_code == 404
        assert httpx.get(f"{server.url}/v1/stream/half-deleted").status_code == 404
        assert httpx.get(f"{server.url}/v1/stream/kept", params={"offset": "-1"}).content == b"x"
        assert list((tmp_path / layout.TRASH).iterdir()) == []
        assert not (tmp_path / layout.STREAMS / ".tmp-crashed-create").exists()
        assert httpx.put(f"{server.url}/v1/stream/gone", headers=CT).status_code == 201
    finally:
        server.stop()


def test_damaged_sealed_segment_skips_that_stream_only(tmp_path: Path) -> None:
    server = disk_server(tmp_path, "--segment-max-messages", "2")
    for name in ("bad", "good"):
        httpx.put(f"{server.url}/v1/stream/{name}", headers=CT)
        for i in range(5):
            httpx.post(f"{server.url}/v1/stream/{name}", content=b"%d" % i, headers=CT)
    server.stop(signal.SIGKILL)
    sealed = segment_files(tmp_path, "bad")[0]
    data = bytearray(sealed.read_bytes())
    data[-1] ^= 0xFF
    sealed.write_bytes(bytes(data))
    server = disk_server(tmp_path)
    try:
        assert httpx.get(f"{server.url}/v1/stream/good", params={"offset": "-1"}).content == b"01234"
        assert httpx.get(f"{server.url}/v1/stream/bad").status_code == 404
        assert any("skipped" in line and "sealed segment" in line for line in server.output)
        assert sealed.exists()  # left for inspection, not deleted
    finally:
        server.stop()


def test_every_fsync_policy_round_trips(tmp_path: Path) -> None:
    for policy in ("always", "interval", "never"):
        data_dir = tmp_path / policy
        server = disk_server(data_dir, "--fsync", policy, "--fsync-interval", "0.05")
        url = f"{server.url}/v1/stream/p"
        httpx.put(url, headers=CT)
        for i in range(20):
            httpx.post(url, content=b"%d," % i, headers=CT)
        server.stop()
        server = disk_server(data_dir)
        try:
            assert read_all(f"{server.url}/v1/stream/p") == b"".join(b"%d," % i for i in range(20))
        finally:
            server.stop()


# ---- in-process: the storage under injected faults, and recovery at scale ---------------


def new_meta(name: str) -> StreamMeta:
    return StreamMeta(name=name, stream_id=name, content_type="text/plain", created_at=0.0, last_access=0.0)


def plain(log, body: bytes) -> AppendRecord:  # type: ignore[no-untyped-def]
    return AppendRecord([body], log.meta, None, False, None)


async def test_disk_full_fails_the_append_and_rolls_back(tmp_path: Path) -> None:
    fs = FaultyFS()
    storage = DiskStorage(
        tmp_path, budget=ByteBudget(max_stream_bytes=1 << 20, max_total_bytes=1 << 22), fs=fs
    )
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        log = await storage.create(new_meta("s"), [b"first;"])
        fs.script("pwrite", half_then_enospc())  # a short write, then ENOSPC
        first = log.submit(plain(log, b"doomed-1;"))
        second = log.submit(plain(log, b"doomed-2;"))
        with pytest.raises(StorageUnavailable) as caught:
            await first.wait()
        assert caught.value.status == 507 and "disk is full" in str(caught.value)
        with pytest.raises(StorageUnavailable):
            await second.wait()
        assert log.tail == log.published_tail == len(b"first;")
        assert (await log.read(0, 1024, whole_messages=False)).messages == [b"first;"]
        fs.clear()
        assert await log.submit(plain(log, b"second;")).wait() == len(b"first;second;")
        nursery.cancel_scope.cancel()
    # the partial write was cut off again: a fresh recovery sees exactly the good records
    again = DiskStorage(tmp_path, budget=ByteBudget(max_stream_bytes=1 << 20, max_total_bytes=1 << 22))
    async with trio.open_nursery() as nursery:
        report = await again.start(nursery)
        assert report.repaired == []
        reopened = again.open("s")
        assert reopened is not None
        assert b"".join((await reopened.read(0, 1024, whole_messages=False)).messages) == b"first;second;"
        nursery.cancel_scope.cancel()


async def test_recovery_of_thousands_of_streams(tmp_path: Path) -> None:
    budget = ByteBudget(max_stream_bytes=1 << 20, max_total_bytes=1 << 30)
    storage = DiskStorage(tmp_path, budget=budget, fsync="never")
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        for i in range(2000):
            log = await storage.create(new_meta(f"many/{i}"), [b"%d" % i])
            await log.submit(plain(log, b"+")).wait()
        nursery.cancel_scope.cancel()
    again = DiskStorage(tmp_path, budget=ByteBudget(max_stream_bytes=1 << 20, max_total_bytes=1 << 30))
    async with trio.open_nursery() as nursery:
        report = await again.start(nursery)
        assert report.streams == 2000 and report.records == 4000 and not report.skipped
        sample = again.open("many/1234")
        assert sample is not None
        assert b"".join((await sample.read(0, 100, whole_messages=False)).messages) == b"1234+"
        nursery.cancel_scope.cancel()


def test_segment_files_are_self_describing(tmp_path: Path) -> None:
    """A separate reader needs only the format: header record first, then appends in order."""
    server = disk_server(tmp_path)
    url = f"{server.url}/v1/stream/spec"
    httpx.put(url, headers=CT)
    producer = {**CT, "Producer-Id": "p", "Producer-Epoch": "3", "Producer-Seq": "0"}
    httpx.post(url, content=b"hello", headers=producer)
    httpx.post(url, headers={"Stream-Closed": "true"})
    server.stop()
    records, _valid, reason = fmt.scan(segment_files(tmp_path, "spec")[0].read_bytes(), keep_payload=True)
    assert reason is None
    assert records[0].kind == fmt.KIND_SEGMENT and records[0].header["name"] == "spec"
    assert records[1].payload == b"hello" and records[1].producer == ("p", 3, 0)
    assert list(fmt.iter_messages(records[1])) == [(0, b"hello")]  # the reader helper the format doc shows
    assert records[2].closes and records[2].payload_len == 0


async def test_disk_full_answers_507_json_and_reads_go_on(tmp_path: Path) -> None:
    from streamkeep.actors.supervisor import Supervisor
    from streamkeep.protocol.model import Headers, Request
    from streamkeep.server.service import Service, ServiceOptions

    fs = FaultyFS()
    storage = DiskStorage(
        tmp_path, budget=ByteBudget(max_stream_bytes=1 << 20, max_total_bytes=1 << 22), fs=fs
    )
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        service = Service(Supervisor(storage, nursery), ServiceOptions())

        def request(method: str, body: bytes = b"", query: str = "") -> Request:
            return Request(method, "/v1/stream/full", query, Headers([("Content-Type", "text/plain")]), body)

        assert (await service.handle(request("PUT", b"kept;"))).status == 201

        fs.script("pwrite", enospc)
        failed = await service.handle(request("POST", b"lost;"))
        assert failed.status == 507 and failed.header("Retry-After") == "1"
        assert b"disk is full" in failed.body and failed.header("Content-Type") == "application/json"
        read = await service.handle(request("GET", query="offset=-1"))
        assert read.status == 200 and read.body == b"kept;"
        fs.clear()
        assert (await service.handle(request("POST", b"later;"))).status == 204
        assert (await service.handle(request("GET", query="offset=-1"))).body == b"kept;later;"
        nursery.cancel_scope.cancel()


def test_a_json_stream_closed_by_a_close_only_append_reads_as_json(tmp_path: Path) -> None:
    """Found by the simulation: the close-only record was read back as an empty message, and the
    JSON array came out as `[{...},]`."""
    server = disk_server(tmp_path)
    url = f"{server.url}/v1/stream/j"
    json_ct = {"Content-Type": "application/json"}
    try:
        httpx.put(url, headers=json_ct, content=b'{"a":1}')
        assert httpx.post(url, headers={"Stream-Closed": "true"}).status_code == 204
        read = httpx.get(url, params={"offset": "-1"})
        assert read.json() == [{"a": 1}] and read.headers["stream-closed"] == "true"
        with httpx.stream("GET", url, params={"offset": "-1", "live": "sse"}) as sse:
            text = sse.read().decode()
        assert 'data:[{"a":1}]' in text and ",]" not in text
    finally:
        server.stop()
