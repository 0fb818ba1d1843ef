"""One `__registry__` for a cluster (issue 16), with real processes behind a real HAProxy.

The member owning the name keeps it and lists every member's streams; the other relays its creates
and deletes there and keeps none of its own. With the keeper killed, creates elsewhere still
succeed and are listed once it is back; a member's entries are never dropped because it is merely
unreachable; a stream whose entry could not be sent is listed once the cluster reconciles.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ops.serverproc import start
from streamkeep.cluster.forward import HEADER, stamp_header
from streamkeep.cluster.peers import Peers
from streamkeep.cluster.registry import CHANGE
from streamkeep.protocol.errors import ProtocolError
from tests.test_cluster import SECRET, Cluster, wait_for
from tests.test_registry import fold, registry_messages

# The `cluster` fixture (tests/conftest.py): two members and HAProxy, here with a cluster secret.
with_secret = pytest.mark.parametrize("cluster", [SECRET], ids=["secret"], indirect=True)

REGISTRY = "__registry__"
TEXT = {"Content-Type": "text/plain"}
JSON = {"Content-Type": "application/json"}


def roles(cluster: Cluster) -> tuple[str, str]:
    """(the member keeping the registry, the other one)."""
    keeper = cluster.placement.owner(REGISTRY).id
    return keeper, "b" if keeper == "a" else "a"


def named(cluster: Cluster, prefix: str, owner: str, count: int = 1) -> list[str]:
    names = (f"{prefix}/{i}" for i in range(500))
    return [name for name in names if cluster.placement.owner(name).id == owner][:count]


def listed(url: str) -> dict[str, dict[str, Any]]:
    with httpx.Client(base_url=url, timeout=10) as client:
        return fold(registry_messages(client))


def registry_stats(cluster: Cluster, member: str) -> dict[str, Any]:
    return dict(httpx.get(f"{cluster.direct(member)}/stats", timeout=5).json()["registry"])


def held(cluster: Cluster, member: str) -> list[str]:
    """The streams `member` itself holds: its own admin list, asked as a fellow member would (a
    client's request gets the whole cluster's)."""
    target = "/v1/admin/streams"
    fellow = "b" if member == "a" else "a"
    signed = {HEADER: stamp_header(SECRET, fellow, "GET", target)}
    rows = httpx.get(f"{cluster.direct(member)}{target}", headers=signed, timeout=5).json()["streams"]
    return sorted(row["name"] for row in rows)


async def relay_changes(
    cluster: Cluster, member: str, changes: list[tuple[str, float]]
) -> list[tuple[int, str]]:
    """Sends `registry.change` inserts to the keeper as `member`, each stamped as sent at its
    time; returns how each was refused."""
    peers = Peers(cluster.placement, member, SECRET)
    refusals = []
    try:
        for name, sent in changes:
            value = {"path": name, "contentType": "text/plain", "createdAt": int(sent * 1000)}
            with pytest.raises(ProtocolError) as refused:
                await peers.call(
                    cluster.placement.owner(REGISTRY), CHANGE, {"name": name, "value": value, "sent": sent}
                )
            refusals.append((refused.value.status, refused.value.code))
    finally:
        await peers.aclose()
    return refusals


def kill(cluster: Cluster, member: str) -> None:
    cluster.members[member].process.kill()  # SIGKILL: no shutdown, no flush
    cluster.members[member].process.wait()


@with_secret
def test_one_registry_lists_the_streams_of_every_member_and_only_the_keeper_holds_it(
    cluster: Cluster,
) -> None:
    keeper, other = roles(cluster)
    mine, theirs = named(cluster, "reg", keeper, 4), named(cluster, "reg", other, 4)
    with httpx.Client(base_url=cluster.front, timeout=10) as front:
        for name in mine + theirs:
            headers = JSON if name in (mine[0], theirs[0]) else TEXT
            assert front.put(f"/v1/stream/{name}", headers=headers).status_code == 201
        for name in (mine[1], theirs[1]):
            assert front.delete(f"/v1/stream/{name}").status_code == 204
        live = sorted(set(mine + theirs) - {mine[1], theirs[1]})

        # Answered only once listed: no waiting, through the front door or either member.
        for url in (cluster.front, cluster.direct(keeper), cluster.direct(other)):
            state = listed(url)
            assert sorted(state) == live, url
        assert state[theirs[0]]["contentType"] == "application/json"
        assert state[theirs[2]]["contentType"] == "text/plain" and state[theirs[2]]["path"] == theirs[2]

        # Only the keeper holds it; the other member hands reads and writes of it to the keeper,
        # which refuses the writes.
        assert REGISTRY in held(cluster, keeper) and REGISTRY not in held(cluster, other)
        refused = httpx.post(f"{cluster.direct(other)}/v1/stream/{REGISTRY}", content=b"[]", headers=JSON)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "reserved_stream"

    # A change that waited too long (the relay has given up on it and may since have deleted the
    # stream) is refused, not appended; so is one of a stream the caller does not own.
    late, foreign = named(cluster, "late", other)[0], named(cluster, "late", keeper)[0]
    refusals = trio.run(relay_changes, cluster, other, [(late, time.time() - 60), (foreign, time.time())])
    assert refusals == [(503, "registry_change_late"), (409, "not_owner")]
    assert sorted(listed(cluster.front)) == live

    relay, kept = registry_stats(cluster, other), registry_stats(cluster, keeper)
    assert relay["keeper"] == keeper and relay["sent"] >= 5 and relay["unsent"] == 0
    wait_for(lambda: not registry_stats(cluster, other)["owed"])  # its start repair is paid
    assert (
        kept["keeper"] == keeper
        and kept["changes_from_members"] >= 5
        and kept["late_changes"] == 1
        and kept["streams_listed"] == len(live)
    )


@with_secret
def test_with_the_keeper_killed_creates_elsewhere_succeed_and_are_listed_once_it_is_back(
    cluster: Cluster,
) -> None:
    keeper, other = roles(cluster)
    before = named(cluster, "old", other, 3) + named(cluster, "old", keeper, 1)
    during, second = named(cluster, "new", other, 3)[:2], named(cluster, "new", other, 3)[2]
    with httpx.Client(base_url=cluster.front, timeout=10) as front:
        for name in before:
            assert front.put(f"/v1/stream/{name}", headers=TEXT).status_code == 201
        assert sorted(listed(cluster.front)) == sorted(before)

        kill(cluster, keeper)
        for name in during:  # never failed because of its entry
            assert front.put(f"/v1/stream/{name}", headers=TEXT).status_code == 201
        assert front.delete(f"/v1/stream/{before[0]}").status_code == 204
        stats = registry_stats(cluster, other)
        assert stats["owed"] and stats["unsent"] == 3 and stats["calls_failed"] >= 1, stats
        assert stats["cause"].startswith("member_unavailable: ") and keeper in stats["cause"], stats

        cluster.start_member(keeper)  # its start reconciles the other member's part
        # The front door answers 503 + Retry-After until its health check has seen the keeper again.
        wait_for(lambda: front.get(f"/v1/stream/{REGISTRY}?offset=-1").status_code == 200)
        expected = sorted(set(before + during) - {before[0]})
        wait_for(lambda: sorted(listed(cluster.front)) == expected)
        wait_for(lambda: not registry_stats(cluster, other)["owed"])
        assert registry_stats(cluster, other)["cause"] is None

        # Both down: the keeper back alone cannot list the other's streams, and keeps their entries.
        kill(cluster, keeper)
        assert front.put(f"/v1/stream/{second}", headers=TEXT).status_code == 201
        kill(cluster, other)
        cluster.start_member(keeper)
        wait_for(lambda: front.get(f"/v1/stream/{REGISTRY}?offset=-1").status_code == 200)
        assert sorted(listed(cluster.front)) == expected  # nothing of the unreachable member dropped
        behind = registry_stats(cluster, keeper)["members_behind"]
        assert list(behind) == [other], behind

        cluster.start_member(other)  # asks the keeper to reconcile its part: the stream sent nowhere appears
        wait_for(lambda: sorted(listed(cluster.front)) == sorted([*expected, second]))
        wait_for(lambda: registry_stats(cluster, keeper)["members_behind"] == {})


def test_a_registry_a_member_kept_alone_is_dropped_and_its_streams_join_the_clusters(tmp_path: Path) -> None:
    """Before the cluster had one registry each member kept its own; the one left on a member that
    does not own the name is out of reach, so it goes, and that member's streams are listed in the
    cluster's."""
    built = Cluster(tmp_path, SECRET)
    keeper, other = roles(built)
    old = named(built, "alone", other, 2)
    alone = start("--storage", "disk", "--data-dir", str(tmp_path / other), "--fsync", "always")
    try:
        for name in old:
            assert httpx.put(f"{alone.url}/v1/stream/{name}", headers=TEXT, timeout=10).status_code == 201
        assert sorted(listed(alone.url)) == old
    finally:
        alone.stop()
    try:
        built.start_member(keeper)
        built.start_member(other)
        built.start_haproxy()
        assert held(built, other) == old  # its own __registry__ is gone
        wait_for(lambda: sorted(listed(built.front)) == old)
    finally:
        built.stop()
