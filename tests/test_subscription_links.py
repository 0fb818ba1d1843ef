"""Which streams a subscription links, and which incarnation of each (issue 11): a pull-wake
subscription never links its own wake stream, a stream deleted and created again starts over,
and links to deleted streams do not pile up."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import cbor2
import httpx
import pytest

from ops.serverproc import ServerProcess, start
from streamkeep.protocol import offsets

JSON = {"Content-Type": "application/json"}
SUBS = "/v1/stream/__ds/subscriptions"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start("--storage", "disk", "--data-dir", str(tmp_path_factory.mktemp("links")))
    yield process
    process.stop()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


def subscribe(client: httpx.Client, sub_id: str, body: dict) -> None:
    response = client.put(f"{SUBS}/{sub_id}", json=body)
    assert response.status_code == 201, response.text


def links(client: httpx.Client, sub_id: str) -> dict[str, dict]:
    response = client.get(f"{SUBS}/{sub_id}")
    assert response.status_code == 200, response.text
    return {item["path"]: item for item in response.json()["streams"]}


def claim(client: httpx.Client, sub_id: str) -> httpx.Response:
    return client.post(f"{SUBS}/{sub_id}/claim", json={"worker": "w1"})


def ack(client: httpx.Client, sub_id: str, wake: dict, acks: list[tuple[str, str]]) -> httpx.Response:
    return client.post(
        f"{SUBS}/{sub_id}/ack",
        json={
            "wake_id": wake["wake_id"],
            "generation": wake["generation"],
            "acks": [{"stream": path, "offset": offset} for path, offset in acks],
            "done": True,
        },
        headers={"Authorization": f"Bearer {wake['token']}"},
    )


def stream_entry(wake: dict, path: str) -> dict:
    return next(item for item in wake["streams"] if item["path"] == path)


def tail_of(client: httpx.Client, path: str) -> str:
    return client.head(f"/v1/stream/{path}").headers["stream-next-offset"]


# ---- a pull-wake subscription never feeds itself ---------------------------------------------


def test_explicit_link_to_own_wake_stream_is_refused(client: httpx.Client) -> None:
    refused = client.put(
        f"{SUBS}/own-explicit",
        json={"type": "pull-wake", "streams": ["own/a", "own/wake"], "wake_stream": "own/wake"},
    )
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "INVALID_SUBSCRIPTION" and "wake_stream" in error["message"]
    assert client.get(f"{SUBS}/own-explicit").status_code == 404

    subscribe(client, "own-added", {"type": "pull-wake", "streams": ["own/a"], "wake_stream": "own/wake"})
    added = client.post(f"{SUBS}/own-added/streams", json={"streams": ["own/wake"]})
    assert added.status_code == 400 and "wake_stream" in added.json()["error"]["message"]
    assert set(links(client, "own-added")) == {"own/a"}


def test_glob_matching_own_wake_stream_does_not_wake_itself(client: httpx.Client) -> None:
    client.put("/v1/stream/self/wake", content=b"[]", headers=JSON)
    subscribe(client, "selfwake", {"type": "pull-wake", "pattern": "self/**", "wake_stream": "self/wake"})
    client.put("/v1/stream/self/a", content=b'{"n":1}', headers=JSON)
    wake = claim(client, "selfwake").json()
    events = client.get("/v1/stream/self/wake", params={"offset": "-1"}).json()
    assert events and events[0]["stream"] == "self/a"  # the wake event went out...
    assert set(links(client, "selfwake")) == {"self/a"}  # ...and its stream is not linked
    done = ack(client, "selfwake", wake, [("self/a", stream_entry(wake, "self/a")["tail_offset"])])
    assert done.json() == {"ok": True, "next_wake": False}  # nothing pending: no wake loop
    assert claim(client, "selfwake").status_code == 409


# ---- a new incarnation of a stream starts over ------------------------------------------------


def test_recreated_stream_is_delivered_from_its_start(client: httpx.Client) -> None:
    client.put("/v1/stream/incw/pool", content=b"[]", headers=JSON)
    subscribe(client, "inc", {"type": "pull-wake", "pattern": "inc/*", "wake_stream": "incw/pool"})
    client.put("/v1/stream/inc/a", content=b'{"n":1}', headers=JSON)
    first = claim(client, "inc").json()
    old_tail = stream_entry(first, "inc/a")["tail_offset"]
    assert ack(client, "inc", first, [("inc/a", old_tail)]).status_code == 200

    assert client.delete("/v1/stream/inc/a").status_code == 204
    client.put("/v1/stream/inc/a", content=b'{"n":2}', headers=JSON)  # same size, new incarnation
    new_tail = tail_of(client, "inc/a")
    old, new = offsets.decode(old_tail), offsets.decode(new_tail)
    assert old.incarnation != new.incarnation and old.position == new.position

    second = claim(client, "inc")
    assert second.status_code == 200, second.text  # the new stream's data is pending
    entry = stream_entry(second.json(), "inc/a")
    assert entry["tail_offset"] == new_tail and entry["has_pending"] is True
    assert entry["acked_offset"] == offsets.encode(0, new.incarnation)  # at the new stream's start

    stale = ack(client, "inc", second.json(), [("inc/a", old_tail)])
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "STALE_OFFSET", stale.text
    assert links(client, "inc")["inc/a"]["acked_offset"] == offsets.encode(0, new.incarnation)

    any_incarnation = offsets.encode(new.position)  # "the current one"
    assert ack(client, "inc", second.json(), [("inc/a", any_incarnation)]).status_code == 200
    assert links(client, "inc")["inc/a"]["acked_offset"] == new_tail


# ---- deleted streams do not stay linked -------------------------------------------------------


def test_glob_links_to_deleted_streams_are_dropped(client: httpx.Client) -> None:
    subscribe(client, "churn", {"type": "pull-wake", "pattern": "churn/*", "wake_stream": "churnw/pool"})
    for n in range(30):
        client.put(f"/v1/stream/churn/{n}", content=b'{"n":1}', headers=JSON)
        assert client.delete(f"/v1/stream/churn/{n}").status_code == 204
    client.put("/v1/stream/churn/live", content=b'{"n":1}', headers=JSON)
    assert set(links(client, "churn")) == {"churn/live"}

    # A soft-deleted stream (a fork still reads it) is deleted for subscribers too.
    client.put("/v1/stream/churn/src", content=b'{"n":1}', headers=JSON)
    fork = client.put(
        "/v1/stream/forks/of-src", headers={**JSON, "Stream-Forked-From": "/v1/stream/churn/src"}
    )
    assert fork.status_code == 201, fork.text
    assert client.delete("/v1/stream/churn/src").status_code == 204
    assert set(links(client, "churn")) == {"churn/live"}


def test_explicit_link_survives_delete_and_follows_the_next_incarnation(client: httpx.Client) -> None:
    subscribe(client, "keep", {"type": "pull-wake", "streams": ["keep/a"], "wake_stream": "keepw/pool"})
    client.put("/v1/stream/keep/a", content=b'{"n":1}', headers=JSON)
    wake = claim(client, "keep").json()
    assert ack(client, "keep", wake, [("keep/a", stream_entry(wake, "keep/a")["tail_offset"])]).is_success

    client.delete("/v1/stream/keep/a")
    link = links(client, "keep")["keep/a"]
    assert link["link_type"] == "explicit" and link["acked_offset"] == offsets.encode(0)
    assert claim(client, "keep").status_code == 409  # nothing to do while the stream is gone

    client.put("/v1/stream/keep/a", content=b'{"n":2}', headers=JSON)
    again = claim(client, "keep")
    assert again.status_code == 200, again.text
    entry = stream_entry(again.json(), "keep/a")
    assert entry["has_pending"] and entry["tail_offset"] == tail_of(client, "keep/a")


def test_streams_created_after_the_last_save_are_linked_after_a_crash(tmp_path: Path) -> None:
    server = start("--storage", "disk", "--data-dir", str(tmp_path))
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            client.put("/v1/stream/latew/pool", content=b"[]", headers=JSON)
            subscribe(client, "late", {"type": "pull-wake", "pattern": "late/*", "wake_stream": "latew/pool"})
            client.put("/v1/stream/late/a", content=b'{"n":1}', headers=JSON)
            assert claim(client, "late").status_code == 200  # a wake is held: nothing new is saved...
            client.put("/v1/stream/late/b", content=b'{"n":1}', headers=JSON)  # ...when this appears
            assert set(links(client, "late")) == {"late/a", "late/b"}
        server.stop(signal.SIGKILL)
        server = start("--storage", "disk", "--data-dir", str(tmp_path))
        with httpx.Client(base_url=server.url, timeout=10) as client:
            wake = claim(client, "late")
            assert wake.status_code == 200, wake.text
            entry = stream_entry(wake.json(), "late/b")
            assert entry["has_pending"] and entry["acked_offset"].endswith("_0000000000000000")
    finally:
        server.stop()


# ---- state files written before links knew their incarnation ---------------------------------


def test_state_without_incarnations_still_loads(tmp_path: Path) -> None:
    server = start("--storage", "disk", "--data-dir", str(tmp_path))
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            client.put("/v1/stream/oldw/pool", content=b"[]", headers=JSON)
            subscribe(client, "old", {"type": "pull-wake", "pattern": "old/*", "wake_stream": "oldw/pool"})
            client.put("/v1/stream/old/a", content=b'{"n":1}', headers=JSON)
            wake = claim(client, "old").json()
            tail = stream_entry(wake, "old/a")["tail_offset"]
            assert ack(client, "old", wake, [("old/a", tail)]).status_code == 200
        server.stop(signal.SIGKILL)
        # Rewrite the state the way the previous format had it: [acked, explicit, glob].
        state_file = tmp_path / "subscriptions" / "old.cbor"
        state = cbor2.loads(state_file.read_bytes())
        state["links"] = {path: list(value[:3]) for path, value in state["links"].items()}
        state_file.write_bytes(cbor2.dumps(state))

        server = start("--storage", "disk", "--data-dir", str(tmp_path))
        with httpx.Client(base_url=server.url, timeout=10) as client:
            assert links(client, "old")["old/a"]["acked_offset"] == tail  # same position, same incarnation
            assert claim(client, "old").status_code == 409  # nothing replayed
            client.post("/v1/stream/old/a", content=b'{"n":2}', headers=JSON)
            assert claim(client, "old").status_code == 200  # and new data is still seen
    finally:
        server.stop()


# ---- a refused request changes nothing ----------------------------------------------------------


def test_a_refused_ack_applies_none_of_its_acks(client: httpx.Client) -> None:
    subscribe(client, "half", {"type": "pull-wake", "streams": ["half/a"], "wake_stream": "halfw/pool"})
    client.put("/v1/stream/half/a", content=b'{"n":1}', headers=JSON)
    wake = claim(client, "half").json()
    before = links(client, "half")["half/a"]["acked_offset"]
    tail = stream_entry(wake, "half/a")["tail_offset"]
    refused = ack(client, "half", wake, [("half/a", tail), ("half/unlinked", tail)])
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "UNKNOWN_STREAM"
    assert links(client, "half")["half/a"]["acked_offset"] == before  # the first ack was undone
    assert ack(client, "half", wake, [("half/a", tail)]).json() == {"ok": True, "next_wake": False}
