"""Forks (§4.2) beyond the conformance suite: deep chains deleted in every order, restarts on disk."""

from __future__ import annotations

import itertools
import signal
import time
from pathlib import Path

import httpx
import pytest

from ops.serverproc import ServerProcess, start
from streamkeep.segments import layout

CT = {"Content-Type": "text/plain"}


def fork(client: httpx.Client, name: str, source: str, offset: str | None = None) -> httpx.Response:
    headers = {**CT, "Stream-Forked-From": f"/v1/stream/{source}"}
    if offset is not None:
        headers["Stream-Fork-Offset"] = offset
    return client.put(f"/v1/stream/{name}", headers=headers)


def read(client: httpx.Client, name: str) -> httpx.Response:
    return client.get(f"/v1/stream/{name}", params={"offset": "-1"})


def build_chain(client: httpx.Client, prefix: str) -> None:
    """a <- b <- c, each with data of its own after its fork point."""
    assert client.put(f"/v1/stream/{prefix}a", content=b"A1;", headers=CT).status_code == 201
    client.post(f"/v1/stream/{prefix}a", content=b"A2;", headers=CT)
    middle = client.head(f"/v1/stream/{prefix}a").headers["stream-next-offset"]
    client.post(f"/v1/stream/{prefix}a", content=b"A3;", headers=CT)  # after b's fork point: not in b
    assert fork(client, f"{prefix}b", f"{prefix}a", middle).status_code == 201
    client.post(f"/v1/stream/{prefix}b", content=b"B1;", headers=CT)
    assert fork(client, f"{prefix}c", f"{prefix}b").status_code == 201
    client.post(f"/v1/stream/{prefix}c", content=b"C1;", headers=CT)


EXPECTED = {"a": b"A1;A2;A3;", "b": b"A1;A2;B1;", "c": b"A1;A2;B1;C1;"}


@pytest.fixture(scope="module", params=["memory", "disk"])
def fork_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    data = tmp_path_factory.mktemp("forks")
    process = start("--storage", request.param, "--data-dir", str(data))
    yield process
    process.stop()


@pytest.mark.parametrize("order", list(itertools.permutations("abc")))
def test_three_deep_chain_deleted_in_every_order(fork_server: ServerProcess, order: tuple[str, ...]) -> None:
    prefix = "chain-" + "".join(order) + "-"
    with httpx.Client(base_url=fork_server.url, timeout=10) as client:
        build_chain(client, prefix)
        alive = set("abc")
        for name in order:
            assert client.delete(f"/v1/stream/{prefix}{name}").status_code == 204
            alive.discard(name)
            for other in "abc":
                response = read(client, prefix + other)
                if other in alive:
                    assert response.status_code == 200 and response.content == EXPECTED[other], (order, other)
                else:
                    # Deleted: gone for good (404) or kept for a fork that still reads it (410).
                    assert response.status_code in (404, 410), (order, other, response.status_code)
                    assert client.put(f"/v1/stream/{prefix}{other}", headers=CT).status_code in (201, 409)
                    if response.status_code == 404:
                        client.delete(f"/v1/stream/{prefix}{other}")
        # Once every member is deleted, nothing of the chain is left, not even soft-deleted parts.
        for name in "abc":
            assert read(client, prefix + name).status_code == 404


def test_forks_and_soft_deletes_survive_restarts(tmp_path: Path) -> None:
    server = start("--storage", "disk", "--data-dir", str(tmp_path))
    with httpx.Client(base_url=server.url, timeout=10) as client:
        build_chain(client, "r-")
        assert client.delete("/v1/stream/r-a").status_code == 204  # soft: b and c read it
        assert client.delete("/v1/stream/r-b").status_code == 204  # soft: c reads it
    server.stop(signal.SIGKILL)
    server = start("--storage", "disk", "--data-dir", str(tmp_path))
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            assert read(client, "r-c").content == EXPECTED["c"]
            assert read(client, "r-a").status_code == 410
            assert client.put("/v1/stream/r-b", headers=CT).status_code == 409
            assert client.delete("/v1/stream/r-c").status_code == 204  # the cascade removes b, then a
            for name in ("r-a", "r-b", "r-c"):
                assert read(client, name).status_code == 404
            # Nothing of the chain is left: only the server's list of streams.
            assert [p.name for p in (tmp_path / layout.STREAMS).iterdir()] == ["__registry__"]
    finally:
        server.stop()


def test_recovery_finishes_a_cascade_a_crash_interrupted(tmp_path: Path) -> None:
    server = start("--storage", "disk", "--data-dir", str(tmp_path))
    with httpx.Client(base_url=server.url, timeout=10) as client:
        build_chain(client, "x-")
        client.delete("/v1/stream/x-a")  # soft-deleted, read by b
    server.stop(signal.SIGKILL)
    # A crash after b's own files were removed but before a heard that b was gone:
    (tmp_path / layout.STREAMS / "x-c").rename(tmp_path / layout.TRASH / "c")
    (tmp_path / layout.STREAMS / "x-b").rename(tmp_path / layout.TRASH / "b")
    server = start("--storage", "disk", "--data-dir", str(tmp_path))
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            assert read(client, "x-a").status_code == 404
        assert any("finished deleting" in line for line in server.output)
        assert not (tmp_path / layout.STREAMS / "x-a").exists()
    finally:
        server.stop()


