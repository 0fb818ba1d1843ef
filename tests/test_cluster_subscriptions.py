"""Subscriptions across the members of a cluster (issue 16): real processes behind a real HAProxy.

One member keeps a subscription (the one HAProxy routes its id to); its glob and explicit streams
follow streams on every member, whose members report their changes to it in the background. A
webhook from any member verifies with the JWKS of any member (one key, derived from the cluster
secret), acks and callbacks work on other members' streams, and a member killed with SIGKILL
while a report to the keeper was pending loses no wake: restarted, it reports again.
"""

from __future__ import annotations

import base64
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from streamkeep.cluster.placement import Member, Placement, slot
from streamkeep.cluster.subscriptions_view import Interest, Interests, RemoteStreams, subscription_owner
from streamkeep.storage.memory import MemoryStorage
from tests.test_cluster import SECRET, Cluster, wait_for

JSON = {"Content-Type": "application/json"}
CONTROL = "/v1/stream/__ds/"


SECRET_CLUSTER = pytest.mark.parametrize("cluster", [SECRET], ids=["secret"], indirect=True)


class Hooks:
    """A webhook receiver keeping each call's raw body and signature; answers `answer`."""

    def __init__(self, answer: dict) -> None:
        self.calls: list[tuple[bytes, str]] = []
        hooks = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                hooks.calls.append((raw, self.headers.get("Webhook-Signature", "")))
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wake(self, number: int, seconds: float = 15) -> dict:
        """The `number`th wake (1-based), waiting for it."""
        deadline = time.monotonic() + seconds
        while len(self.calls) < number:
            assert time.monotonic() < deadline, f"only {len(self.calls)} of {number} wakes came"
            time.sleep(0.02)
        return dict(json.loads(self.calls[number - 1][0]))

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def hooks() -> Iterator[Callable[[dict], Hooks]]:
    made: list[Hooks] = []

    def make(answer: dict) -> Hooks:
        made.append(Hooks(answer))
        return made[-1]

    yield make
    for receiver in made:
        receiver.close()


def kill(cluster: Cluster, member: str) -> None:
    cluster.members[member].process.kill()  # SIGKILL: nothing flushed, nothing said
    cluster.members[member].process.wait()


def named(cluster: Cluster, prefix: str, owner: str) -> str:
    return next(n for n in (f"{prefix}{i}" for i in range(500)) if cluster.placement.owner(n).id == owner)


def sub_id_kept_by(cluster: Cluster, owner: str, prefix: str = "sub-") -> str:
    return next(
        i
        for i in (f"{prefix}{n}" for n in range(500))
        if subscription_owner(cluster.placement, i).id == owner
    )


def verifies(raw: bytes, header: str, jwks: dict) -> bool:
    fields = dict(part.split("=", 1) for part in header.split(","))
    key = next(k for k in jwks["keys"] if k["kid"] == fields["kid"])
    public = Ed25519PublicKey.from_public_bytes(base64.urlsafe_b64decode(key["x"] + "=="))
    try:
        public.verify(base64.urlsafe_b64decode(fields["ed25519"] + "=="), f"{fields['t']}.".encode() + raw)
    except Exception:
        return False
    return True


def item(wake_or_view: dict, path: str) -> dict | None:
    return next((s for s in wake_or_view["streams"] if s["path"] == path), None)


def subscription_stats(cluster: Cluster, member: str) -> dict:
    return dict(httpx.get(f"{cluster.direct(member)}/stats", timeout=5).json()["subscriptions"])


