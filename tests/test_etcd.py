"""The etcd client (streamkeep/coordination/etcd.py) against real etcd processes on loopback.

Keys, prefixes and revisions; compare-and-set under contention (one winner per revision); leases
that expire without keepalives and stay with them; a 3-member cluster losing the member the client
uses (its leader, the hardest case: proposals in flight are lost) while the client goes on through
another; `EtcdUnavailable` naming every endpoint when none is left; and the outcome of a
conditional write whose answer was lost reported as unknown, never as a false "lost".
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from streamkeep.coordination.etcd import (
    Etcd,
    EtcdOutcomeUnknown,
    EtcdUnavailable,
    KeyValue,
    LeaseNotFound,
)
from streamkeep.coordination.local_etcd import LocalEtcd

_names = itertools.count()


def fresh(prefix: str = "t") -> str:
    """A key prefix no other test uses (the single-member etcd is shared by the module)."""
    return f"/{prefix}{next(_names)}/"


@pytest.fixture(scope="module")
def etcd1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    with LocalEtcd(tmp_path_factory.mktemp("etcd1"), members=1) as cluster:
        yield cluster


@pytest.fixture
def etcd3(tmp_path: Path) -> Iterator[LocalEtcd]:
    with LocalEtcd(tmp_path / "etcd3", members=3) as cluster:
        yield cluster


async def test_put_get_prefix_delete(etcd1: LocalEtcd) -> None:
    p = fresh()
    async with Etcd(etcd1.endpoints) as etcd:
        assert await etcd.get(p + "missing") is None
        first = await etcd.put(p + "a", b"\x00\xffbinary")
        second = await etcd.put(p + "b", b"")
        await etcd.put(p + "b/c", "ü".encode())
        await etcd.put(p[:-1] + "0", b"beside the prefix")  # "/tN0" sorts after "/tN/" but is not in it
        assert second > first
        a = await etcd.get(p + "a")
        assert a == KeyValue(p + "a", b"\x00\xffbinary", first, first, 1, 0)
        third = await etcd.put(p + "a", b"again")
        a = await etcd.get(p + "a")
        assert a is not None and (a.value, a.create_revision, a.mod_revision, a.version) == (
            b"again",
            first,
            third,
            2,
        )
        listed = await etcd.get_prefix(p)
        assert [(kv.key, kv.value) for kv in listed] == [
            (p + "a", b"again"),
            (p + "b", b""),
            (p + "b/c", "ü".encode()),
        ]
        assert await etcd.get_prefix(p + "zz") == []
        assert await etcd.delete(p + "b") is True
        assert await etcd.delete(p + "b") is False
        assert [kv.key for kv in await etcd.get_prefix(p)] == [p + "a", p + "b/c"]


async def test_compare_and_put_has_one_winner_per_revision(etcd1: LocalEtcd) -> None:
    key = fresh() + "owner"
    async with Etcd(etcd1.endpoints) as etcd, Etcd(etcd1.endpoints) as other:
        # mod_revision 0: only while the key does not exist.
        assert await etcd.compare_and_put(key, b"first", mod_revision=0) is True
        assert await other.compare_and_put(key, b"second", mod_revision=0) is False
        current = await etcd.get(key)
        assert current is not None and current.value == b"first"

        clients = [etcd, other]
        for round_ in range(10):
            seen = await etcd.get(key)
            assert seen is not None
            wins: list[bytes] = []

            async def contend(value: bytes, client: Etcd, revision: int, wins: list[bytes]) -> None:
                if await client.compare_and_put(key, value, mod_revision=revision):
                    wins.append(value)

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    value = f"round {round_} contender {i}".encode()
                    nursery.start_soon(contend, value, clients[i % 2], seen.mod_revision, wins)
            after = await etcd.get(key)
            assert len(wins) == 1, f"round {round_}: {len(wins)} winners"
            assert after is not None and after.value == wins[0]
            assert after.mod_revision > seen.mod_revision

        stale = (await etcd.get(key)).mod_revision - 1  # type: ignore[union-attr]
        assert await etcd.compare_and_delete(key, mod_revision=stale) is False
        assert await etcd.get(key) is not None
        assert await etcd.compare_and_delete(key, mod_revision=stale + 1) is True
        assert await etcd.get(key) is None
        assert await etcd.compare_and_delete(key, mod_revision=0) is False  # nothing left to delete


async def test_leased_key_vanishes_without_keepalive_and_stays_with_it(etcd1: LocalEtcd) -> None:
    p = fresh()
    async with Etcd(etcd1.endpoints) as etcd:
        kept = await etcd.grant_lease(2)
        dropped = await etcd.grant_lease(2)
        assert kept != dropped and kept > 0
        await etcd.put(p + "kept", b"alive", lease=kept)
        await etcd.put(p + "dropped", b"doomed", lease=dropped)
        leased = await etcd.get(p + "kept")
        assert leased is not None and leased.lease == kept

        async def keep_alive() -> None:
            while True:
                assert await etcd.keepalive(kept) == 2  # renewed to its full TTL each time
                await trio.sleep(0.4)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_alive)
            with trio.fail_after(10):
                while await etcd.get(p + "dropped") is not None:
                    assert await etcd.get(p + "kept") is not None
                    await trio.sleep(0.1)
            # `dropped` was granted after `kept`, so `kept` has outlived its own TTL by now: only
            # the keepalives hold it. Hold it past another TTL to be sure.
            end = trio.current_time() + 2.5
            while trio.current_time() < end:
                assert await etcd.get(p + "kept") is not None
                await trio.sleep(0.25)
            nursery.cancel_scope.cancel()

        assert await etcd.keepalive(dropped) == 0  # expired: 0, not an error
        assert await etcd.time_to_live(dropped) == 0
        assert 0 < await etcd.time_to_live(kept) <= 2
        with pytest.raises(LeaseNotFound):
            await etcd.put(p + "late", b"x", lease=dropped)


async def test_revoked_lease_keepalive_gives_zero_and_its_keys_go(etcd1: LocalEtcd) -> None:
    p = fresh()
    async with Etcd(etcd1.endpoints) as etcd:
        lease = await etcd.grant_lease(30)
        await etcd.put(p + "k", b"v", lease=lease)
        assert await etcd.keepalive(lease) == 30
        await etcd.revoke(lease)
        assert await etcd.keepalive(lease) == 0
        assert await etcd.get(p + "k") is None  # revoking deletes the lease's keys at once
        await etcd.revoke(lease)  # already gone: no error
        assert await etcd.keepalive(123456789) == 0  # never existed
        with pytest.raises(LeaseNotFound):
            await etcd.compare_and_put(p + "k", b"v", mod_revision=0, lease=lease)


def leader_first(cluster: LocalEtcd) -> list[str]:
    """The cluster's endpoints, its leader first, so that a client starts on the leader."""
    statuses = [
        httpx.post(url + "/v3/maintenance/status", json={}, timeout=5).json() for url in cluster.endpoints
    ]
    leader = statuses[0]["leader"]
    ids = [status["header"]["member_id"] for status in statuses]
    assert leader in ids
    return sorted(cluster.endpoints, key=lambda url: ids[cluster.endpoints.index(url)] != leader)


