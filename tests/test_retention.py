"""Retention on the simulated disk (ops/torture/simfs.py), in process: floors, 410 below them,
what survives the drop (producers, the closed flag) across power cuts, forks pinning their
source, and a drop interrupted by a crash."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ops.serverproc import start
from streamkeep.actors.messages import DetachFork
from streamkeep.protocol import offsets
from streamkeep.segments import layout
from streamkeep.storage.cold.bookkeeping import record_upload
from streamkeep.storage.disk.log import DiskLog
from streamkeep.storage.disk.retention import Retention, RetentionRule
from streamkeep.storage.disk.storage import DiskStorage
from tests.test_sim_storage import ROOT, T, call, new_fs, server

SMALL = {"segment_max_messages": 2}


def segment_names(fs: Any, name: str) -> list[str]:
    directory = ROOT / layout.STREAMS / layout.stream_dirname(name)
    return sorted(n for n in fs.listdir(directory) if n.endswith(layout.SEGMENT_SUFFIX))


async def append_all(service: Any, name: str, count: int, headers: list | None = None) -> None:
    for n in range(count):
        answer = await call(service, "POST", name, f"m{n:03d};".encode(), headers or T)
        assert answer.status in (200, 204), answer.body


def retention(storage: DiskStorage, clock: list[float] | None = None, **rule: Any) -> Retention:
    now = clock or [1e12]
    return Retention(storage, [RetentionRule("**", **rule)], clock=lambda: now[0])


async def test_size_retention_moves_the_floor_and_answers_410_below_it() -> None:
    fs = new_fs()
    async with server(fs, **SMALL) as (service, storage):
        assert (await call(service, "PUT", "s", b"", T)).status == 201
        await append_all(service, "s", 20)  # 5 bytes each, two per segment
        before = segment_names(fs, "s")
        await retention(storage, max_bytes=30).pass_once()
        stream_log = storage.open("s")
        assert stream_log is not None and stream_log.floor > 0
        kept = segment_names(fs, "s")
        assert len(kept) < len(before) and kept[0] == layout.segment_filename(stream_log.floor)
        assert 30 <= stream_log.tail - stream_log.floor <= 30 + 10  # at least the limit, one segment more
        head = await call(service, "HEAD", "s")
        earliest = head.header("Stream-Earliest-Offset")
        assert earliest == offsets.encode(stream_log.floor, stream_log.meta.incarnation)
        everything = await call(service, "GET", "s", query="offset=-1")
        assert everything.status == 200 and everything.body.startswith(
            f"m{stream_log.floor // 5:03d};".encode()
        )
        gone = await call(
            service, "GET", "s", query=f"offset={offsets.encode(0, stream_log.meta.incarnation)}"
        )
        assert gone.status == 410 and gone.header("Stream-Earliest-Offset") == earliest
        assert json.loads(gone.body)["error"]["code"] == "offset_before_floor"
        from_floor = await call(service, "GET", "s", query=f"offset={earliest}")
        assert from_floor.body == everything.body
        # A fork below the floor is refused the same way.
        fork = [*T, ("Stream-Forked-From", "/v1/stream/s"), ("Stream-Fork-Offset", offsets.encode(0, 0))]
        assert (await call(service, "PUT", "f", b"", fork)).status == 410
        # The byte budget no longer counts what was dropped.
        assert storage.budget.total_bytes == stream_log.tail - stream_log.held_from


async def test_producer_state_and_close_survive_their_records_and_a_power_cut() -> None:
    fs = new_fs()
    clock = [1e12]
    producer = [*T, ("Producer-Id", "p"), ("Producer-Epoch", "2")]
    async with server(fs, **SMALL) as (service, storage):
        assert (await call(service, "PUT", "s", b"", T)).status == 201
        for seq in range(6):
            answer = await call(
                service, "POST", "s", f"p{seq};".encode(), [*producer, ("Producer-Seq", str(seq))]
            )
            assert answer.status in (200, 204)
        closing = [*producer, ("Producer-Seq", "6"), ("Stream-Closed", "true")]
        assert (await call(service, "POST", "s", b"end;", closing)).status in (200, 204)
        stream_log = storage.open("s")
        assert stream_log is not None
        assert await stream_log.seal_idle()  # the close's segment sealed, an empty one after it
        tail = stream_log.tail
        clock[0] = 2e12  # far in the future: every sealed segment is old enough to go
        await retention(storage, clock, max_age=60.0).pass_once()
        assert stream_log.floor == tail  # nothing left before the (empty) active segment
    fs.crash()  # a power cut: what was synced survives
    async with server(fs, **SMALL) as (service, storage):
        stream_log = storage.open("s")
        assert stream_log is not None and stream_log.floor == tail and stream_log.tail == tail
        head = await call(service, "HEAD", "s")
        assert head.header("Stream-Closed") == "true"
        # The close's retry is recognised as its retry, an older seq is a duplicate, and the
        # stream takes nothing new: all from the checkpoint, the records being gone.
        retry = await call(service, "POST", "s", b"end;", closing)
        assert retry.status in (200, 204) and retry.header("Stream-Closed") == "true"
        assert (await call(service, "POST", "s", b"x;", [*producer, ("Producer-Seq", "7")])).status == 409
        assert (await call(service, "HEAD", "s")).header("Stream-Next-Offset") == head.header(
            "Stream-Next-Offset"
        )
        assert (await call(service, "GET", "s", query="offset=-1")).body == b""


async def test_a_producer_retry_stays_a_duplicate_after_retention_and_restart() -> None:
    fs = new_fs()
    clock = [1e12]
    producer = [*T, ("Producer-Id", "p"), ("Producer-Epoch", "1")]
    async with server(fs, **SMALL) as (service, storage):
        assert (await call(service, "PUT", "s", b"", T)).status == 201
        for seq in range(4):
            await call(service, "POST", "s", f"p{seq};".encode(), [*producer, ("Producer-Seq", str(seq))])
        clock[0] = 2e12
        await append_all(service, "s", 3)  # another writer, after p: p's records are all sealed
        rule = retention(storage, clock, max_age=60.0)
        storage.open("s").segments[-2].last_ms = None  # type: ignore[union-attr]  # keep the newest sealed one
        await rule.pass_once()
        floor = storage.open("s").floor  # type: ignore[union-attr]
        assert floor >= 4 * 3
    fs.crash()
    async with server(fs, **SMALL) as (service, storage):
        tail = storage.open("s").tail  # type: ignore[union-attr]
        duplicate = await call(service, "POST", "s", b"p3;", [*producer, ("Producer-Seq", "3")])
        assert duplicate.status in (200, 204)
        assert storage.open("s").tail == tail  # type: ignore[union-attr]  # not written twice
        assert (await call(service, "POST", "s", b"p4;", [*producer, ("Producer-Seq", "4")])).status in (
            200,
            204,
        )


async def test_a_fork_pins_its_source_until_it_is_deleted() -> None:
    fs = new_fs()
    async with server(fs, **SMALL) as (service, storage):
        assert (await call(service, "PUT", "src", b"", T)).status == 201
        await append_all(service, "src", 10)
        fork_at = offsets.encode(30, storage.open("src").meta.incarnation)  # type: ignore[union-attr]
        fork = [*T, ("Stream-Forked-From", "/v1/stream/src"), ("Stream-Fork-Offset", fork_at)]
        assert (await call(service, "PUT", "fork", b"", fork)).status == 201
        await append_all(service, "src", 10)
        source = storage.open("src")
        assert source is not None
        rule = retention(storage, max_bytes=10)
        await rule.pass_once()
        assert source.floor > 30  # readers of the source see only what is kept...
        assert source.held_from == 0  # ...but what the fork reads through it stays
        inherited = await call(service, "GET", "fork", query="offset=-1")
        assert inherited.body == b"".join(f"m{n:03d};".encode() for n in range(6))
        assert (await call(service, "DELETE", "fork")).status == 204
        await rule.pass_once()
        assert source.held_from == source.floor  # the pin went with the fork
        assert segment_names(fs, "src")[0] == layout.segment_filename(source.floor)


async def test_a_drop_interrupted_by_a_crash_leaves_a_readable_stream() -> None:
    fs = new_fs()
    async with server(fs, **SMALL) as (service, storage):
        assert (await call(service, "PUT", "s", b"", T)).status == 201
        await append_all(service, "s", 20)
        expected = (await call(service, "GET", "s", query="offset=-1")).body
        removed: list[str] = []
        original = fs.unlink

        def unlink_then_crash(path: Any) -> None:
            if str(path).endswith(layout.SEGMENT_SUFFIX) and removed:
                raise OSError(5, "power lost mid-drop")
            removed.append(str(path))
            original(path)

        fs.unlink = unlink_then_crash  # type: ignore[method-assign]
        rule = retention(storage, max_bytes=30)
        await rule.pass_once()  # the floor moved; the drop failed after one file
        floor = storage.open("s").floor  # type: ignore[union-attr]
        assert floor > 0 and sum(path.endswith(layout.SEGMENT_SUFFIX) for path in removed) == 1
        fs.unlink = original  # type: ignore[method-assign]
    fs.crash()
    async with server(fs, **SMALL) as (service, storage):
        stream_log = storage.open("s")
        assert stream_log is not None and stream_log.floor == floor
        answer = await call(service, "GET", "s", query="offset=-1")
        assert answer.status == 200 and expected.endswith(answer.body) and answer.body.startswith(b"m")
        await retention(storage, max_bytes=30).pass_once()  # the next pass finishes the drop
        assert segment_names(fs, "s")[0] == layout.segment_filename(stream_log.floor)


async def test_bounded_work_per_pass() -> None:
    fs = new_fs()
    async with server(fs, segment_max_messages=1) as (service, storage):
        assert (await call(service, "PUT", "s", b"", T)).status == 201
        await append_all(service, "s", 30)
        rule = Retention(storage, [RetentionRule("**", max_bytes=5)], max_segments_per_pass=4)
        await rule.pass_once()
        assert rule.segments_dropped <= 4
        for _ in range(10):
            await rule.pass_once()
            await trio.lowlevel.checkpoint()
        assert storage.open("s").tail - storage.open("s").floor <= 10  # type: ignore[union-attr]


def test_a_subscription_cursor_below_the_floor_jumps_to_it(tmp_path: Path) -> None:
    server = start(
        "--storage", "disk", "--data-dir", str(tmp_path), "--segment-max-messages", "2",
        "--retention-max-bytes", "20", "--retention-interval", "0.2",
    )  # fmt: skip
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            assert client.put("/v1/stream/jobs/a", headers=dict(T)).status_code == 201
            assert (
                client.put("/v1/stream/wake/a", headers={"Content-Type": "application/json"}).status_code
                == 201
            )
            body = {"type": "pull-wake", "pattern": "jobs/*", "wake_stream": "wake/a"}
            assert client.put("/v1/stream/__ds/subscriptions/s", json=body).status_code == 201
            assert client.post("/v1/stream/jobs/a", content=b"0000;", headers=dict(T)).status_code == 204
            deadline = time.monotonic() + 10
            while client.get("/v1/stream/wake/a", params={"offset": "-1"}).content in (b"", b"[]"):
                assert time.monotonic() < deadline, "no wake event"  # issued with that append's tail
                time.sleep(0.1)
            for n in range(1, 20):
                assert (
                    client.post("/v1/stream/jobs/a", content=b"%04d;" % n, headers=dict(T)).status_code == 204
                )
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                view = client.get("/v1/stream/__ds/subscriptions/s").json()
                link = next(item for item in view["streams"] if item["path"] == "jobs/a")
                if link.get("skipped_bytes"):
                    break
                time.sleep(0.2)
            earliest = client.head("/v1/stream/jobs/a").headers["stream-earliest-offset"]
            assert link["acked_offset"] == earliest and link["skipped_bytes"] == int(
                earliest.rsplit("_", 1)[1]
            )
            # The wake names the tail of the first append, now below the cursor: claimed, it shows
            # nothing pending, never a tail behind the ack (found by the torture run with retention,
            # black box seed 1123).
            claim = client.post("/v1/stream/__ds/subscriptions/s/claim", json={"worker": "w"})
            assert claim.status_code == 200, claim.text
            shown = next(item for item in claim.json()["streams"] if item["path"] == "jobs/a")
            position = lambda token: int(token.rsplit("_", 1)[1])  # noqa: E731
            assert position(shown["tail_offset"]) >= position(shown["acked_offset"]) == position(earliest), (
                shown
            )
            assert shown["has_pending"] is False
            metrics = client.get("/metrics").text
            jumps = next(
                line
                for line in metrics.splitlines()
                if line.startswith("streamkeep_subscription_cursor_jumps_total")
            )
            assert float(jumps.split()[-1]) >= 1
            assert "streamkeep_retention_dropped_segments_total" in metrics
    finally:
        server.stop()


# ---- what review found (each failed before its fix) ---------------------------------------------


async def test_a_fork_of_a_retained_stream_starts_where_its_source_still_holds_data() -> None:
    fs = new_fs()
    async with server(fs, **SMALL) as (service, storage):
        assert (await call(service, "PUT", "src", b"", T)).status == 201
        await append_all(service, "src", 20)
        await retention(storage, max_bytes=30).pass_once()
        source = storage.open("src")
        assert source is not None and source.held_from > 0
        assert (
            await call(service, "PUT", "f", b"", [*T, ("Stream-Forked-From", "/v1/stream/src")])
        ).status == 201
        fork = storage.open("f")
        assert fork is not None
        earliest = (await call(service, "HEAD", "f")).header("Stream-Earliest-Offset")
        assert earliest == offsets.encode(source.held_from, fork.meta.incarnation)
        everything = await call(service, "GET", "f", query="offset=-1")
        assert (
            everything.status == 200
            and everything.body == (await call(service, "GET", "src", query="offset=-1")).body
        )
        # The source moves on: the fork keeps what it reads (pinned), and its own appends follow.
        await append_all(service, "f", 4)
        await append_all(service, "src", 20)
        await retention(storage, max_bytes=30).pass_once()
        again = await call(service, "GET", "f", query="offset=-1")
        assert again.status == 200 and again.body.startswith(everything.body)


async def test_a_fork_made_during_a_pass_keeps_its_inherited_range(monkeypatch: pytest.MonkeyPatch) -> None:
    fs = new_fs()
    async with server(fs, **SMALL) as (service, storage):
        for name in ("a", "src"):
            assert (await call(service, "PUT", name, b"", T)).status == 201
            await append_all(service, name, 20)
        rule = retention(storage, max_bytes=30)
        first = storage.open("a")
        source = storage.open("src")
        assert first is not None and source is not None
        original = DiskLog.raise_floor
        at = offsets.encode(10, source.meta.incarnation)

        async def fork_meanwhile(self: DiskLog, *args: Any, **kwargs: Any) -> bool:
            if self is first:  # a log has slots: patched on its class, for this one log
                fork = [*T, ("Stream-Forked-From", "/v1/stream/src"), ("Stream-Fork-Offset", at)]
                assert (await call(service, "PUT", "f", b"", fork)).status == 201
            return await original(self, *args, **kwargs)

        monkeypatch.setattr(DiskLog, "raise_floor", fork_meanwhile)
        await rule.pass_once()
        inherited = await call(service, "GET", "f", query="offset=-1")
        assert inherited.status == 200 and inherited.body == b"m000;m001;", inherited.body[:60]
        assert storage.open("src").held_from == 0  # type: ignore[union-attr]


async def test_a_stream_replaced_during_a_compaction_keeps_nothing_of_the_old_one() -> None:
    from streamkeep import compaction
    from streamkeep.compaction import Compactor

    fs = new_fs()
    json_type = [("Content-Type", "application/json")]

    def insert(key: str, value: object) -> bytes:
        return json.dumps(
            {"type": "t", "key": key, "value": value, "headers": {"operation": "insert"}}
        ).encode()

    async with server(fs, segment_max_messages=4) as (service, _storage):
        assert (await call(service, "PUT", "s", b"", json_type)).status == 201
        for n in range(10):
            assert (await call(service, "POST", "s", insert(f"old{n}", "old"), json_type)).status in (
                200,
                204,
            )
        original = compaction.forks.read_range
        replaced = []

        async def read_then_replace(*args: Any, **kwargs: Any) -> Any:
            result = await original(*args, **kwargs)
            if not replaced:
                replaced.append(True)
                assert (await call(service, "DELETE", "s")).status == 204
                assert (await call(service, "PUT", "s", b"", json_type)).status == 201
                assert (await call(service, "POST", "s", insert("new", 1), json_type)).status in (200, 204)
            return result

        async with trio.open_nursery() as nursery:
            compactor = Compactor(service.supervisor, nursery)
            compaction.forks.read_range = read_then_replace  # type: ignore[assignment]
            try:
                progress = compactor.start("s")
                await progress.done.wait()
            finally:
                compaction.forks.read_range = original  # type: ignore[assignment]
        assert progress.error is not None and progress.error.code == "stream_replaced"
        body = json.loads((await call(service, "GET", "s", query="offset=-1")).body)
        assert body == [{"type": "t", "key": "new", "value": 1, "headers": {"operation": "insert"}}]


async def test_a_snapshot_is_read_in_chunks() -> None:
    from streamkeep.compaction import Compactor

    fs = new_fs()
    json_type = [("Content-Type", "application/json")]
    async with server(fs) as (service, _storage):
        assert (await call(service, "PUT", "s", b"", json_type)).status == 201
        big = "x" * 2000
        batch = [
            {"type": "t", "key": f"k{n}", "value": big, "headers": {"operation": "insert"}}
            for n in range(1200)
        ]
        assert (await call(service, "POST", "s", json.dumps(batch).encode(), json_type)).status in (200, 204)
        async with trio.open_nursery() as nursery:
            progress = Compactor(service.supervisor, nursery).start("s")
            await progress.done.wait()
        assert progress.result is not None and progress.result["snapshot_bytes"] > 2 << 20
        first = await call(service, "GET", "s", query="offset=-1")
        assert first.status == 200 and len(first.body) <= (1 << 20) + 4096  # one read chunk, not the snapshot


async def test_interval_fsync_checkpoint_claims_only_what_survives_a_power_cut() -> None:
    fs = new_fs()
    producer = [*T, ("Producer-Id", "p"), ("Producer-Epoch", "1")]
    async with server(fs, fsync="interval", fsync_interval=3600.0, **SMALL) as (service, storage):
        assert (await call(service, "PUT", "s", b"", T)).status == 201
        await append_all(service, "s", 6)
        assert (await call(service, "POST", "s", b"p0;", [*producer, ("Producer-Seq", "0")])).status in (
            200,
            204,
        )
        await retention(storage, max_bytes=1).pass_once()
    fs.crash()
    async with server(fs, fsync="interval", fsync_interval=3600.0, **SMALL) as (service, storage):
        tail = storage.open("s").tail  # type: ignore[union-attr]
        retry = await call(service, "POST", "s", b"p0;", [*producer, ("Producer-Seq", "0")])
        assert retry.status in (200, 204)
        body = (await call(service, "GET", "s", query="offset=-1")).body
        assert b"p0;" in body, (tail, body)  # a checkpoint that claimed seq 0 would have lost it


async def test_a_compacted_json_stream_keeps_its_floor_against_age_and_size() -> None:
    """A `compact = "state"` rule's size and age limits leave its JSON streams alone (a floor by
    size would cut the state a reader from -1 materializes) and still apply to its text streams."""
    fs = new_fs()
    json_type = [("Content-Type", "application/json")]
    async with server(fs, **SMALL) as (service, storage):
        assert (await call(service, "PUT", "j", b"", json_type)).status == 201
        assert (await call(service, "PUT", "t", b"", T)).status == 201
        for n in range(20):
            change = {"type": "row", "key": f"k{n % 3}", "value": n, "headers": {"operation": "upsert"}}
            assert (await call(service, "POST", "j", json.dumps(change).encode(), json_type)).status in (
                200,
                204,
            )
        await append_all(service, "t", 20)
        await retention(
            storage, [1e15], max_bytes=30, max_age=1, compact="state", compact_min_bytes=1 << 30
        ).pass_once()
        json_log, text_log = storage.open("j"), storage.open("t")
        assert json_log is not None and json_log.floor == 0
        assert text_log is not None and text_log.floor > 0


async def test_a_read_from_the_start_changes_its_etag_when_the_floor_moves() -> None:
    """Same tail, other bytes: a client revalidating a read from -1 must not get 304 for what
    retention has since dropped (nor a HEAD's validator stay the same)."""
    fs = new_fs()
    async with server(fs, **SMALL) as (service, storage):
        assert (await call(service, "PUT", "s", b"", T)).status == 201
        await append_all(service, "s", 20)
        before = await call(service, "GET", "s", query="offset=-1")
        head_before = (await call(service, "HEAD", "s")).header("ETag")
        await retention(storage, max_bytes=30).pass_once()
        after = await call(
            service, "GET", "s", query="offset=-1", headers=[("If-None-Match", before.header("ETag"))]
        )
        assert after.status == 200 and after.body != before.body
        assert after.header("ETag") != before.header("ETag")
        assert (await call(service, "HEAD", "s")).header("ETag") != head_before
        again = await call(
            service, "GET", "s", query="offset=-1", headers=[("If-None-Match", after.header("ETag"))]
        )
        assert again.status == 304


async def test_a_read_from_the_start_that_retention_overtakes_starts_again_at_the_floor() -> None:
    """Found by the torture run with retention (sim seed 1185): a read from -1 whose segment was
    dropped between planning and reading answered 410 telling the client to read from -1. It
    reads again from the new floor."""
    holder: dict[str, Any] = {}

    async def steered(fn: Any, *args: Any, limiter: Any = None) -> Any:
        if getattr(fn, "__name__", "") == "pread_exact" and holder.pop("armed", False):
            await holder["retention"].pass_once()  # the floor moves and the segment goes, mid-read
        return await trio.to_thread.run_sync(fn, *args, limiter=limiter)

    fs = new_fs()
    async with server(fs, cache_bytes=0, run_sync=steered, **SMALL) as (service, storage):
        assert (await call(service, "PUT", "s", b"", T)).status == 201
        await append_all(service, "s", 20)
        holder["retention"] = retention(storage, max_bytes=30)
        holder["armed"] = True
        answer = await call(service, "GET", "s", query="offset=-1")
        stream_log = storage.open("s")
        assert stream_log is not None and stream_log.floor > 0 and "armed" not in holder
        assert answer.status == 200, answer.body
        assert answer.body.startswith(f"m{stream_log.floor // 5:03d};".encode())


async def test_a_drop_after_an_upload_whose_manifest_save_half_failed_keeps_the_stream() -> None:
    """Found by the torture run with retention (sim seed 3178): an upload's manifest rename landed
    but its directory sync failed, so the list in memory lacked the segment while the manifest on
    disk named it; retention then dropped the segment's files without saving the manifest, and at
    the next start the stream would not load (its sidecar was gone): every read was a 404."""
    fs = new_fs()
    async with server(fs, **SMALL) as (service, storage):
        assert (await call(service, "PUT", "s", b"", T)).status == 201
        await append_all(service, "s", 20)
        stream_log = storage.open("s")
        assert stream_log is not None
        first = stream_log.segments[0]
        entry = {
            "file": first.path.name,
            "start": first.start,
            "size": first.size,
            "sha256": "0" * 64,
            "key": "s/first",
        }
        fs.after_rename_into(stream_log.directory / "cold.cbor", 10)  # its directory syncs fail
        try:
            await record_upload(stream_log, first, entry)
        except OSError:
            pass
        fs.faults.forced.clear()  # only those syncs fail
        assert not stream_log.cold_entries  # what memory believes; the disk lists the segment
        await retention(storage, max_bytes=30).pass_once()
        floor = stream_log.floor
        assert floor > first.start
        kept = (await call(service, "GET", "s", query="offset=-1")).body
    fs.crash()
    async with server(fs, **SMALL) as (service, storage):
        again = await call(service, "GET", "s", query="offset=-1")
        assert again.status == 200 and again.body == kept


async def test_a_pin_of_a_fork_another_cluster_member_owns_holds_the_source() -> None:
    """The source counts such a fork by its pin (cluster/forks.py): retention keeps what the pin
    names until the pin goes, and the pin is in meta.cbor, so a restart keeps it."""
    fs = new_fs()
    async with server(fs, **SMALL) as (service, storage):
        assert (await call(service, "PUT", "src", b"", T)).status == 201
        await append_all(service, "src", 10)
        source = storage.open("src")
        assert source is not None
        source.meta.remote_forks = (("0123456789ab", "elsewhere/fork", 15),)
        source.meta.fork_count += 1
        await storage.save_meta("src", source.meta)
        await append_all(service, "src", 10)
        rule = retention(storage, max_bytes=10)
        await rule.pass_once()
        assert source.floor > 30 and source.held_from <= 15
        assert (await call(service, "DELETE", "src")).status == 204  # pinned: soft-deleted only
    async with server(fs, **SMALL) as (service, storage):
        source = storage.open("src")
        assert source is not None and source.meta.soft_deleted and source.meta.fork_count == 1
        assert source.meta.remote_forks == (("0123456789ab", "elsewhere/fork", 15),)
        await retention(storage, max_bytes=10).pass_once()
        assert source.held_from <= 15
        await service.supervisor.call("src", DetachFork("0123456789ab"))
        await service.supervisor.call("src", DetachFork("0123456789ab"))  # a second detach: nothing
        assert storage.open("src") is None  # the last pin out removes the soft-deleted source