@SECRET_CLUSTER
def test_a_glob_on_one_member_wakes_acks_links_and_unlinks_streams_of_the_other(
    cluster: Cluster, hooks: Callable[[dict], Hooks]
) -> None:
    receiver = hooks({})
    old, explicit, new = (
        named(cluster, "events/old-", "b"),
        named(cluster, "manual/x-", "b"),
        named(cluster, "events/new-", "b"),
    )
    sub_id = sub_id_kept_by(cluster, "a")
    with httpx.Client(base_url=cluster.front, timeout=10) as client:
        assert client.put(f"/v1/stream/{old}", headers=JSON, content=b'[{"n":0}]').status_code == 201
        assert client.put(f"/v1/stream/{explicit}", headers=JSON, content=b'[{"n":0}]').status_code == 201
        backfilled_at = client.head(f"/v1/stream/{old}").headers["stream-next-offset"]
        body = {
            "type": "webhook",
            "pattern": "events/*",
            "streams": [explicit],
            "webhook": {"url": receiver.url},
        }
        created = client.put(f"{CONTROL}subscriptions/{sub_id}", headers=JSON, json=body)
        assert created.status_code == 201, created.text
        view = created.json()
        # Existing streams of the other member are linked at their tails: nothing replayed.
        assert item(view, old) == {"path": old, "link_type": "glob", "acked_offset": backfilled_at}
        assert item(view, explicit)["link_type"] == "explicit"  # type: ignore[index]
        assert subscription_stats(cluster, "a")["subscriptions"] == 1
        assert subscription_stats(cluster, "b")["subscriptions"] == 0  # one keeper, routed there by HAProxy
        # One key for the cluster: each member's JWKS names the kid the subscription shows.
        jwks = {m: httpx.get(f"{cluster.direct(m)}{CONTROL}jwks.json", timeout=5).json() for m in ("a", "b")}
        assert jwks["a"] == jwks["b"] and jwks["a"]["keys"][0]["kid"] == view["webhook"]["signing"]["kid"]

        appended = client.post(f"/v1/stream/{old}", headers=JSON, content=b'[{"n":1}]')
        assert appended.status_code == 204
        wake = receiver.wake(1)
        raw, signature = receiver.calls[0]
        assert verifies(raw, signature, jwks["b"])  # signed by a, verified with b's JWKS
        linked = item(wake, old)
        assert linked is not None and linked["has_pending"] is True
        assert linked["tail_offset"] == appended.headers["stream-next-offset"]
        assert wake["callback_url"] == f"{cluster.front}{CONTROL}subscriptions/{sub_id}/callback"

        # The worker reads on and acks past the wake's snapshot: the keeper asks b for the tail.
        assert client.post(f"/v1/stream/{old}", headers=JSON, content=b'[{"n":2}]').status_code == 204
        newest = client.head(f"/v1/stream/{old}").headers["stream-next-offset"]
        ack = {"wake_id": wake["wake_id"], "generation": wake["generation"], "done": True,
               "acks": [{"stream": old, "offset": newest}]}  # fmt: skip
        token = {"Authorization": f"Bearer {wake['callback_token']}"}
        answered = client.post(wake["callback_url"], headers=token, json=ack)
        assert answered.status_code == 200, answered.text
        assert answered.json() == {"ok": True, "next_wake": False}
        assert client.post(wake["callback_url"], headers=token, json=ack).json()["error"]["code"] == "FENCED"
        assert item(client.get(f"{CONTROL}subscriptions/{sub_id}").json(), old)["acked_offset"] == newest  # type: ignore[index]

        # A matching stream created on b is linked at its start and wakes the subscription.
        assert client.put(f"/v1/stream/{new}", headers=JSON, content=b'[{"n":0}]').status_code == 201
        wake = receiver.wake(2)
        fresh = item(wake, new)
        assert fresh is not None and fresh["link_type"] == "glob" and fresh["has_pending"] is True
        assert fresh["acked_offset"].endswith("0" * 16)  # linked at its start: all of it is new
        assert item(wake, old)["has_pending"] is False  # type: ignore[index]
        # Deleting it on b drops the glob link on a; the explicit link stays through a deletion.
        assert client.delete(f"/v1/stream/{new}").status_code == 204
        assert client.delete(f"/v1/stream/{explicit}").status_code == 204
        wait_for(lambda: item(client.get(f"{CONTROL}subscriptions/{sub_id}").json(), new) is None)
        assert item(client.get(f"{CONTROL}subscriptions/{sub_id}").json(), explicit) is not None
        cluster_stats = subscription_stats(cluster, "b")["cluster"]
        assert cluster_stats["followed_for_members"] == {"a": 1}
        assert (
            cluster_stats["members"]["a"]["reported"] >= 4 and cluster_stats["members"]["a"]["failures"] == 0
        )


