"""Forks whose source lives on another cluster member (issue 16): real members on disk storage
behind a real HAProxy.

The fork's member reads the inherited range from the source's member; the source holds a pin for
the fork, saved before the fork exists, so deleting the source only soft-deletes it, a restart
keeps it so, and the last fork's delete removes it (the cascade). A pin whose fork never came to
be (its member died between the two steps) is dropped by the source member's reconcile.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
import trio

from streamkeep.cluster.peers import Peers
from streamkeep.cluster.placement import Placement
from streamkeep.protocol import offsets
from streamkeep.protocol.errors import ProtocolError
from streamkeep.segments import layout
from tests.test_cluster import SECRET, Cluster, wait_for

pytestmark = pytest.mark.parametrize("cluster", [SECRET], ids=["secret"], indirect=True)

JSON = {"Content-Type": "application/json"}


def named(cluster: Cluster, prefix: str, owner: str) -> str:
    return next(n for n in (f"{prefix}/{i}" for i in range(200)) if cluster.placement.owner(n).id == owner)


@pytest.fixture
def client(cluster: Cluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.front, timeout=10) as front:
        yield front


def fork(client: httpx.Client, name: str, source: str, offset: str | None = None) -> httpx.Response:
    headers = {"Stream-Forked-From": f"/v1/stream/{source}"}
    if offset is not None:
        headers["Stream-Fork-Offset"] = offset
    return client.put(f"/v1/stream/{name}", headers=headers)


def messages(client: httpx.Client, name: str, offset: str = "-1") -> list[object]:
    answer = client.get(f"/v1/stream/{name}?offset={offset}")
    assert answer.status_code == 200, answer.text
    return list(answer.json())


def fork_stats(cluster: Cluster, member: str) -> dict:
    return dict(httpx.get(f"{cluster.direct(member)}/stats", timeout=5).json()["cluster_forks"])


def test_a_chain_of_forks_across_members_reads_soft_deletes_and_cascades(
    cluster: Cluster, client: httpx.Client
) -> None:
    source, middle, last = named(cluster, "src", "a"), named(cluster, "mid", "b"), named(cluster, "end", "a")
    assert client.put(f"/v1/stream/{source}", headers=JSON, content=b'[{"n":1}]').status_code == 201
    second = client.post(f"/v1/stream/{source}", headers=JSON, content=b'[{"n":2}]')
    fork_point = second.headers["stream-next-offset"]
    assert client.post(f"/v1/stream/{source}", headers=JSON, content=b'[{"n":3}]').status_code == 204
    # On b, from a's stream at its second message; then on a again, from b's fork.
    made = fork(client, middle, source, fork_point)
    assert made.status_code == 201, made.text
    assert fork(client, middle, source, fork_point).status_code == 200  # idempotent, no second pin
    assert messages(client, middle) == [{"n": 1}, {"n": 2}]
    assert client.post(f"/v1/stream/{middle}", headers=JSON, content=b'[{"n":"m"}]').status_code == 204
    assert fork(client, last, middle).status_code == 201
    assert client.post(f"/v1/stream/{last}", headers=JSON, content=b'[{"n":"e"}]').status_code == 204
    assert messages(client, last) == [{"n": 1}, {"n": 2}, {"n": "m"}, {"n": "e"}]
    # Offsets of the source are offsets of its forks; one inside a JSON message is refused by
    # the member that holds the message.
    first_end = offsets.decode(client.get(f"/v1/stream/{source}?offset=-1").headers["stream-next-offset"])
    assert messages(client, last, fork_point) == [{"n": "m"}, {"n": "e"}]
    inside = offsets.encode(3, offsets.decode(fork_point).incarnation)
    refused = client.get(f"/v1/stream/{last}?offset={inside}")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_offset", refused.text
    assert first_end.position > 3
    # Live reads start in the inherited range and go on with the fork's own data.
    live = client.get(f"/v1/stream/{middle}?offset=-1&live=long-poll")
    assert live.status_code == 200 and json.loads(live.content) == [{"n": 1}, {"n": 2}, {"n": "m"}]
    assert fork_stats(cluster, "a")["attached"] == 1 and fork_stats(cluster, "b")["attached"] == 1
    assert fork_stats(cluster, "a")["pins"] == 1 and fork_stats(cluster, "b")["pins"] == 1
    metrics = httpx.get(f"{cluster.direct('a')}/metrics", timeout=5).text
    assert (
        "streamkeep_cluster_fork_pins 1.0" in metrics
        and "streamkeep_cluster_inherited_reads_total" in metrics
    )
    assert 'streamkeep_cluster_calls_total{direction="in",outcome="answered"}' in metrics
    # The stream browser's list through the front door holds every member's streams.
    listed = client.get("/v1/admin/streams").json()
    assert {source, middle, last} <= {row["name"] for row in listed["streams"]}
    assert listed["members"] == {"a": "ok", "b": "ok"} and listed["total"] == len(listed["streams"])
    assert client.get(f"/v1/admin/streams/{source}").json()["forks"] == [middle]
    assert client.get(f"/v1/admin/streams/{middle}").json()["fork_base_offset"] == fork_point
    # Deleting the source and the middle only soft-deletes them: the last fork still reads it all.
    assert client.delete(f"/v1/stream/{source}").status_code == 204
    assert client.delete(f"/v1/stream/{middle}").status_code == 204
    assert client.get(f"/v1/stream/{source}?offset=-1").status_code == 410
    again = client.put(f"/v1/stream/{source}", headers=JSON)
    assert again.status_code == 409 and again.json()["error"]["code"] == "stream_soft_deleted"
    assert messages(client, last) == [{"n": 1}, {"n": 2}, {"n": "m"}, {"n": "e"}]
    # The last fork's delete cascades: b's middle goes, then a's source; both paths are free.
    assert client.delete(f"/v1/stream/{last}").status_code == 204
    assert client.put(f"/v1/stream/{middle}", headers=JSON).status_code == 201
    assert client.put(f"/v1/stream/{source}", headers=JSON).status_code == 201
    assert fork_stats(cluster, "a")["pins"] == 0 and fork_stats(cluster, "b")["pins"] == 0


def test_pins_survive_a_crash_and_a_pin_without_its_fork_is_reconciled_away(
    cluster: Cluster, client: httpx.Client
) -> None:
    source, forked, orphaned = (
        named(cluster, "src", "a"),
        named(cluster, "f", "b"),
        named(cluster, "lone", "a"),
    )
    text = {"Content-Type": "text/plain"}
    assert client.put(f"/v1/stream/{source}", headers=text, content=b"abc").status_code == 201
    assert fork(client, forked, source).status_code == 201
    base = client.head(f"/v1/stream/{forked}").headers["stream-next-offset"]
    assert client.post(f"/v1/stream/{forked}", headers=text, content=b"def").status_code == 204
    assert client.delete(f"/v1/stream/{source}").status_code == 204  # soft: the fork reads it
    # The fork's member died after the source's member pinned a fork that never came to be.
    assert client.put(f"/v1/stream/{orphaned}", headers=text, content=b"xyz").status_code == 201

    async def pin_without_fork() -> None:
        peers = Peers(cluster.placement, "b", SECRET)
        try:
            answer = await peers.call(
                cluster.placement.owner(orphaned),
                "fork.attach",
                {
                    "source": orphaned,
                    "offset": None,
                    "sub_offset": 0,
                    "content_type": None,
                    "fork": named(cluster, "never", "b"),
                    "pin": "0123456789ab",
                },
            )
            assert answer["base"] == 3
        finally:
            await peers.aclose()

    trio.run(pin_without_fork)
    assert client.delete(f"/v1/stream/{orphaned}").status_code == 204
    assert client.put(f"/v1/stream/{orphaned}", headers=text).status_code == 409  # pinned: soft-deleted
    # While the source's member is down the inherited range answers 503; the fork's own does not.
    cluster.members["a"].stop(signal.SIGKILL)
    down = httpx.get(f"{cluster.direct('b')}/v1/stream/{forked}?offset=-1", timeout=10)
    assert down.status_code == 503 and down.headers["retry-after"], down.text
    assert httpx.get(f"{cluster.direct('b')}/v1/stream/{forked}?offset={base}", timeout=10).content == b"def"
    cluster.start_member("a")
    # The pin of the real fork survived the crash (the source is still soft-deleted and read);
    # the orphan's pin went at start, and with it the soft-deleted stream.
    wait_for(lambda: client.put(f"/v1/stream/{orphaned}", headers=text).status_code == 201)
    assert client.get(f"/v1/stream/{forked}?offset=-1").content == b"abcdef"
    assert client.get(f"/v1/stream/{source}?offset=-1").status_code == 410
    stats = fork_stats(cluster, "a")
    assert stats["pins"] == 1 and stats["pins_dropped"] == 1 and stats["reconciles"] >= 1
    assert client.delete(f"/v1/stream/{forked}").status_code == 204
    assert client.put(f"/v1/stream/{source}", headers=text).status_code == 201


def test_cluster_calls_are_for_members_only(cluster: Cluster, client: httpx.Client) -> None:
    for url in (f"{cluster.front}/_cluster/fork.read", f"{cluster.direct('a')}/_cluster/fork.read"):
        refused = httpx.post(url, content=b"\xa0", timeout=5)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "members_only"
    forged = httpx.post(
        f"{cluster.direct('a')}/_cluster/fork.read",
        headers={"Streamkeep-Forwarded": "b 1 00"},
        content=b"\xa0",
    )
    assert forged.status_code == 403 and forged.json()["error"]["code"] == "bad_cluster_signature"

    async def odd_calls() -> None:
        peers = Peers(cluster.placement, "b", SECRET)
        member = peers.member_of("a")
        try:
            missing = named(cluster, "nope", "a")
            for op, payload, code in (
                ("fork.nothing", {}, "unknown_cluster_call"),
                ("fork.read", {"source": 5}, "bad_cluster_call"),
                ("fork.read", {"source": missing, "start": 0, "max": 1, "limit": 1}, "fork_source_missing"),
                (
                    "fork.attach",
                    {"source": missing, "offset": None, "sub_offset": 0, "fork": "x", "pin": "p"},
                    "stream_not_found",
                ),
            ):
                with pytest.raises(Exception) as raised:
                    await peers.call(member, op, payload)
                assert getattr(raised.value, "code", None) == code, (op, raised.value)
        finally:
            await peers.aclose()
        stale = Peers(Placement.of(list(cluster.placement.members), 2), "b", SECRET)
        try:
            with pytest.raises(ProtocolError) as raised:
                await stale.call(stale.member_of("a"), "fork.exists", {"forks": []})
            assert raised.value.code == "stale_placement" and raised.value.status == 503
        finally:
            await stale.aclose()

    trio.run(odd_calls)


def test_a_fork_recovery_could_not_load_keeps_its_pin(cluster: Cluster, client: httpx.Client) -> None:
    """Found by review: a fork whose directory recovery skipped (damaged meta.cbor, left for
    inspection) was reported absent, and its source's member freed the data it inherits."""
    source, forked = named(cluster, "src", "b"), named(cluster, "fk", "a")
    text = {"Content-Type": "text/plain"}
    assert client.put(f"/v1/stream/{source}", headers=text, content=b"inherited;").status_code == 201
    assert fork(client, forked, source).status_code == 201
    assert client.delete(f"/v1/stream/{source}").status_code == 204  # soft: the fork reads it
    cluster.members["a"].stop()
    meta = cluster.root / "a" / layout.STREAMS / layout.stream_dirname(forked) / layout.META
    saved = meta.read_bytes()
    meta.write_bytes(b"\xff")
    cluster.start_member("a")
    cluster.members["b"].stop()
    cluster.start_member("b")  # its reconcile runs at start and asks a about the fork
    wait_for(lambda: fork_stats(cluster, "b")["reconciles"] >= 1)
    assert fork_stats(cluster, "b")["pins"] == 1 and fork_stats(cluster, "b")["pins_dropped"] == 0
    cluster.members["a"].stop()
    meta.write_bytes(saved)  # the operator repairs it
    cluster.start_member("a")
    # Until HAProxy's health check has seen the restarted member, the front door answers 503 with
    # Retry-After (a client retries); the read is judged once it reaches the member.
    wait_for(lambda: client.get(f"/v1/stream/{forked}?offset=-1").status_code != 503)
    assert client.get(f"/v1/stream/{forked}?offset=-1").content == b"inherited;"


def test_a_delete_does_not_wait_long_for_a_frozen_source_member(
    cluster: Cluster, client: httpx.Client
) -> None:
    """Found by review: the fork's delete told the source's member inside a shielded scope with
    the calls' full timeout, so a frozen member held the DELETE (and a shutdown) for ~30 s."""
    source, forked = named(cluster, "src", "b"), named(cluster, "fk", "a")
    text = {"Content-Type": "text/plain"}
    assert client.put(f"/v1/stream/{source}", headers=text, content=b"x").status_code == 201
    assert fork(client, forked, source).status_code == 201
    frozen = cluster.members["b"].process
    frozen.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        deleted = httpx.delete(f"{cluster.direct('a')}/v1/stream/{forked}", timeout=20)
        assert deleted.status_code == 204 and time.monotonic() - started < 8
    finally:
        frozen.send_signal(signal.SIGCONT)
    # The detach arrives once b thaws (it was queued), or b's reconcile finds the fork gone.
    cluster.members["b"].stop()
    cluster.start_member("b")
    wait_for(lambda: fork_stats(cluster, "b")["pins"] == 0)
