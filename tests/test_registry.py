"""`__registry__` over real sockets: it lists exactly the live streams after creates, deletes,
forks and TTL expiry, across a restart and a kill -9 between a change and its entry; its name is
reserved; it is compacted on its own; `--no-registry`; what happens to a stream already so named;
and with auth on, reading it needs `read:__registry__` or admin."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from ops.serverproc import ServerProcess, launch, start
from tests.conftest import FAST, segment_files
from tests.test_auth import ADMIN, AUDIENCE, SECRET, bearer, token

REGISTRY = "/v1/stream/__registry__"
JSON = {"Content-Type": "application/json"}
TEXT = {"Content-Type": "text/plain"}


@contextmanager
def serving(*args: str) -> Iterator[tuple[ServerProcess, httpx.Client]]:
    server = start(*args)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            yield server, client
    finally:
        server.stop()


def disk(data: Path, *extra: str) -> tuple[str, ...]:
    return ("--storage", "disk", "--data-dir", str(data), *extra)


def registry_messages(client: httpx.Client, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every message of the registry from its floor, read in chunks as a client would."""
    messages: list[dict[str, Any]] = []
    offset = "-1"
    while True:
        response = client.get(REGISTRY, params={"offset": offset}, headers=headers)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/json"
        messages.extend(response.json())
        offset = response.headers["Stream-Next-Offset"]
        if response.headers.get("Stream-Up-To-Date") == "true":
            return messages