@SECRET_CLUSTER
def test_a_member_killed_with_a_report_pending_loses_no_wake(
    cluster: Cluster, hooks: Callable[[dict], Hooks]
) -> None:
    receiver = hooks({"done": True})
    path = named(cluster, "jobs/", "b")
    sub_id = sub_id_kept_by(cluster, "a")
    with httpx.Client(base_url=cluster.front, timeout=10) as client:
        body = {"type": "webhook", "pattern": "jobs/*", "webhook": {"url": receiver.url}}
        assert client.put(f"{CONTROL}subscriptions/{sub_id}", headers=JSON, json=body).status_code == 201
        assert client.put(f"/v1/stream/{path}", headers=JSON, content=b'[{"n":1}]').status_code == 201
        assert item(receiver.wake(1), path)["has_pending"] is True  # type: ignore[index]

        first_tail = item(receiver.wake(1), path)["tail_offset"]  # type: ignore[index]
        # Acked ({"done": true}) and saved: after a restart, only a new report can wake it again.
        wait_for(
            lambda: (
                item(client.get(f"{CONTROL}subscriptions/{sub_id}").json(), path)["acked_offset"]
                == first_tail
            )
        )  # type: ignore[index]

        # The keeper is down: b cannot report the append, and dies with it unreported.
        kill(cluster, "a")
        appended = client.post(f"/v1/stream/{path}", headers=JSON, content=b'[{"n":2}]')
        assert appended.status_code == 204
        wait_for(lambda: subscription_stats(cluster, "b")["cluster"]["members"]["a"]["failures"] > 0)
        # Meanwhile no subscription can be created on b: its glob would miss a's streams.
        refused = client.put(
            f"{CONTROL}subscriptions/{sub_id_kept_by(cluster, 'b')}", headers=JSON, json=body
        )
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "member_unavailable"
        kill(cluster, "b")
        assert len(receiver.calls) == 1
        cluster.start_member("a")
        cluster.start_member("b")
        wake = receiver.wake(2)  # b reports again after its restart
        assert item(wake, path)["tail_offset"] == appended.headers["stream-next-offset"]  # type: ignore[index]
        assert wake["generation"] > 1

        # And b knows of a's subscription again: later appends wake it too.
        wait_for(lambda: client.head(f"/v1/stream/{path}").status_code == 200)
        again = client.post(f"/v1/stream/{path}", headers=JSON, content=b'[{"n":3}]')
        assert again.status_code == 204
        wait_for(lambda: any(item(json.loads(raw), path)["tail_offset"] == again.headers["stream-next-offset"]  # type: ignore[index]
                             for raw, _ in receiver.calls))  # fmt: skip


@SECRET_CLUSTER
def test_control_requests_reach_the_member_that_keeps_the_subscription(cluster: Cluster) -> None:
    # An id percent-encoded so that HAProxy hashes it to the other member: that member hands it on.
    def elsewhere(i: str) -> bool:
        return (
            cluster.placement.owner_of_slot(slot("%73" + i[1:])).id
            != subscription_owner(cluster.placement, i).id
        )

    keeper_of = partial(subscription_owner, cluster.placement)
    # The webhook one (`<id>-w`) too, kept by the same member.
    sub_id = next(
        i for i in (f"s{n}" for n in range(2000))
        if elsewhere(i) and elsewhere(f"{i}-w") and keeper_of(i).id == keeper_of(f"{i}-w").id
    )  # fmt: skip
    keeper = subscription_owner(cluster.placement, sub_id).id
    other = "b" if keeper == "a" else "a"
    wake_stream = named(cluster, "wake/", other)
    with httpx.Client(base_url=cluster.front, timeout=10) as client:
        assert client.put(f"/v1/stream/{wake_stream}", headers=JSON, content=b"[]").status_code == 201
        body = {"type": "pull-wake", "pattern": "tasks/*", "wake_stream": wake_stream}
        created = client.put(f"{CONTROL}subscriptions/%73{sub_id[1:]}", headers=JSON, json=body)
        assert created.status_code == 201, created.text
        assert created.json()["id"] == sub_id
        assert subscription_stats(cluster, keeper)["subscriptions"] == 1
        assert subscription_stats(cluster, other)["subscriptions"] == 0
        assert subscription_stats(cluster, other)["cluster"]["forwarded_requests"] == 1
        # HAProxy sends the plain id straight to the keeper (its slot is ours): nothing forwarded.
        assert client.get(f"{CONTROL}subscriptions/{sub_id}").status_code == 200
        assert subscription_stats(cluster, keeper)["cluster"]["forwarded_requests"] == 0
        assert subscription_stats(cluster, other)["cluster"]["forwarded_requests"] == 1
        # Pull-wake: the wake event goes to the wake stream on the other member.
        task = named(cluster, "tasks/", other)
        assert client.put(f"/v1/stream/{task}", headers=JSON, content=b'[{"n":1}]').status_code == 201
        wait_for(
            lambda: any(
                e["subscription_id"] == sub_id
                for e in client.get(f"/v1/stream/{wake_stream}?offset=-1").json()
            )
        )
        claimed = client.post(f"{CONTROL}subscriptions/{sub_id}/claim", json={"worker": "w1"})
        assert claimed.status_code == 200 and item(claimed.json(), task)["has_pending"] is True  # type: ignore[index]
        lease = claimed.json()
        done = {"wake_id": lease["wake_id"], "generation": lease["generation"], "done": True,
                "acks": [{"stream": task, "offset": item(lease, task)["tail_offset"]}]}  # type: ignore[index]  # fmt: skip
        acked = client.post(f"{CONTROL}subscriptions/{sub_id}/ack", json=done,
                            headers={"Authorization": f"Bearer {lease['token']}"})  # fmt: skip
        assert acked.json() == {"ok": True, "next_wake": False}
        # Appended on the other member, then claimed at once: the claim finds it (read your writes),
        # whether or not the stream's member has reported the append yet.
        appended = client.post(f"/v1/stream/{task}", headers=JSON, content=b'[{"n":2}]')
        again = client.post(f"{CONTROL}subscriptions/{sub_id}/claim", json={"worker": "w1"})
        assert again.status_code == 200, again.text
        assert item(again.json(), task)["tail_offset"] == appended.headers["stream-next-offset"]  # type: ignore[index]
        # A forwarded creation keeps the client's Host: its URLs name the front door, not a member.
        hook = {"type": "webhook", "pattern": "nothing/*", "webhook": {"url": "http://127.0.0.1:9/hook"}}
        webhook = client.put(f"{CONTROL}subscriptions/%73{sub_id[1:]}-w", headers=JSON, json=hook)
        assert webhook.status_code == 201, webhook.text
        assert webhook.json()["webhook"]["signing"]["jwks_url"] == f"{cluster.front}{CONTROL}jwks.json"
        # Quoted ids keep working for every call, from either member directly too.
        for base in (cluster.direct(other), cluster.direct(keeper)):
            assert httpx.get(f"{base}{CONTROL}subscriptions/{quote(sub_id)}", timeout=5).status_code == 200