async def test_client_survives_losing_its_member_and_names_every_endpoint_when_all_are_gone(
    etcd3: LocalEtcd,
) -> None:
    endpoints = leader_first(etcd3)
    async with Etcd(endpoints) as etcd:
        await etcd.put("/fail/before", b"1")
        lease = await etcd.grant_lease(10)
        await etcd.put("/fail/leased", b"held", lease=lease)
        assert etcd.endpoint == endpoints[0]

        used = etcd3.endpoints.index(etcd.endpoint)
        etcd3.kill(used)  # the leader, and the client's member

        started = trio.current_time()
        revision = await etcd.put("/fail/after", b"2")
        took = trio.current_time() - started
        assert etcd.endpoint != endpoints[0]
        before = await etcd.get("/fail/before")
        assert before is not None and before.value == b"1"
        assert await etcd.compare_and_put("/fail/after", b"3", mod_revision=revision) is True
        assert await etcd.keepalive(lease) == 10  # the lease outlives the leader that granted it
        assert [kv.key for kv in await etcd.get_prefix("/fail/")] == [
            "/fail/after",
            "/fail/before",
            "/fail/leased",
        ]
        print(f"first put after the leader's SIGKILL: {took:.2f}s")

        # Back on its data and ports, the member catches up with what it missed.
        etcd3.restart(used)
        async with Etcd([etcd3.endpoints[used]]) as alone:
            after = await alone.get("/fail/after")
            assert after is not None and after.value == b"3"

    async with Etcd(etcd3.endpoints, timeout=0.5) as etcd:
        for index in range(3):
            etcd3.kill(index)
        with pytest.raises(EtcdUnavailable) as raised:
            await etcd.get("/fail/before")
        for url in etcd3.endpoints:
            assert url in str(raised.value)


class LosesAnswers:
    """A real socket in front of etcd that takes one request, passes it on or not, and closes the
    connection without answering: the client cannot know whether its write was applied."""

    def __init__(self, target: str, *, apply: bool) -> None:
        self.target = target
        self.apply = apply
        self.requests = 0
        self.peers: list[str] = []

    async def serve(self, stream: trio.SocketStream) -> None:
        self.peers.append(stream.socket.getpeername()[0])
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some()
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = next(int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length"))
        while len(body) < length:
            body += await stream.receive_some()
        self.requests += 1
        if self.apply:
            path = lines[0].split()[1]
            async with httpx.AsyncClient(trust_env=False) as client:
                answer = await client.post(self.target + path, content=body)
                assert answer.status_code == 200
        await stream.aclose()


async def test_conditional_write_with_a_lost_answer_is_unknown_not_false(etcd1: LocalEtcd) -> None:
    key = fresh() + "epoch"
    async with Etcd(etcd1.endpoints) as direct:
        for apply in (True, False):
            front = LosesAnswers(etcd1.endpoints[0], apply=apply)
            async with trio.open_nursery() as nursery:
                listeners = await nursery.start(partial(trio.serve_tcp, front.serve, 0, host="127.0.0.1"))
                port = listeners[0].socket.getsockname()[1]
                revision = await direct.put(key, b"old")
                endpoints = [f"http://127.0.0.1:{port}", *etcd1.endpoints]
                async with Etcd(endpoints, local_address="127.0.0.2") as etcd:
                    if apply:
                        # Applied through the front, answer lost; the retry on etcd itself then finds
                        # the revision moved by our own write: "lost" would be a lie.
                        with pytest.raises(EtcdOutcomeUnknown):
                            await etcd.compare_and_put(key, b"new", mod_revision=revision)
                        assert (await direct.get(key)).value == b"new"  # type: ignore[union-attr]
                    else:
                        # Not applied: the retry on etcd decides, and says so.
                        assert await etcd.compare_and_put(key, b"new", mod_revision=revision) is True
                        assert etcd.endpoint == etcd1.endpoints[0]
                nursery.cancel_scope.cancel()
            assert front.requests == 1
            assert front.peers == ["127.0.0.2"]  # local_address picks the source address