def fold(messages: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The registry as upstream's test-ui materializes it (type `stream`, keyed by path), and
    stricter: a delete must name a listed stream (TanStack DB's collections refuse others), and an
    entry's value must carry what the UI reads."""
    state: dict[str, dict[str, Any]] = {}
    for message in messages:
        headers = message["headers"]
        if "control" in headers:
            assert headers["control"] in ("snapshot-start", "snapshot-end"), message
            continue
        assert message["type"] == "stream", message
        key, operation = message["key"], headers["operation"]
        if operation == "delete":
            assert set(message) == {"type", "key", "headers"}, message
            assert key in state, f"a delete of {key!r}, which is not listed"
            del state[key]
        else:
            assert operation == "insert", message
            value = message["value"]
            assert value["path"] == key and isinstance(value["contentType"], str), message
            assert isinstance(value["createdAt"], int) and value["createdAt"] > 1.7e12, message
            state[key] = value
    return state


def listed(client: httpx.Client, headers: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    return fold(registry_messages(client, headers))


def test_it_lists_exactly_the_live_streams_after_creates_deletes_forks_and_expiry(tmp_path: Path) -> None:
    live: dict[str, str] = {}  # name -> content type, as the client made it
    gone: set[str] = set()
    started = time.time() * 1000
    with serving(*disk(tmp_path)) as (_, client):
        assert listed(client) == {}  # made at start, empty, JSON
        for n in range(6):
            name = f"plain/{n}"
            assert client.put(f"/v1/stream/{name}", headers=TEXT).status_code == 201
            live[name] = "text/plain"
            assert name in listed(client)  # listed before the PUT was answered
        assert client.put("/v1/stream/state/a", headers=JSON, content=b"[]").status_code == 201
        live["state/a"] = "application/json"
        # Forks (and a fork of a fork) list their source's content type.
        for fork, source in (("fork/1", "plain/0"), ("fork/2", "fork/1"), ("fork/3", "state/a")):
            answer = client.put(f"/v1/stream/{fork}", headers={"Stream-Forked-From": f"/v1/stream/{source}"})
            assert answer.status_code == 201, answer.text
            live[fork] = live[source]
        # An idempotent re-PUT appends nothing.
        tail = client.head(REGISTRY).headers["Stream-Next-Offset"]
        assert client.put("/v1/stream/plain/1", headers=TEXT).status_code == 200
        assert client.head(REGISTRY).headers["Stream-Next-Offset"] == tail
        # Deletes: plain, a source forks still read (gone for clients at once), a fork.
        for name in ("plain/1", "plain/0", "fork/3"):
            assert client.delete(f"/v1/stream/{name}").status_code == 204
            gone.add(live.pop(name))
            assert name not in listed(client)
        assert client.delete("/v1/stream/fork/2").status_code == 204  # fork of a fork
        live.pop("fork/2")
        assert client.delete("/v1/stream/fork/1").status_code == 204  # the last fork: plain/0 goes too
        live.pop("fork/1")
        # TTL expiry counts as a delete (noticed here by a HEAD, or by the sweep).
        for name in ("ttl/a", "ttl/b"):
            assert client.put(f"/v1/stream/{name}", headers={**TEXT, "Stream-TTL": "1"}).status_code == 201
        assert {"ttl/a", "ttl/b"} <= set(listed(client))
        time.sleep(1.5)
        assert client.head("/v1/stream/ttl/a").status_code == 404
        assert client.get("/v1/stream/ttl/b", params={"offset": "-1"}).status_code == 404
        # The same name created again after a delete: listed with its new creation time.
        before = listed(client)["plain/2"]["createdAt"]
        assert client.delete("/v1/stream/plain/2").status_code == 204
        assert client.put("/v1/stream/plain/2", headers=JSON).status_code == 201
        live["plain/2"] = "application/json"

        state = listed(client)
        assert {name: value["contentType"] for name, value in state.items()} == live
        assert state["plain/2"]["createdAt"] >= before
        assert all(value["createdAt"] >= started - 1000 for value in state.values())
        for name in live:
            assert client.head(f"/v1/stream/{name}").status_code == 200
        for name in ("plain/0", "plain/1", "fork/1", "fork/2", "fork/3", "ttl/a", "ttl/b"):
            assert client.head(f"/v1/stream/{name}").status_code == 404
        stats = client.get("/stats").json()["registry"]
        assert stats["streams_listed"] == len(live) and stats["failing"] == []

    # A clean restart finds nothing to repair.
    with serving(*disk(tmp_path)) as (_, client):
        assert listed(client) == state
        assert client.get("/stats").json()["registry"]["repairs"] == 0


def test_entries_are_byte_for_byte_what_upstream_writes() -> None:
    with serving("--storage", "memory") as (_, client):
        assert (
            client.put(
                "/v1/stream/chat/room-1", headers={"Content-Type": "text/plain; charset=utf-8"}
            ).status_code
            == 201
        )
        assert client.delete("/v1/stream/chat/room-1").status_code == 204
        body = client.get(REGISTRY, params={"offset": "-1"}).content
        created_at = json.loads(body)[0]["value"]["createdAt"]
        assert body == (
            b'[{"type":"stream","key":"chat/room-1","value":{"path":"chat/room-1",'
            b'"contentType":"text/plain; charset=utf-8","createdAt":' + str(created_at).encode() + b"},"
            b'"headers":{"operation":"insert"}},'
            b'{"type":"stream","key":"chat/room-1","headers":{"operation":"delete"}}]'
        )


def test_a_live_reader_sees_each_create_over_sse() -> None:
    with serving("--storage", "memory") as (_, client):
        with client.stream("GET", REGISTRY, params={"offset": "now", "live": "sse"}) as events:
            assert events.status_code == 200
            lines = events.iter_lines()
            assert client.put("/v1/stream/watched", headers=TEXT).status_code == 201
            data = next(line for line in lines if line.startswith("data:") and "watched" in line)
        assert json.loads(data[5:])[0]["key"] == "watched"


def test_the_name_is_reserved() -> None:
    with serving("--storage", "memory") as (_, client):
        assert client.put("/v1/stream/src", headers=TEXT).status_code == 201
        refused = [
            client.put(REGISTRY, headers=JSON),
            client.post(
                REGISTRY,
                headers=JSON,
                content=b'{"type":"stream","key":"x","headers":{"operation":"delete"}}',
            ),
            client.post(REGISTRY, headers={"Stream-Closed": "true"}),
            client.delete(REGISTRY),
            client.put(REGISTRY, headers={"Stream-Forked-From": "/v1/stream/src"}),
            client.put("/v1/stream/copy", headers={"Stream-Forked-From": REGISTRY}),
        ]
        for answer in refused:
            assert answer.status_code == 403, answer.text
            assert answer.json()["error"]["code"] == "reserved_stream"
        # Also spelt with an escape: the canonical name is what counts.
        assert client.delete("/v1/stream/%5F%5Fregistry%5F%5F").status_code == 403
        assert client.head(REGISTRY).status_code == 200
        assert set(listed(client)) == {"src"}


def test_no_registry_frees_the_name_and_a_stream_so_named_is_refused_or_adopted(tmp_path: Path) -> None:
    with serving(*disk(tmp_path, "--no-registry")) as (_, client):
        assert client.get(REGISTRY, params={"offset": "-1"}).status_code == 404
        assert client.put("/v1/stream/kept", headers=TEXT).status_code == 201
        assert "registry" not in client.get("/stats").json()
        assert client.put(REGISTRY, headers=TEXT, content=b"my own notes").status_code == 201

    # Not JSON: not the registry; the server will not start, and says what to do.
    with pytest.raises(RuntimeError) as error:
        start(*disk(tmp_path))
    message = str(error.value)
    assert "__registry__" in message and "text/plain" in message and "--no-registry" in message

    with serving(*disk(tmp_path, "--no-registry")) as (_, client):
        assert client.get(REGISTRY, params={"offset": "-1"}).content == b"my own notes"
        assert client.delete(REGISTRY).status_code == 204
        assert client.put(REGISTRY, headers=JSON, content=b'{"not": "a change"}').status_code == 201
    with pytest.raises(RuntimeError) as error:  # JSON, but not State Protocol messages
        start(*disk(tmp_path))
    assert "not a State Protocol one" in str(error.value)

    with serving(*disk(tmp_path, "--no-registry")) as (_, client):
        assert client.delete(REGISTRY).status_code == 204
        # A JSON one (what the test-ui makes on a server without a registry) is adopted: its
        # stale entries are deleted, the streams it misses inserted.
        ghost = b'{"type":"stream","key":"ghost","value":{"path":"ghost","contentType":"text/plain","createdAt":1767225600000},"headers":{"operation":"insert"}}'
        assert client.put(REGISTRY, headers=JSON, content=ghost).status_code == 201

    with serving(*disk(tmp_path)) as (_, client):
        messages = registry_messages(client)
        assert messages[0]["key"] == "ghost" and messages[1] == {
            "type": "stream",
            "key": "ghost",
            "headers": {"operation": "delete"},
        }
        assert set(fold(messages)) == {"kept"}


def test_a_kill_between_a_change_and_its_entry_is_repaired_at_start(tmp_path: Path) -> None:
    def crashing(marker: str) -> ServerProcess:
        return launch(
            [sys.executable, "-m", "tests.crashing_server", marker, "serve", "--port", "0", *disk(tmp_path)]
        )

    server = crashing('"key":"victim","value"')  # killed as it writes victim's insert
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.put("/v1/stream/before", headers=TEXT).status_code == 201
        with pytest.raises(httpx.TransportError):
            client.put("/v1/stream/victim", headers=TEXT)  # durable, then killed: never answered
    assert server.process.wait(10) == -signal.SIGKILL
    with serving(*disk(tmp_path)) as (_, client):
        assert client.head("/v1/stream/victim").status_code == 200  # the create was on disk
        assert set(listed(client)) == {"before", "victim"}
        assert client.get("/stats").json()["registry"]["repairs"] == 1

    server = crashing('"key":"before","headers":{"operation":"delete"}')  # killed writing the delete
    with httpx.Client(base_url=server.url, timeout=10) as client:
        with pytest.raises(httpx.TransportError):
            client.delete("/v1/stream/before")
    assert server.process.wait(10) == -signal.SIGKILL
    with serving(*disk(tmp_path)) as (_, client):
        assert client.head("/v1/stream/before").status_code == 404
        assert set(listed(client)) == {"victim"}


def test_it_is_compacted_and_its_floor_raised_without_a_rule(tmp_path: Path) -> None:
    long = "/".join(["x" * 200] * 4)  # long names make big entries: 256 KiB in ~90 creates and deletes
    with serving(*disk(tmp_path, "--retention-interval", "0.2")) as (_, client):
        assert client.put("/v1/stream/stays", headers=TEXT).status_code == 201
        for n in range(100):
            name = f"churn/{n}-{long}"
            assert client.put(f"/v1/stream/{name}", headers=TEXT).status_code == 201
            assert client.delete(f"/v1/stream/{name}").status_code == 204
        deadline = time.monotonic() + 20
        while client.head(REGISTRY).headers["Stream-Earliest-Offset"].endswith("_0000000000000000"):
            assert time.monotonic() < deadline, "the registry was not compacted"
            time.sleep(0.1)
        messages = registry_messages(client)  # from the floor: the snapshot, then what came since
        assert messages[0]["headers"]["control"] == "snapshot-start"
        assert set(fold(messages)) == {"stays"}
        deadline = time.monotonic() + 20
        while len(segment_files(tmp_path, "__registry__")) > 1:  # what is below the floor goes
            assert time.monotonic() < deadline, "the segments below the floor stayed"
            time.sleep(0.1)
        assert client.get("/stats").json()["retention"]["rules"] == 1


@pytest.fixture(scope="module")
def auth_server() -> Iterator[ServerProcess]:
    server = start("--storage", "memory", "--auth-jwt-secret", SECRET, "--auth-audience", AUDIENCE)
    yield server
    server.stop()


@pytest.mark.parametrize(
    ("scope", "status"),
    [
        ("read:**", 403),
        ("read:*", 403),
        ("write:**", 403),
        ("read:__registry__", 200),
        ("write:__registry__", 200),
        ("admin", 200),
    ],
)
def test_reading_it_needs_its_own_grant_or_admin(auth_server: ServerProcess, scope: str, status: int) -> None:
    with httpx.Client(base_url=auth_server.url, timeout=10) as client:
        assert client.get(REGISTRY, params={"offset": "-1"}).status_code == 401
        answer = client.get(REGISTRY, params={"offset": "-1"}, headers=bearer(token(scope)))
        assert answer.status_code == status, answer.text
        if status == 403:
            assert answer.json()["error"]["code"] == "insufficient_scope"
        assert client.head(REGISTRY, headers=bearer(token(scope))).status_code == status


def test_with_auth_not_even_an_admin_writes_it(auth_server: ServerProcess) -> None:
    with httpx.Client(base_url=auth_server.url, timeout=10) as client:
        for headers in (bearer(ADMIN), bearer(token(["write:__registry__", "write:**"]))):
            answer = client.post(REGISTRY, headers={**headers, **JSON}, content=b"{}")
            assert answer.status_code == 403 and answer.json()["error"]["code"] == "reserved_stream"
        assert client.put("/v1/stream/mine", headers={**bearer(token("write:**")), **TEXT}).status_code == 201
        assert "mine" in listed(client, bearer(token("read:__registry__")))


def test_the_registry_cannot_be_a_wake_stream() -> None:
    """Found by review: a pull-wake subscription appended its wake events to `__registry__`, which
    then held messages that are not a stream list, and the server refused to start on it."""
    server = start(*FAST)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            assert client.put("/v1/stream/watched", headers={"Content-Type": "text/plain"}).status_code == 201
            body = {"type": "pull-wake", "streams": ["watched"], "wake_stream": "__registry__"}
            refused = client.put("/v1/stream/__ds/subscriptions/evil", json=body)
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "reserved_stream"
    finally:
        server.stop()