@SECRET_CLUSTER
def test_a_hung_member_costs_one_creation_5_s_then_creations_are_refused_at_once(cluster: Cluster) -> None:
    # SIGSTOP: b accepts connections and never answers. The creation that finds it out waits 5 s;
    # the next ones are refused at once (503, Retry-After) until b answers a probe again.
    hook = {"type": "webhook", "pattern": "jobs/*", "webhook": {"url": "http://127.0.0.1:9/hook"}}
    ids = iter(
        i for i in (f"hung-{n}" for n in range(500)) if subscription_owner(cluster.placement, i).id == "a"
    )
    b = cluster.members["b"].process
    with httpx.Client(base_url=cluster.direct("a"), timeout=20) as client:
        b.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            first = client.put(f"{CONTROL}subscriptions/{next(ids)}", headers=JSON, json=hook)
            assert first.status_code == 503 and first.headers["retry-after"] == "1"
            assert 4.5 < time.monotonic() - started < 8
            started = time.monotonic()
            again = client.put(f"{CONTROL}subscriptions/{next(ids)}", headers=JSON, json=hook)
            assert again.status_code == 503 and again.headers["retry-after"] == "1"
            assert again.json()["error"]["code"] == "member_unavailable"
            assert time.monotonic() - started < 1
            assert subscription_stats(cluster, "a")["cluster"]["members"]["b"]["down"] is not None
        finally:
            b.send_signal(signal.SIGCONT)
        wait_for(
            lambda: (
                client.put(f"{CONTROL}subscriptions/{next(ids)}", headers=JSON, json=hook).status_code == 201
            ),
            seconds=30,
        )
        assert subscription_stats(cluster, "a")["cluster"]["members"]["b"]["down"] is None
        assert subscription_stats(cluster, "a")["subscriptions"] == 1


def test_reports_and_subscriptions_overtaken_by_newer_words_are_dropped() -> None:
    placement = Placement.of([Member("a", "127.0.0.1:1"), Member("b", "127.0.0.1:2")], 1)
    path = next(f"s/{n}" for n in range(100) if placement.owner(f"s/{n}").id == "b")
    view = RemoteStreams(placement, "a", MemoryStorage(max_stream_bytes=1 << 20, max_total_bytes=1 << 20))
    assert view.unknown(path) and view.open(path) is None
    assert view.apply("b", (5, 2), path, [10, "0000000000000001", 0, 0])
    assert not view.apply("b", (5, 1), path, [4, "0000000000000001", 0, 0])  # read before: stale
    assert view.open(path).published_tail == 10
    assert not view.apply("a", (9, 9), path, None)  # only the stream's member speaks for it
    assert view.apply("b", (3, 1), path, None)  # a new process of b (whatever its clock says)
    assert view.open(path) is None and not view.unknown(path)  # gone, not unknown
    assert not view.apply("b", (5, 3), path, [12, "0000000000000001", 0, 0])  # its previous life, late
    assert view.names() == []

    interests = Interests()
    interests.update("a", (7, 1), "s1", Interest("s/*", None, []))
    interests.update("a", (7, 3), "s2", Interest(None, None, [path]))
    assert interests.members_for(path) == ("a",)
    interests.replace("a", (7, 2), {"s1": Interest("t/*", None, [])})  # a hello sent before s2 was made
    assert {i.pattern for i in interests.of("a")} == {"t/*", None}  # s2 is newer than it: kept
    interests.update("a", (7, 4), "s2", None)
    assert interests.members_for(path) == ()
    interests.update("a", (7, 3), "s2", Interest(None, None, [path]))  # a late word: the tombstone holds
    assert interests.members_for(path) == ()
    interests.replace("a", (8, 1), {})  # a restarted with no subscriptions
    assert interests.of("a") == []
