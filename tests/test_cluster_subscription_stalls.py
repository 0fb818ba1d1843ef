"""Subscriptions across members when one member hangs: two members in one process (the real
manager, control API, drivers and `SubscriptionPeers`), their calls to each other through a fake
network that can hang a member, on trio's autojump clock (a 5 s timeout costs no real time).

A hung member costs the one call that finds it out up to 5 s, never a queue of calls behind it:
creations of other ids go on at once, later ones are refused at once while it is known to be
failing, and no remote call is made holding a subscription's lock. A subscription deleted before
it was announced is not brought back on the other members.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import cbor2
import trio
import trio.testing

from streamkeep.actors.supervisor import Supervisor
from streamkeep.cluster.peers import DownMembers, PeerOps
from streamkeep.cluster.placement import Member, Placement
from streamkeep.cluster.subscriptions import ASK_TIMEOUT_S, SubscriptionPeers
from streamkeep.cluster.subscriptions_view import RemoteStreams, subscription_owner
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.model import Headers, Request, Response
from streamkeep.server.service import Recovered, Service, ServiceOptions
from streamkeep.storage.memory import MemoryStorage
from streamkeep.subscriptions.manager import SubscriptionManager
from streamkeep.subscriptions.signing import Keys

SUBS = "/v1/stream/__ds/subscriptions"
PLACEMENT = Placement.of([Member("a", "127.0.0.1:1"), Member("b", "127.0.0.1:2")], 1)


class Net:
    """Calls between the members; calls to a hung member wait until it resumes (SIGSTOP/SIGCONT)."""

    def __init__(self) -> None:
        self.ops: dict[str, PeerOps] = {}
        self.hung: dict[str, trio.Event] = {}
        self.slow: dict[str, float] = {}  # seconds each call to a member takes
        self.calls: list[tuple[str, str, str]] = []  # (caller, callee, op)
        self.told: list[tuple[str, str, Any]] = []  # (caller, callee, interest) of sub.interest calls

    def hang(self, member: str) -> None:
        self.hung[member] = trio.Event()

    def resume(self, member: str) -> None:
        self.hung.pop(member).set()


class FakePeers:
    def __init__(self, net: Net, member: str) -> None:
        self.net, self.placement, self.member = net, PLACEMENT, member
        self.down = DownMembers()

    def others(self) -> list[Member]:
        return [m for m in self.placement.members if m.id != self.member]

    async def call(self, member: Member, op: str, payload: dict[str, Any]) -> dict[str, Any]:
        self.net.calls.append((self.member, member.id, op))
        if op == "sub.interest":
            self.net.told.append((self.member, member.id, payload["interest"]))
        hung = self.net.hung.get(member.id)
        if hung is not None:
            await hung.wait()
        await trio.sleep(self.net.slow.get(member.id, 0))
        handler = self.net.ops[member.id]._handlers[op]
        try:
            answer = await handler(self.member, cbor2.loads(cbor2.dumps(payload)))  # as on the wire
        except ProtocolError as error:
            if error.status == 503:  # as Peers.call takes it
                self.down.mark(member.id, error.message)
            raise
        self.down.answered(member.id)
        return dict(cbor2.loads(cbor2.dumps(answer)))


class Node:
    def __init__(self, service: Service, manager: SubscriptionManager, peers: SubscriptionPeers) -> None:
        self.service, self.manager, self.peers = service, manager, peers

    async def call(self, method: str, target: str, body: object = None) -> Response:
        data = b"" if body is None else json.dumps(body).encode()
        path, _, query = target.partition("?")
        headers = Headers([("Content-Type", "application/json"), ("Host", "front")])
        return await self.service.handle(Request(method, path, query, headers, data))


@asynccontextmanager
async def two_members() -> AsyncIterator[tuple[Net, dict[str, Node]]]:
    net = Net()
    nodes: dict[str, Node] = {}
    async with trio.open_nursery() as nursery:
        for member in ("a", "b"):
            storage = MemoryStorage(max_stream_bytes=1 << 20, max_total_bytes=1 << 22)
            supervisor = Supervisor(storage, nursery)
            view = RemoteStreams(PLACEMENT, member, storage)
            manager = SubscriptionManager(
                supervisor, Keys(None), state_dir=None, allow_loopback_webhooks=True, view=view
            )
            net.ops[member] = PeerOps()
            peers = SubscriptionPeers(manager, view, FakePeers(net, member), net.ops[member], None, "secret")  # type: ignore[arg-type]
            manager.attach(peers)
            service = Service(supervisor, ServiceOptions())
            service.serve_streams(Recovered(subscriptions=manager))
            nodes[member] = Node(service, manager, peers)
        for node in nodes.values():
            await nursery.start(node.manager.run)
        await trio.testing.wait_all_tasks_blocked()  # the hellos are exchanged
        assert all(state.greeted for node in nodes.values() for state in node.peers._members.values())
        yield net, nodes
        nursery.cancel_scope.cancel()


def kept_by(member: str, prefix: str) -> str:
    return next(
        i for i in (f"{prefix}{n}" for n in range(500)) if subscription_owner(PLACEMENT, i).id == member
    )


def owned_by(member: str, prefix: str) -> str:
    return next(p for p in (f"{prefix}{n}" for n in range(500)) if PLACEMENT.owner(p).id == member)


async def timed(node: Node, method: str, target: str, body: object = None) -> tuple[Response, float]:
    """The answer and how long it took (virtual seconds)."""
    start = trio.current_time()
    response = await node.call(method, target, body)
    return response, trio.current_time() - start


async def test_a_hung_member_costs_one_creation_5_s_not_every_creation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with two_members() as (net, nodes):
        a = nodes["a"]
        hook = {"type": "webhook", "pattern": "jobs/*", "webhook": {"url": "http://127.0.0.1:9/hook"}}
        answers: dict[str, tuple[Response, float]] = {}

        async def create(sub_id: str) -> None:
            answers[sub_id] = await timed(a, "PUT", f"{SUBS}/{sub_id}", hook)

        # b answers slowly: creations of different ids wait for it side by side, not in a queue.
        net.slow["b"] = 2.0
        slow = [kept_by("a", f"slow{n}-") for n in range(3)]
        async with trio.open_nursery() as nursery:
            for sub_id in slow:
                nursery.start_soon(create, sub_id)
        assert {sub_id: (answers[sub_id][0].status, answers[sub_id][1]) for sub_id in slow} == {
            sub_id: (201, 2.0) for sub_id in slow
        }
        del net.slow["b"]

        # b hangs. Two creations of different ids at once: both wait for b, neither for the other.
        net.hang("b")
        first, second = kept_by("a", "one-"), kept_by("a", "two-")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(create, first)
            await trio.sleep(0.1)
            nursery.start_soon(create, second)
        for sub_id in (first, second):
            response, took = answers[sub_id]
            assert response.status == 503 and ("Retry-After", "1") in response.headers
            assert json.loads(response.body)["error"]["code"] == "member_unavailable"
            assert took <= ASK_TIMEOUT_S + 0.01, (sub_id, took)  # not 10 s behind the other one
        # b is known to be failing now: the next creation is refused at once, b is not asked again.
        told = len(net.told)
        response, took = await timed(a, "PUT", f"{SUBS}/{kept_by('a', 'three-')}", hook)
        assert response.status == 503 and ("Retry-After", "1") in response.headers
        assert took == 0 and all(interest is None for _, _, interest in net.told[told:])  # tombstones only
        assert set(a.manager.subs) == set(a.peers._mine) == set(slow)
        assert "no answer within 5 s" in a.peers.stats()["members"]["b"]["down"]
        assert "it failed a call just before" in json.loads(response.body)["error"]["message"]
        assert a.manager.api._creating._locks == {}  # nothing left behind

        # b answers again: a probe finds it out (with backoff), and creations go through.
        net.resume("b")
        deadline = trio.current_time() + 30
        while True:
            response = await a.call("PUT", f"{SUBS}/{kept_by('a', 'four-')}", hook)
            if response.status == 201:
                break
            assert response.status == 503 and trio.current_time() < deadline
            await trio.sleep(0.5)
        assert [i.pattern for i in nodes["b"].peers.interests.of("a")] == ["jobs/*"] * 4
        assert a.peers.stats()["members"]["b"]["down"] is None


async def pull_wake_setup(nodes: dict[str, Node]) -> tuple[str, str, str]:
    """A pull-wake subscription kept by a on `tasks/*`, its wake stream on b; (id, task, wake)."""
    a, b = nodes["a"], nodes["b"]
    wake = owned_by("b", "wake/")
    task = owned_by("a", "tasks/")
    assert (await b.call("PUT", f"/v1/stream/{wake}")).status == 201
    sub_id = kept_by("a", "pull-")
    body = {"type": "pull-wake", "pattern": "tasks/*", "wake_stream": wake}
    created = await a.call("PUT", f"{SUBS}/{sub_id}", body)
    assert created.status == 201, created.body
    return sub_id, task, wake


async def test_a_claims_catch_up_with_a_hung_member_does_not_hold_the_subscription(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with two_members() as (net, nodes):
        a = nodes["a"]
        sub_id, _, _ = await pull_wake_setup(nodes)
        net.hang("b")  # just hung: nobody knows yet
        claimed: list[tuple[Response, float]] = []

        async def claim() -> None:
            claimed.append(await timed(a, "POST", f"{SUBS}/{sub_id}/claim", {"worker": "w"}))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(claim)
            await trio.sleep(0.1)
            assert not claimed and ("a", "b", "sub.interest") in net.calls  # asking b
            read, took = await timed(a, "GET", f"{SUBS}/{sub_id}")
            assert read.status == 200 and took == 0  # the subscription is not locked meanwhile
        response, took = claimed[0]
        assert response.status == 409 and json.loads(response.body)["error"]["code"] == "NO_PENDING_WORK"
        assert took <= ASK_TIMEOUT_S + 0.01
        # b is known to be failing now: the next empty claim does not wait for it at all.
        response, took = await timed(a, "POST", f"{SUBS}/{sub_id}/claim", {"worker": "w"})
        assert response.status == 409 and took == 0


async def test_a_wake_event_for_a_hung_member_does_not_hold_the_subscription(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with two_members() as (net, nodes):
        a = nodes["a"]
        sub_id, task, _ = await pull_wake_setup(nodes)
        net.hang("b")
        assert (await a.call("PUT", f"/v1/stream/{task}")).status == 201
        assert (await a.call("POST", f"/v1/stream/{task}", [{"n": 1}])).status == 204
        while ("a", "b", "sub.wake") not in net.calls:  # the driver appends the wake event on b
            await trio.sleep(0.01)
        read, took = await timed(a, "GET", f"{SUBS}/{sub_id}")
        assert read.status == 200 and took == 0
        # A worker that claims without waiting for the event gets the wake meanwhile.
        claimed, took = await timed(a, "POST", f"{SUBS}/{sub_id}/claim", {"worker": "w"})
        assert claimed.status == 200 and took == 0, claimed.body
        lease = json.loads(claimed.body)
        await trio.sleep(ASK_TIMEOUT_S + 0.1)  # the event fails: the claimed wake stays (backoff >= 0.8 s)
        sub = a.manager.subs[sub_id]
        assert sub.wake is not None and sub.wake.wake_id == lease["wake_id"] and sub.wake.holder == "w"
        assert sub.fault_until is not None  # the driver backs off and retries


async def test_a_subscription_deleted_before_it_is_announced_stays_deleted_on_every_member(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with two_members() as (_, nodes):
        a, b = nodes["a"], nodes["b"]
        path = owned_by("b", "x/")
        sub_id = kept_by("a", "gone-")
        hook = {"type": "webhook", "pattern": "x/*", "webhook": {"url": "http://127.0.0.1:9/hook"}}
        assert (await a.call("PUT", f"{SUBS}/{sub_id}", hook)).status == 201
        assert b.peers.interests.members_for(path) == ("a",)
        sub = a.manager.subs[sub_id]
        # A POST .../streams that got the subscription, then a DELETE that ran before it announced.
        assert (await a.call("DELETE", f"{SUBS}/{sub_id}")).status == 204
        await trio.testing.wait_all_tasks_blocked()  # the tombstone reached b
        assert b.peers.interests.members_for(path) == ()
        await a.peers.announce(sub, (owned_by("b", "y/"),))
        await a.peers.catch_up(sub)
        await trio.testing.wait_all_tasks_blocked()
        assert sub_id not in a.peers._mine  # a's next hello does not bring it back either
        assert b.peers.interests.members_for(path) == ()
        assert b.peers.interests.of("a") == []


async def test_an_interest_never_loses_the_paths_told_before(autojump_clock: trio.testing.MockClock) -> None:
    # A catch-up overtaking an announcement of added streams (whose links are not made yet)
    # tells the other members the added paths too.
    async with two_members() as (_, nodes):
        a, b = nodes["a"], nodes["b"]
        sub_id, _, _ = await pull_wake_setup(nodes)
        added = owned_by("b", "manual/")
        sub = a.manager.subs[sub_id]
        await a.peers.announce(sub, (added,))
        await a.peers.catch_up(sub)
        assert added in a.peers._mine[sub_id].streams
        assert b.peers.interests.members_for(added) == ("a",)


async def test_an_ack_asking_a_hung_member_for_its_tail_does_not_hold_the_subscription(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with two_members() as (net, nodes):
        a, b = nodes["a"], nodes["b"]
        sub_id, _, _ = await pull_wake_setup(nodes)
        task = owned_by("b", "tasks/")
        assert (await b.call("PUT", f"/v1/stream/{task}", [{"n": 1}])).status == 201
        await trio.testing.wait_all_tasks_blocked()  # reported to a, which issues a wake
        claimed = await a.call("POST", f"{SUBS}/{sub_id}/claim", {"worker": "w"})
        assert claimed.status == 200, claimed.body
        lease = json.loads(claimed.body)
        # b's next append is not reported (a does not answer b), and then b hangs.
        net.hang("a")
        appended = await b.call("POST", f"/v1/stream/{task}", [{"n": 2}])
        newest = dict(appended.headers)["Stream-Next-Offset"]
        net.hang("b")
        done = {"wake_id": lease["wake_id"], "generation": lease["generation"], "done": True,
                "acks": [{"stream": task, "offset": newest}]}  # fmt: skip
        headers = Headers(
            [("Content-Type", "application/json"), ("Authorization", f"Bearer {lease['token']}")]
        )
        request = Request("POST", f"{SUBS}/{sub_id}/ack", "", headers, json.dumps(done).encode())
        acked: list[tuple[Response, float]] = []

        async def ack() -> None:
            start = trio.current_time()
            acked.append((await a.service.handle(request), trio.current_time() - start))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ack)
            await trio.sleep(0.1)
            assert not acked and ("a", "b", "sub.states") in net.calls  # asking b for the tail
            read, took = await timed(a, "GET", f"{SUBS}/{sub_id}")
            assert read.status == 200 and took == 0
        response, took = acked[0]
        assert response.status == 503 and took <= ASK_TIMEOUT_S + 0.01
        net.resume("a")
        net.resume("b")