def test_fork_offsets_continue_the_source_positions(fork_server: ServerProcess) -> None:
    """A fork shares its source's positions and accepts its tokens, but mints its own incarnation."""
    with httpx.Client(base_url=fork_server.url, timeout=10) as client:
        client.put("/v1/stream/off-src", content=b"0123456789", headers=CT)
        source_tail = client.head("/v1/stream/off-src").headers["stream-next-offset"]
        forked = fork(client, "off-fork", "off-src")
        fork_tail = forked.headers["stream-next-offset"]
        assert fork_tail[17:] == source_tail[17:] == f"{10:016d}"
        assert fork_tail[:16] != source_tail[:16]  # a fork is another stream: its own incarnation
        client.post("/v1/stream/off-src", content=b"not-in-fork", headers=CT)
        appended = client.post("/v1/stream/off-fork", content=b"abc", headers=CT)
        assert appended.headers["stream-next-offset"] == fork_tail[:17] + f"{13:016d}"
        for token in (source_tail[:17] + f"{5:016d}", "0000000000000000_0000000000000005"):
            middle = client.get("/v1/stream/off-fork", params={"offset": token})
            assert middle.content == b"56789abc"


def test_a_create_on_a_source_that_expires_under_it_is_a_conflict(fork_server: ServerProcess) -> None:
    """A PUT that finds its path's stream expired, with forks still reading it: the stream is
    soft-deleted then and there, and the path is not free (409), not a 503 from a create that
    ran into the stream's own files (found by the simulation, seed 125 never/fdatasync)."""
    with httpx.Client(base_url=fork_server.url) as client:
        created = client.put("/v1/stream/expiring-src", content=b"S;", headers={**CT, "Stream-TTL": "1"})
        assert created.status_code == 201
        fork_headers = {**CT, "Stream-Forked-From": "/v1/stream/expiring-src", "Stream-TTL": "60"}
        assert client.put("/v1/stream/expiring-fork", headers=fork_headers).status_code == 201
        time.sleep(2.2)  # past the source's TTL, with no request touching it meanwhile
        again = client.put("/v1/stream/expiring-src", headers={**CT, "Stream-TTL": "1"})
        assert again.status_code == 409, again.text
        assert again.json()["error"]["code"] == "stream_soft_deleted"
        assert read(client, "expiring-fork").content == b"S;"  # the fork still reads its source
        assert client.delete("/v1/stream/expiring-fork").status_code == 204
        assert client.put("/v1/stream/expiring-src", headers=CT).status_code == 201  # free now


def test_the_first_request_to_an_expired_source_with_forks_hears_what_later_ones_do(
    fork_server: ServerProcess,
) -> None:
    """The request that finds a forked source expired soft-deletes it and answers 410, as every
    request after it does (it answered 404 once, then 410: torture, seed 200 replicated)."""
    with httpx.Client(base_url=fork_server.url) as client:
        assert (
            client.put("/v1/stream/ttl-src", content=b"S;", headers={**CT, "Stream-TTL": "1"}).status_code
            == 201
        )
        fork_headers = {**CT, "Stream-Forked-From": "/v1/stream/ttl-src", "Stream-TTL": "60"}
        assert client.put("/v1/stream/ttl-fork", headers=fork_headers).status_code == 201
        time.sleep(2.2)  # past the source's TTL, with no request touching it meanwhile
        for _ in range(2):
            answer = client.post("/v1/stream/ttl-src", content=b"late;", headers=CT)
            assert answer.status_code == 410 and answer.json()["error"]["code"] == "stream_deleted", (
                answer.text
            )
        assert read(client, "ttl-fork").content == b"S;"
        assert client.delete("/v1/stream/ttl-fork").status_code == 204


def test_a_fork_of_a_source_that_expires_as_it_is_asked_is_refused_as_a_deleted_source(
    fork_server: ServerProcess,
) -> None:
    """A fork create that is the first request to find its source expired (forks still read it)
    is answered as every later one is, 409 fork_source_deleted (torture, seed 301 replicated:
    it was 410 stream_deleted, the answer for requests to the source itself)."""
    with httpx.Client(base_url=fork_server.url) as client:
        assert (
            client.put("/v1/stream/ttl2-src", content=b"S;", headers={**CT, "Stream-TTL": "1"}).status_code
            == 201
        )
        assert fork(client, "ttl2-fork", "ttl2-src").status_code == 201
        time.sleep(2.2)  # past the source's TTL, with no request touching it meanwhile
        for name in ("ttl2-late", "ttl2-later"):
            answer = fork(client, name, "ttl2-src")
            assert answer.status_code == 409 and answer.json()["error"]["code"] == "fork_source_deleted", (
                answer.text
            )
        assert client.delete("/v1/stream/ttl2-fork").status_code in (204, 404)  # it took the source's TTL
