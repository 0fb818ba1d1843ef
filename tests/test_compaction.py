"""Compaction of State Protocol streams over a real server: a snapshot appended under concurrent
appends and a producer, a reader from the floor and a reader of the whole log from the old start
materializing the same state, checked by our fold and by the protocol's reference materializer
(@durable-streams/state's MaterializedState, run in Node)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from ops.serverproc import ROOT, ServerProcess, start
from streamkeep.protocol.state_fold import NotStateMessage, StateFold
from streamkeep.segments import format as fmt
from tests.conftest import segment_files

JSON = {"Content-Type": "application/json"}
MATERIALIZE = ROOT / "conformance" / "materialize.mjs"


def change(rng: random.Random, n: int) -> dict:
    operation = rng.choice(["insert", "update", "upsert", "delete", "update"])
    message: dict = {
        "type": rng.choice(["user", "order"]),
        "key": f"k{rng.randrange(40)}",
        "headers": {"operation": operation},
    }
    if operation != "delete":
        message["value"] = {
            "n": n,
            "name": rng.choice(["ada", "grace", "édith", "linus"]),
            "score": rng.random(),
        }
    return message


def reference(messages: list[bytes], tmp_path: Path) -> dict:
    """The state the reference materializer builds from `messages`."""
    path = tmp_path / f"messages-{time.monotonic_ns()}.json"
    path.write_text("[" + ",".join(m.decode() for m in messages) + "]")
    result = subprocess.run(
        ["node", str(MATERIALIZE), str(path)], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(result.stdout)


def ours(messages: list[bytes]) -> dict:
    fold = StateFold()
    for message in messages:
        fold.apply(message)
    return fold.view()


def whole_log(data: Path, name: str) -> list[bytes]:
    """Every message of the stream from position 0, read from its segment files (retention is off,
    so the files below the floor are all still there): the reader from the old start."""
    messages = []
    for path in segment_files(data, name):
        records, _valid, reason = fmt.scan(path.read_bytes(), keep_payload=True)
        assert reason is None
        for record in records[1:]:
            messages.extend(payload for _, payload in fmt.iter_messages(record))
    return messages


def read_from(server: ServerProcess, name: str, offset: str = "-1") -> list[bytes]:
    messages: list[bytes] = []
    with httpx.Client(base_url=server.url, timeout=10) as client:
        while True:
            response = client.get(f"/v1/stream/{name}", params={"offset": offset})
            assert response.status_code == 200, response.text
            messages.extend(
                json.dumps(m, separators=(",", ":"), ensure_ascii=False).encode() for m in response.json()
            )
            offset = response.headers["stream-next-offset"]
            if response.headers.get("stream-up-to-date") == "true":
                return messages


def compact(server: ServerProcess, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "streamkeep", "compact", server.url, name, *extra],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip


@pytest.fixture
def disk_server(tmp_path: Path) -> tuple[ServerProcess, Path]:
    data = tmp_path / "data"
    server = start("--storage", "disk", "--data-dir", str(data), "--segment-max-messages", "50")
    yield server, data
    server.stop()


def test_compaction_under_concurrent_appends_keeps_every_readers_state(
    disk_server: tuple[ServerProcess, Path], tmp_path: Path
) -> None:
    server, data = disk_server
    name = "state/orders"
    assert httpx.put(f"{server.url}/v1/stream/{name}", headers=JSON).status_code == 201
    stop = threading.Event()
    errors: list[str] = []

    def writer(seed: int, producer: bool) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=server.url, timeout=10) as client:
            seq = 0
            n = 0
            while not stop.is_set() or n < 300:
                batch = [change(rng, n + i) for i in range(rng.randint(1, 4))]
                if n == 40 and seed == 1:
                    batch.append({"headers": {"control": "reset"}})
                headers = dict(JSON)
                if producer:
                    headers.update({"Producer-Id": "p", "Producer-Epoch": "1", "Producer-Seq": str(seq)})
                response = client.post(
                    f"/v1/stream/{name}", content=json.dumps(batch).encode(), headers=headers
                )
                if response.status_code not in (200, 204):
                    errors.append(f"{response.status_code} {response.text}")
                    return
                seq += 1
                n += len(batch)
                if n >= 1200:
                    return

    threads = [threading.Thread(target=writer, args=(seed, seed == 2)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # history builds up, then the compaction runs while the writers go on
    first = compact(server, name)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    stop.set()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert report["keys"] > 0 and report["messages_folded"] > 0 and report["history_bytes"] > 0

    from_floor = read_from(server, name)
    assert json.loads(from_floor[0]) == {
        "headers": {"control": "snapshot-start", "offset": report["snapshot_offset"]}
    }
    earliest = httpx.head(f"{server.url}/v1/stream/{name}").headers["stream-earliest-offset"]
    assert earliest == report["snapshot_offset"]
    below = httpx.get(f"{server.url}/v1/stream/{name}", params={"offset": report["floor_before"]})
    assert below.status_code == 410 and below.headers["stream-earliest-offset"] == earliest

    old_start = whole_log(data, name)
    assert old_start[-len(from_floor) :] == from_floor  # the floor reader sees a suffix of the log
    assert len(old_start) > len(from_floor)
    expected = reference(old_start, tmp_path)
    assert expected, "the writers left some state"
    assert reference(from_floor, tmp_path) == expected
    assert ours(old_start) == expected == ours(from_floor)


def test_messages_not_of_the_protocol_stop_compaction_unless_dropped(
    disk_server: tuple[ServerProcess, Path],
) -> None:
    server, _ = disk_server
    url = f"{server.url}/v1/stream/mixed"
    assert httpx.put(url, headers=JSON).status_code == 201
    good = {"type": "t", "key": "a", "value": 1, "headers": {"operation": "insert"}}
    assert (
        httpx.post(url, content=json.dumps([good, {"hello": "world"}, good]), headers=JSON).status_code == 204
    )
    refused = compact(server, "mixed")
    assert refused.returncode == 1 and "not a State Protocol message" in refused.stderr
    assert httpx.head(url).headers["stream-earliest-offset"].endswith("_0000000000000000")  # nothing moved
    dropped = compact(server, "mixed", "--drop-invalid")
    assert dropped.returncode == 0, dropped.stderr
    assert json.loads(dropped.stdout)["messages_dropped"] == 1
    # Text streams and closed streams are not compacted; neither are missing ones.
    assert (
        httpx.put(f"{server.url}/v1/stream/text", headers={"Content-Type": "text/plain"}).status_code == 201
    )
    assert "only JSON streams" in compact(server, "text").stderr
    assert compact(server, "never-made").returncode == 1


def test_fold_rules() -> None:
    fold = StateFold()
    for message in (
        {"type": "u", "key": "a", "value": 1, "headers": {"operation": "insert"}},
        {"type": "u", "key": "a", "value": 2, "headers": {"operation": "update"}},
        {"type": "u", "key": "b", "value": None, "headers": {"operation": "upsert"}},
        {"headers": {"control": "snapshot-start"}},
        {"type": "u", "key": "c", "headers": {"operation": "delete"}},
    ):
        fold.apply(json.dumps(message).encode())
    assert fold.view() == {"u": {"a": 2, "b": None}}
    fold.apply(b'{"headers": {"control": "reset"}}')
    assert fold.view() == {}
    for bad in (
        b"[]",
        b'{"headers": {"operation": "merge"}, "type": "u", "key": "a"}',
        b'{"type": "u"}',
        b"nope",
    ):
        with pytest.raises(NotStateMessage):
            StateFold().apply(bad)
    snapshot = StateFold()
    snapshot.apply(b'{"type":"u","key":"a","value":{"x":1},"headers":{"operation":"insert"}}')
    lines = [json.loads(m) for m in snapshot.snapshot("0_5")]
    assert (
        lines[0]["headers"]["control"] == "snapshot-start"
        and lines[-1]["headers"]["control"] == "snapshot-end"
    )
    assert lines[1] == {"type": "u", "key": "a", "value": {"x": 1}, "headers": {"operation": "insert"}}


def test_a_rule_compacts_when_history_outgrows_the_snapshot(tmp_path: Path) -> None:
    config = tmp_path / "streamkeep.toml"
    config.write_text(
        '[[retention]]\nstreams = "auto/**"\ncompact = "state"\ncompact_ratio = 2\ncompact_min_bytes = 2000\n'
    )
    server = start("--storage", "disk", "--data-dir", str(tmp_path / "d"), "--config", str(config),
                   "--retention-interval", "0.2")  # fmt: skip
    try:
        url = f"{server.url}/v1/stream/auto/s"
        assert httpx.put(url, headers=JSON).status_code == 201
        rng = random.Random(5)

        def append(count: int) -> None:
            for n in range(count):
                assert (
                    httpx.post(url, content=json.dumps(change(rng, n)).encode(), headers=JSON).status_code
                    == 204
                )

        def compactions() -> int:
            return httpx.get(f"{server.url}/stats").json()["compaction"]["compactions"]

        def settled(above: int) -> int:
            """The count once compactions started after the writes have finished."""
            deadline = time.monotonic() + 15
            while compactions() <= above and time.monotonic() < deadline:
                time.sleep(0.1)
            count = compactions()
            while time.monotonic() < deadline:
                time.sleep(0.6)  # three passes
                if compactions() == count:
                    return count
                count = compactions()
            raise AssertionError("compactions kept going after the writes stopped")

        append(60)  # a few KB of history over at most 80 keys
        first = settled(0)
        assert first >= 1
        time.sleep(1.0)  # five more passes: a snapshot alone never makes the next compaction due
        assert compactions() == first
        state_before = ours(read_from(server, "auto/s"))
        append(200)
        second = settled(first)
        assert second > first  # the history grew past the snapshot again: compacted again
        time.sleep(1.0)
        assert compactions() == second
        assert httpx.get(f"{server.url}/stats").json()["compaction"]["failures"] == 0
        assert ours(read_from(server, "auto/s")) != state_before  # the later appends are in it
    finally:
        server.stop()
