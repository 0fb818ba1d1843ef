"""A start that serves before every stream is read (`--read-before-serving`): each stream is read
when first asked for or by the background, and the end state is what a full read gives."""

from __future__ import annotations

import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from ops.bench_recovery import write_streams
from ops.serverproc import start
from streamkeep.segments import layout
from streamkeep.storage.base import ByteBudget
from streamkeep.storage.disk.storage import DiskStorage
from tests.test_forks import EXPECTED, build_chain, read

CT = {"Content-Type": "text/plain"}
PLAIN = 400  # streams besides the fork chains: enough that the background takes many slices


def budget() -> ByteBudget:
    return ByteBudget(max_stream_bytes=1 << 30, max_total_bytes=1 << 40)


def build(data: Path) -> None:
    """Fork chains (one with soft-deleted sources), producers, a closed stream, then a kill -9."""
    server = start("--storage", "disk", "--data-dir", str(data))
    with httpx.Client(base_url=server.url, timeout=10) as client:
        build_chain(client, "live-")
        build_chain(client, "soft-")
        assert client.delete("/v1/stream/soft-a").status_code == 204  # soft: b and c read it
        assert client.delete("/v1/stream/soft-b").status_code == 204  # soft: c reads it
        producer = {**CT, "Producer-Id": "p", "Producer-Epoch": "3"}
        assert client.put("/v1/stream/produced", headers=CT).status_code == 201
        for seq in range(3):
            answer = client.post(
                "/v1/stream/produced", content=b"%d;" % seq, headers={**producer, "Producer-Seq": str(seq)}
            )
            assert answer.status_code in (200, 204)
        assert client.put("/v1/stream/closed", headers=CT, content=b"x").status_code == 201
        assert client.post("/v1/stream/closed", headers={**CT, "Stream-Closed": "true"}).status_code in (
            200,
            204,
        )
    server.stop(signal.SIGKILL)
    write_streams(data, [f"plain/{n:04d}" for n in range(PLAIN)], appends=2)
    # What no start can read as a stream: left in place, logged, and not waited for.
    (data / layout.STREAMS / "stray-file").write_bytes(b"not a stream directory")
    (data / layout.STREAMS / "no-meta").mkdir()


def state(storage: DiskStorage) -> dict[str, Any]:
    """What recovery rebuilt, per stream: enough to tell any difference in what clients see."""
    return {
        log.meta.name: (
            log.published_tail,
            log.meta.fork_count,
            log.meta.soft_deleted,
            log.meta.closed,
            log.meta.stream_id,
            {pid: (p.epoch, p.last_seq) for pid, p in log.producers.items()},
            [(s.start, s.size) for s in log.segments],
        )
        for log in storage.logs()
    }


async def test_reading_on_demand_and_in_the_background_rebuilds_what_a_full_read_does(tmp_path: Path) -> None:
    build(tmp_path / "built")
    shutil.copytree(tmp_path / "built", tmp_path / "full")
    shutil.copytree(tmp_path / "built", tmp_path / "early")

    full = DiskStorage(tmp_path / "full", budget=budget())
    async with trio.open_nursery() as nursery:
        report = await full.start(nursery)
        assert full.unread() == 0 and report.streams == len(full.names())
        assert len(report.skipped) == 2  # stray-file, no-meta
        expected = state(full)
        nursery.cancel_scope.cancel()
    full.close()

    early = DiskStorage(tmp_path / "early", budget=budget(), read_slice_streams=7)
    async with trio.open_nursery() as nursery:
        await early.start(nursery, serve_after=0)
        found = len(early.names())
        assert early.unread() == found == len(expected) + 2  # and the two that are no streams
        assert early.logs() == []
        # The end of a soft-deleted chain: reading it reads what it inherits from, first.
        tail = early.open("soft-c")
        assert tail is not None and tail.published_tail == len(EXPECTED["c"])
        assert {log.meta.name for log in early.logs()} == {"soft-a", "soft-b", "soft-c"}
        assert early.open("no-such-stream") is None
        with trio.fail_after(30):
            await early.recovered()  # not held up by what is no stream: skipped, as a full read does
        assert early.unread() == 0 and len(early.recovery.skipped) == 2
        assert state(early) == expected
        assert sorted(early.names()) == sorted(expected)
        nursery.cancel_scope.cancel()
    early.close()
    assert sorted(p.name for p in (tmp_path / "early" / layout.STREAMS).iterdir()) == sorted(
        p.name for p in (tmp_path / "full" / layout.STREAMS).iterdir()
    )


def test_a_server_serves_every_kind_of_request_before_reading_its_streams(tmp_path: Path) -> None:
    build(tmp_path)
    server = start("--storage", "disk", "--data-dir", str(tmp_path), "--read-before-serving", "0")
    try:
        serving = [line for line in server.output if "serving now" in line]
        unread = int(re.search(r"the other (\d+) are read", serving[0]).group(1))  # type: ignore[union-attr]
        assert unread >= PLAIN  # nothing was read before serving
        with httpx.Client(base_url=server.url, timeout=30) as client:
            last = f"plain/{PLAIN - 1:04d}"  # read last by the background
            assert client.post(f"/v1/stream/{last}", content=b"more;", headers=CT).status_code in (200, 204)
            assert read(client, last).content == b"created;append-0;append-1;more;"
            assert read(client, "live-c").content == EXPECTED["c"]
            assert read(client, "soft-c").content == EXPECTED["c"]
            assert read(client, "soft-a").status_code == 410
            producer = {**CT, "Producer-Id": "p", "Producer-Epoch": "3"}
            duplicate = client.post(
                "/v1/stream/produced", content=b"1;", headers={**producer, "Producer-Seq": "1"}
            )
            assert duplicate.status_code == 204  # the producer's state was read: a duplicate
            gap = client.post("/v1/stream/produced", content=b"9;", headers={**producer, "Producer-Seq": "9"})
            assert gap.status_code == 409
            assert read(client, "produced").content == b"0;1;2;"
            assert client.post("/v1/stream/closed", content=b"y", headers=CT).status_code == 409
            assert client.put("/v1/stream/plain/0001", headers=CT).status_code == 200  # exists, same config
            # A create while the registry waits to reconcile: its entry is appended at once.
            assert client.put("/v1/stream/brand-new", headers=CT, timeout=10).status_code == 201
            # Until every stream is read a delete of a stream without known forks is a 503 to
            # retry (forks are all counted only then); afterwards it works, and cascades.
            early = client.delete("/v1/stream/soft-c")
            if early.status_code == 503:
                assert early.json()["error"]["code"] == "recovering" and "Retry-After" in early.headers
            else:
                assert early.status_code == 204  # the background was quicker
            deadline = time.monotonic() + 60
            while client.get("/stats").json()["storage"]["streams_unread"]:
                assert time.monotonic() < deadline, "the background never finished reading"
                time.sleep(0.2)
            assert client.delete("/v1/stream/soft-c").status_code in (204, 404)
            for name in ("soft-a", "soft-b", "soft-c"):
                assert read(client, name).status_code == 404
            listed = client.get("/v1/admin/streams", params={"limit": 10}).json()
            assert (
                listed["server"]["streams"] == PLAIN + 7
            )  # live-a/b/c, produced, closed, brand-new, the registry
            deadline = time.monotonic() + 20  # the reconcile appends what was made behind its back
            while '"key":"plain/0399"' not in (registry := read(client, "__registry__").text):
                assert time.monotonic() < deadline, "the registry was not reconciled"
                time.sleep(0.2)
            assert '"key":"brand-new"' in registry
        assert any("while serving" in line for line in server.output)
    finally:
        server.stop()
