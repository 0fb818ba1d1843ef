"""Streams placed across single-writer processes behind a real HAProxy (issue 16, first part).

The placement is a pure function (stable, balanced, moving little when a member joins); the
generated HAProxy configuration is valid and routes every stream to its owner, because HAProxy's
`path,crc32,mod(4096)` and ours agree; a member refuses streams it does not own (no second
history); and a member killed with SIGKILL costs only its own streams, which answer 503 with
Retry-After until it is back with every acknowledged append.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ops.serverproc import ServerProcess, start
from streamkeep import cli
from streamkeep.cluster.forward import stamp_header
from streamkeep.cluster.placement import SLOTS, Member, Placement, canonical_path, slot

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"


def members(count: int) -> list[Member]:
    return [Member(chr(ord("a") + i), f"127.0.0.1:{7000 + i}") for i in range(count)]


def test_placement_is_stable_balanced_and_moves_only_to_a_new_member() -> None:
    two, three = Placement.of(members(2), 1), Placement.of(members(3), 2)
    assert Placement.of(members(2), 1).owners == two.owners  # a pure function of the list
    assert all(0.45 < two.slots_of(m.id) / SLOTS < 0.55 for m in two.members)
    moved = [s for s in range(SLOTS) if two.owner_of_slot(s).id != three.owner_of_slot(s).id]
    assert all(three.owner_of_slot(s).id == "c" for s in moved), "a join moves slots only to the newcomer"
    assert 0.28 < len(moved) / SLOTS < 0.39
    assert two.owner("a b/c").id == two.owner_of_slot(slot("/v1/stream/a%20b/c")).id
    assert canonical_path("a b/ü") == "/v1/stream/a%20b/%C3%BC"


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


class Cluster:
    def __init__(self, root: Path, secret: str = "") -> None:
        self.root = root
        self.secret = secret
        front, port_a, port_b = free_ports(3)
        self.front = f"http://127.0.0.1:{front}"
        self.ports = {"a": port_a, "b": port_b}
        self.toml = root / "cluster.toml"
        self.toml.write_text(
            "[cluster]\nepoch = 1\nmembers = ["
            f'{{id = "a", address = "127.0.0.1:{port_a}"}}, {{id = "b", address = "127.0.0.1:{port_b}"}}]\n'
        )
        self.placement = Placement.of(
            [Member("a", f"127.0.0.1:{port_a}"), Member("b", f"127.0.0.1:{port_b}")], 1
        )
        self.members: dict[str, ServerProcess] = {}
        assert cli.main(["cluster", "haproxy-config", "--config", str(self.toml), "--out", str(root / "lb"),
                         "--port", str(front)]) == 0  # fmt: skip
        self.haproxy: subprocess.Popen[bytes] | None = None

    def start_member(self, member: str) -> None:
        self.members[member] = start(
            "--config", str(self.toml), "--cluster-member", member, "--port", str(self.ports[member]),
            "--storage", "disk", "--data-dir", str(self.root / member), "--fsync", "always",
            "--log-level", "warning", "--allow-loopback-webhooks",  # the subscription tests' receivers
            *(["--cluster-secret", self.secret] if self.secret else []),
        )  # fmt: skip

    def start_haproxy(self) -> None:
        config = self.root / "lb" / "haproxy.cfg"
        assert subprocess.run([HAPROXY, "-c", "-q", "-f", str(config)]).returncode == 0
        self.haproxy = subprocess.Popen([HAPROXY, "-db", "-f", str(config)], stdout=subprocess.DEVNULL)
        wait_for(lambda: httpx.get(f"{self.front}/healthz", timeout=2).status_code == 200)

    def direct(self, member: str) -> str:
        return f"http://127.0.0.1:{self.ports[member]}"

    def stop(self) -> None:
        if self.haproxy is not None:
            self.haproxy.send_signal(signal.SIGTERM)
            self.haproxy.wait(10)
        for server in self.members.values():
            server.stop()


def wait_for(check: object, seconds: float = 15) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if check():  # type: ignore[operator]
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.1)


def test_streams_land_on_their_owners_and_a_killed_member_costs_only_its_own(cluster: Cluster) -> None:
    names = [f"orders/{i}" for i in range(40)]
    owners = {name: cluster.placement.owner(name).id for name in names}
    assert set(owners.values()) == {"a", "b"}
    config = (cluster.root / "lb" / "haproxy.cfg").read_text()
    # No redispatch (a second history), and live writes not held back ~200 ms (torture finding C1).
    assert "\n    no option redispatch\n" in config and "\n    option http-no-delay\n" in config
    with httpx.Client(timeout=10) as h1, httpx.Client(http1=False, http2=True, timeout=10) as h2c:
        for name in names:
            created = h1.put(f"{cluster.front}/v1/stream/{name}", headers={"Content-Type": "text/plain"})
            assert created.status_code == 201, (name, created.text)
            for n in range(5):  # acknowledged appends, over both protocols through the front door
                client = h2c if n % 2 else h1
                appended = client.post(f"{cluster.front}/v1/stream/{name}", content=b"%d," % n,
                                       headers={"Content-Type": "text/plain"})  # fmt: skip
                assert appended.status_code == 204, appended.text
        for name, owner in owners.items():
            other = "b" if owner == "a" else "a"
            assert h1.get(f"{cluster.direct(owner)}/v1/stream/{name}?offset=-1").content == b"0,1,2,3,4,"
            refused = h1.get(f"{cluster.direct(other)}/v1/stream/{name}?offset=-1")
            assert refused.status_code == 421 and refused.headers["streamkeep-owner"] == owner
            assert refused.json()["error"]["code"] == "not_owner"
        # A stale placement epoch is refused, never served.
        stale = h1.get(
            f"{cluster.direct('a')}/v1/stream/{names[0]}", headers={"Streamkeep-Placement-Epoch": "7"}
        )
        assert stale.status_code == 503 and stale.headers["retry-after"] == "1"

        cluster.members["b"].process.kill()  # SIGKILL: no shutdown, no flush
        cluster.members["b"].process.wait()
        b_streams = [name for name, owner in owners.items() if owner == "b"]
        a_streams = [name for name, owner in owners.items() if owner == "a"]
        wait_for(lambda: h1.get(f"{cluster.front}/v1/stream/{b_streams[0]}").status_code == 503)
        for name in b_streams:
            down = h1.post(
                f"{cluster.front}/v1/stream/{name}", content=b"x", headers={"Content-Type": "text/plain"}
            )
            assert down.status_code == 503 and down.headers["retry-after"] == "1"
            assert down.json()["error"]["code"] == "owner_unavailable"
        for name in a_streams:  # the other member never noticed
            up = h1.post(
                f"{cluster.front}/v1/stream/{name}", content=b"5,", headers={"Content-Type": "text/plain"}
            )
            assert up.status_code == 204

        cluster.start_member("b")  # the same data directory
        wait_for(lambda: h1.head(f"{cluster.front}/v1/stream/{b_streams[0]}").status_code == 200)
        for name in b_streams:
            assert h1.get(f"{cluster.front}/v1/stream/{name}?offset=-1").content == b"0,1,2,3,4,"
        for name in a_streams:
            assert h1.get(f"{cluster.front}/v1/stream/{name}?offset=-1").content == b"0,1,2,3,4,5,"


@pytest.mark.parametrize(
    ("toml", "member", "says"),
    [
        (
            '[cluster]\nmembers = [{id = "a", address = "127.0.0.1:1"}]\n',
            "z",
            "not one of the [cluster] members",
        ),
        ('[cluster]\nmembers = [{id = "a", address = "nohost"}]\n', "a", "address must be host:port"),
        (
            '[cluster]\nmembers = [{id = "a", address = "h:1"}, {id = "a", address = "h:2"}]\n',
            "a",
            "listed twice",
        ),
        ("[cluster]\nmembers = []\n", "a", "must be a list"),
        ('[cluster]\nmembers = [{id = "a b", address = "h:1"}]\n', "a b", "use letters, digits"),
        ('[cluster]\nsecret = "short"\nmembers = [{id = "a", address = "h:1"}]\n', "a", "at least 32 bytes"),
    ],
)
def test_a_bad_cluster_section_is_refused_with_what_to_fix(
    tmp_path: Path, toml: str, member: str, says: str
) -> None:
    from streamkeep import config

    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(config.ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        config.load(str(path), cli={"cluster_member": member})


def test_cluster_run_starts_members_and_haproxy_over_h1_h2c_and_tls_and_stops_them_all(
    tmp_path: Path,
) -> None:
    from ops.serverproc import launch
    from tests.conftest import make_certificates

    (tmp_path / "tls").mkdir()
    ca, cert, key = make_certificates(tmp_path / "tls")
    data = tmp_path / "cluster"
    front = free_ports(1)[0]
    command = [sys.executable, "-m", "streamkeep", "cluster", "run", "--processes", "2", "--port", str(front),
               "--data-dir", str(data), "--tls-cert", str(cert), "--tls-key", str(key),
               "--storage", "memory", "--log-level", "warning"]  # fmt: skip
    runner = launch(command, timeout=60)
    try:
        assert runner.url == f"https://127.0.0.1:{front}"
        placement = Placement.of([Member("m0", "x:1"), Member("m1", "x:1")], 1)
        names = [f"run/{i}" for i in range(12)]
        assert {placement.owner(name).id for name in names} == {"m0", "m1"}
        with httpx.Client(verify=str(ca), http2=True, timeout=10) as h2:
            for name in names:
                created = h2.put(f"{runner.url}/v1/stream/{name}", headers={"Content-Type": "text/plain"})
                assert created.status_code == 201
                assert created.headers["location"] == f"{runner.url}/v1/stream/{name}"  # the client's scheme
                answer = h2.post(
                    f"{runner.url}/v1/stream/{name}", content=b"hi", headers={"Content-Type": "text/plain"}
                )
                assert (
                    answer.status_code == 204 and answer.http_version == "HTTP/2"
                )  # ALPN h2 at the front door
                assert h2.get(f"{runner.url}/v1/stream/{name}?offset=-1").content == b"hi"
        members = {
            line.split()[1]: line.split()[3].rstrip(":")
            for line in runner.output
            if line.startswith("member m")
        }
        assert set(members) == {"m0", "m1"}
        secret = (data / "cluster.secret").read_text().strip()
        for member, url in members.items():  # each process holds exactly the streams it owns
            other = "m1" if member == "m0" else "m0"  # as a member asks: its own list, not the cluster's
            target = "/v1/admin/streams?match=run/**"
            signed = {"Streamkeep-Forwarded": stamp_header(secret, other, "GET", target)}
            listed = httpx.get(f"{url}{target}", headers=signed).json()["streams"]
            assert sorted(row["name"] for row in listed) == sorted(
                n for n in names if placement.owner(n).id == member
            )
            for name in names:  # and hands the others to their owner (cluster run gives a secret)
                assert httpx.get(f"{url}/v1/stream/{name}?offset=-1").content == b"hi"
    finally:
        runner.stop(signal.SIGTERM)
    assert runner.process.returncode == 0
    for url in members.values():  # every child stopped with it
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/healthz", timeout=2)
    again = subprocess.run([sys.executable, "-m", "streamkeep", "cluster", "run", "--processes", "3",
                            "--data-dir", str(data)], capture_output=True, text=True, timeout=30)  # fmt: skip
    assert again.returncode == 2 and "run it with --processes 2" in again.stderr


SECRET = "a-cluster-secret-for-the-tests-0123456789"


@pytest.mark.parametrize("cluster", [SECRET], ids=["secret"], indirect=True)
def test_a_member_forwards_streams_it_does_not_own_and_guards_against_loops(cluster: Cluster) -> None:
    names = [f"fw/{i}" for i in range(16)]
    on_b = [name for name in names if cluster.placement.owner(name).id == "b"]
    assert on_b
    name = on_b[0]
    a, b = cluster.direct("a"), cluster.direct("b")
    text = {"Content-Type": "text/plain"}
    with httpx.Client(timeout=10) as h1, httpx.Client(http1=False, http2=True, timeout=10) as h2c:
        assert h1.put(f"{a}/v1/stream/{name}", headers=text).status_code == 201  # sent to a, made on b
        assert h1.head(f"{b}/v1/stream/{name}").status_code == 200
        assert h2c.post(f"{a}/v1/stream/{name}", content=b"one,", headers=text).status_code == 204
        assert h1.post(f"{a}/v1/stream/{name}", content=b"two,", headers=text).status_code == 204
        read = h1.get(f"{a}/v1/stream/{name}?offset=-1")
        assert read.content == b"one,two," and len(read.headers.get_list("access-control-allow-origin")) == 1
        tail = read.headers["stream-next-offset"]
        with h1.stream("GET", f"{a}/v1/stream/{name}?offset=-1&live=sse") as events:  # relayed as it comes
            lines = events.iter_lines()
            assert any("one,two," in line for line in (next(lines) for _ in range(4)))
        with trio_free_long_poll(h1, f"{a}/v1/stream/{name}?offset={tail}&live=long-poll") as waiting:
            time.sleep(0.3)
            assert h1.post(f"{b}/v1/stream/{name}", content=b"three,", headers=text).status_code == 204
            assert waiting.result(10).content == b"three,"
        # A target httpx would encode differently ("{" sent raw) is signed as it is sent.
        odd_name = next(n for n in (f"fw/{{{i}}}" for i in range(64)) if cluster.placement.owner(n).id == "b")
        raw = http.client.HTTPConnection("127.0.0.1", cluster.ports["a"], timeout=10)
        raw.request("PUT", f"/v1/stream/{odd_name}", headers=text)
        assert raw.getresponse().status == 201
        raw.close()
        assert h1.head(f"{b}/v1/stream/{odd_name}").status_code == 200
        # Names sent percent-encoded another way hash to another slot at HAProxy; members hand on.
        for other in names:
            odd = "%" + other.encode()[0:1].hex().upper() + other[1:]  # "%66w/3" for "fw/3"
            created = h1.put(f"{cluster.front}/v1/stream/{odd}", headers=text)
            assert created.status_code == (200 if other == name else 201), (odd, created.text)
            if created.status_code == 201:  # made by the owner, named as the client reached it
                assert created.headers["location"] == f"{cluster.front}/v1/stream/{odd}"
            assert (
                h1.head(f"{cluster.direct(cluster.placement.owner(other).id)}/v1/stream/{other}").status_code
                == 200
            )
        # Only members may claim to be one, and a forwarded request never travels twice.
        fake = h1.get(f"{b}/v1/stream/{name}", headers={"Streamkeep-Forwarded": "a 1 00"})
        assert fake.status_code == 403 and fake.json()["error"]["code"] == "bad_cluster_signature"
        target = f"/v1/stream/{name}"
        looped = h1.get(
            f"{a}{target}", headers={"Streamkeep-Forwarded": stamp_header(SECRET, "b", "GET", target)}
        )
        assert looped.status_code == 503 and looped.json()["error"]["code"] == "stale_placement"
        stats = h1.get(f"{a}/stats").json()["cluster"]
        assert stats["member"] == "a" and stats["epoch"] == 1 and stats["forwarding"]
        assert stats["forwarded_requests"] >= 8 and set(stats["members"]) == {"a", "b"}
        metrics = h1.get(f"{a}/metrics").text
        assert f"streamkeep_cluster_forwarded_requests_total {float(stats['forwarded_requests'])}" in metrics
        # The cluster view: every member's own /stats side by side, from any member or the front door.
        whole = h1.get(f"{cluster.front}/stats?cluster=1").json()
        assert whole["reachable"] == 2 and set(whole["members"]) == {"a", "b"}
        own = {member: h1.get(f"{cluster.direct(member)}/stats").json()["streams"] for member in ("a", "b")}
        assert {m: v["streams"] for m, v in whole["members"].items()} == own
        assert whole["totals"]["streams"] == own["a"] + own["b"]
        cluster.members["b"].stop()
        partial = h1.get(f"{a}/stats?cluster=1").json()
        assert partial["reachable"] == 1 and partial["members"]["b"]["error"].startswith("unreachable")


class trio_free_long_poll:
    """A long-poll GET in a thread, so the test can append while it waits."""

    def __init__(self, client: httpx.Client, url: str) -> None:
        import concurrent.futures

        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.future = self.pool.submit(client.get, url)

    def __enter__(self) -> concurrent.futures.Future[httpx.Response]:
        return self.future

    def __exit__(self, *_: object) -> None:
        self.pool.shutdown(wait=True)


def test_a_forwarded_header_verifies_only_for_a_member_with_the_secret_the_target_and_the_time() -> None:
    from streamkeep.cluster.forward import forwarded_by, stamp_header
    from streamkeep.protocol.errors import ProtocolError
    from streamkeep.protocol.model import Headers, Request

    roster = (Member("a", "h:1"), Member("b", "h:2"))
    now = 1_800_000_000.0

    def request(header: str, target: str = "/v1/stream/x") -> Request:
        return Request("GET", target, headers=Headers([("Streamkeep-Forwarded", header)]))

    good = stamp_header(SECRET, "a", "GET", "/v1/stream/x", now)
    assert forwarded_by(request(good), SECRET, roster, now) == "a"
    assert forwarded_by(Request("GET", "/v1/stream/x"), SECRET, roster, now) is None
    refused = [
        (request(good), "other-secret-other-secret-other-secret!", now),  # another cluster's secret
        (request(good, "/v1/stream/y"), SECRET, now),  # replayed on another target
        (request(good), SECRET, now + 120),  # too old
        (request(stamp_header(SECRET, "z", "GET", "/v1/stream/x", now)), SECRET, now),  # not a member
        (request("a 1 2 3"), SECRET, now),
        (request(good), "", now),  # this member has no secret: it trusts no one
        (request(f"a {int(now)} " + "é" * 64), SECRET, now),  # not hex: refused, never a 500
    ]
    for candidate, secret, at in refused:
        with pytest.raises(ProtocolError) as error:
            forwarded_by(candidate, secret, roster, at)
        assert error.value.status == 403


async def test_an_actor_that_was_handed_a_message_does_not_hibernate() -> None:
    """Found in review: a message sent to an actor waiting on its mailbox goes straight to the
    actor and sits in no buffer; the hibernation sweep must still see it (or a second actor would
    start and run appends directly while the first still handles that message)."""
    import trio

    from streamkeep.actors.mailbox import Envelope, Reply
    from streamkeep.actors.messages import HEAD, Create
    from streamkeep.actors.stream_ops import StreamOps
    from streamkeep.actors.supervisor import Supervisor
    from streamkeep.protocol.model import Headers
    from streamkeep.protocol.stream import CreateSpec
    from streamkeep.storage.memory import MemoryStorage

    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(MemoryStorage(max_stream_bytes=1 << 20, max_total_bytes=1 << 20), nursery)
        spec = CreateSpec.from_request(Headers([("Content-Type", "text/plain")]), b"")
        await supervisor.call("s", Create(spec), must_exist=False)
        actor = supervisor.actor("s", must_exist=True)
        await trio.testing.wait_all_tasks_blocked()  # the actor waits on its mailbox
        actor._queued += 1  # what StreamActor.call does before its send, which hands it over
        actor._send.send_nowait(Envelope(StreamOps.head, HEAD, Reply()))
        assert actor._receive.statistics().current_buffer_used == 0
        assert not actor.hibernate_if_idle(trio.current_time() + 3600)
        assert supervisor.actor("s", must_exist=True) is actor
        nursery.cancel_scope.cancel()


def test_live_reads_hold_no_slot_of_a_members_capped_backend(tmp_path: Path) -> None:
    """HAProxy lets at most `--member-maxconn` requests at a member (issue 26: without a cap, appends
    waited seconds); long-polls and SSE go to a backend of their own, uncapped. Here the cap is 2
    and 4 long-polls wait on one member: were they capped, they would hold both slots and the
    append that ends them would wait in HAProxy's queue until it answered 503 after 5 s."""
    built = Cluster(tmp_path, "")
    assert cli.main(["cluster", "haproxy-config", "--config", str(built.toml), "--out", str(tmp_path / "lb"),
                     "--port", built.front.rsplit(":", 1)[1], "--member-maxconn", "2"]) == 0  # fmt: skip
    config = (tmp_path / "lb" / "haproxy.cfg").read_text()
    assert (
        "maxconn 2 check" in config
        and "_live if { path_beg /v1/stream/ } { url_param(live) -m found }" in config
    )
    try:
        built.start_member("a")
        built.start_member("b")
        built.start_haproxy()
        name = "capped/live"
        url = f"{built.front}/v1/stream/{name}"
        text = {"Content-Type": "text/plain"}
        assert httpx.put(url, headers=text, timeout=10).status_code == 201
        tail = httpx.head(url, timeout=10).headers["stream-next-offset"]

        def long_poll() -> tuple[int, bytes]:
            answer = httpx.get(f"{url}?offset={tail}&live=long-poll", timeout=20)
            return answer.status_code, answer.content

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            polls = [pool.submit(long_poll) for _ in range(4)]
            owner = built.placement.owner(name).id
            wait_for(lambda: live_readers(built.direct(owner)) >= 4)
            appended = httpx.post(url, content=b"wake", headers=text, timeout=4)
            assert appended.status_code == 204, appended.text
            assert [poll.result(timeout=15) for poll in polls] == [(200, b"wake")] * 4
    finally:
        built.stop()


def live_readers(member_url: str) -> int:
    return int(httpx.get(f"{member_url}/stats", timeout=5).json()["live_readers"])
