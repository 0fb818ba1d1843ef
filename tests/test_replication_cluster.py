"""Losing a machine loses nothing: a replicated cluster (`cluster run --processes 2 --replicas 2`,
a 3-member etcd) under load, through its front door, while one machine is lost with its disk, an
owner is paused (SIGSTOP: fencing), and a machine is cut off by a partition (iptables).

What each fault must leave true:
- every acknowledged append is in its stream exactly once, in order; an append answered 503 never
  appears (the error contract); one whose answer was lost (timeout, dropped connection) appears at
  most once, and an idempotent producer's retries of it never twice;
- the lost member's streams answer appends again within 10 s, with no operator step;
- afterwards every member has an in-sync follower again, whose data directory is byte for byte the
  owner's.

Machines as `cluster run` lays them out: machine k runs m{k}a and m{k-1}b, on a loopback address of its own.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from ops.serverproc import ServerProcess, launch
from streamkeep.cluster.placement import Member, Placement
from streamkeep.cluster.run import free_port
from streamkeep.coordination.local_etcd import LocalEtcd
from tests.test_replication_mirror import tree

MEMBERS = ["m0", "m1"]
PLACEMENT = Placement.of([Member(m, "") for m in MEMBERS], 1)
FAILOVER_LIMIT = 10.0
BODY_PAD = b"x" * 200


def machine_replicas(machine: int) -> list[str]:
    return [f"m{machine}a", f"m{(machine - 1) % len(MEMBERS)}b"]


def pid_of(directory: Path, replica: str) -> int | None:
    """The replica's process, known by its data directory (other clusters may run on this machine)."""
    found = subprocess.run(
        ["pgrep", "-f", "--", f"--data-dir {directory / replica}$"], capture_output=True, text=True
    )
    pids = [int(p) for p in found.stdout.split()]
    return pids[0] if pids else None


@dataclass
class Cluster:
    directory: Path
    etcd: LocalEtcd
    server: ServerProcess

    @property
    def url(self) -> str:
        return self.server.url

    def pid(self, replica: str) -> int | None:
        return pid_of(self.directory, replica)

    def stats(self, member: str) -> dict:
        """The replication section of the member's owner (through the front door's peer route)."""
        with httpx.Client(timeout=3) as client:
            views = client.get(f"{self.url}/stats?cluster=1").json()["members"]
        return views.get(member, {}).get("replication", {})

    def wait_redundant(self, seconds: float = 60) -> dict[str, dict]:
        """Until every member's owner has an in-sync follower (and says so)."""
        deadline = time.monotonic() + seconds
        last: dict[str, dict] = {}
        while time.monotonic() < deadline:
            try:
                last = {member: self.stats(member) for member in MEMBERS}
            except (httpx.HTTPError, KeyError, ValueError):
                time.sleep(0.3)
                continue
            if all(view.get("follower_in_sync") for view in last.values()):
                return last
            time.sleep(0.3)
        raise AssertionError(f"redundancy not back within {seconds} s: {last}\n{self.tail()}")

    def tail(self) -> str:
        return "".join(self.server.output[-60:])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("replicated")
    etcd = LocalEtcd(directory / "etcd", members=3)
    etcd.start()
    command = [
        sys.executable, "-m", "streamkeep", "cluster", "run", "--processes", "2", "--replicas", "2",
        "--port", str(free_port("127.0.0.1")), "--data-dir", str(directory / "cluster"),
        "--etcd", ",".join(etcd.endpoints), "--fsync", "always", "--no-ui",
    ]  # fmt: skip
    server = launch(command, timeout=90)
    built = Cluster(directory / "cluster", etcd, server)
    try:
        built.wait_redundant()
        yield built
    finally:
        server.stop()
        etcd.stop()
        (directory / "cluster.log").write_text("".join(server.output))
        print(f"the cluster's output: {directory / 'cluster.log'}")
        for replica in ("m0a", "m0b", "m1a", "m1b"):
            pid = built.pid(replica)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)


@dataclass
class Writer:
    """Appends to its streams until told to stop, following the protocol: a 503 is retried (it
    stored nothing), a lost answer is retried with the same producer seq by a producer and is a
    maybe for a plain append."""

    url: str
    names: list[str]
    producer: bool
    acked: dict[str, list[bytes]] = field(default_factory=dict)
    maybe: dict[str, set[bytes]] = field(default_factory=dict)
    refused: dict[str, set[bytes]] = field(default_factory=dict)
    first_ok_after: dict[str, float] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[str] = field(default_factory=list)

    def run(self) -> None:
        client = httpx.Client(timeout=5.0)
        for name in self.names:
            self.acked[name], self.maybe[name], self.refused[name] = [], set(), set()
            while True:
                try:
                    answer = client.put(
                        f"{self.url}/v1/stream/{name}", headers={"Content-Type": "text/plain"}
                    )
                except httpx.HTTPError:
                    time.sleep(0.05)
                    continue
                if answer.status_code in (200, 201):
                    break
                time.sleep(0.05)
        sequence = 0
        while not self.stop.is_set():
            for name in self.names:
                body = b"%s:%d;" % (name.encode(), sequence) + BODY_PAD
                self._append(client, name, body, sequence)
            sequence += 1
        client.close()

    def _append(self, client: httpx.Client, name: str, body: bytes, sequence: int) -> None:
        headers = {"Content-Type": "text/plain"}
        if self.producer:
            headers |= {"Producer-Id": "writer", "Producer-Epoch": "0", "Producer-Seq": str(sequence)}
        while not self.stop.is_set():
            try:
                answer = client.post(f"{self.url}/v1/stream/{name}", content=body, headers=headers)
                if answer.status_code in (502, 504):  # HAProxy: the member died mid-request
                    raise httpx.RemoteProtocolError(f"{answer.status_code} from the front door")
            except httpx.HTTPError:
                if not self.producer:
                    self.maybe[name].add(body)  # may be stored: never send this body again
                    return
                time.sleep(0.05)
                continue  # a producer retries the same seq: exactly once either way
            if answer.status_code in (200, 204):
                self.acked[name].append(body)
                self.first_ok_after.setdefault(name, time.monotonic())
                return
            if answer.status_code == 503:
                self.refused[name].add(body)  # stored nothing, says the contract: retried
                time.sleep(0.05)
                continue
            self.errors.append(f"{name}: {answer.status_code} {answer.text[:200]}")
            return


class Load:
    def __init__(self, url: str, tag: str, streams: int = 16) -> None:
        names = [f"{tag}-{i}" for i in range(streams)]
        self.writers = [
            Writer(url, names[i::4], producer=i % 2 == 0) for i in range(4)
        ]  # half the streams written by idempotent producers
        self.threads = [threading.Thread(target=w.run, daemon=True) for w in self.writers]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        for writer in self.writers:
            writer.stop.set()
        for thread in self.threads:
            thread.join(30)

    def streams_of(self, member: str) -> list[str]:
        return [n for w in self.writers for n in w.names if PLACEMENT.owner(n).id == member]

    def restart_clock(self) -> float:
        for writer in self.writers:
            writer.first_ok_after.clear()
        return time.monotonic()

    def wait_count(self, appends: int, seconds: float = 30) -> None:
        deadline = time.monotonic() + seconds
        while sum(len(a) for w in self.writers for a in w.acked.values()) < appends:
            assert time.monotonic() < deadline, "the load did not get going"
            time.sleep(0.05)

    def failover_seconds(self, member: str, since: float, seconds: float = 30) -> float:
        """Until every stream of `member` took an append after `since`."""
        names = self.streams_of(member)
        deadline = since + seconds
        while time.monotonic() < deadline:
            firsts = [w.first_ok_after.get(n) for w in self.writers for n in w.names if n in names]
            if all(first is not None for first in firsts):
                return max(first for first in firsts if first is not None) - since
            time.sleep(0.05)
        missing = [n for w in self.writers for n in w.names if n in names and n not in w.first_ok_after]
        raise AssertionError(f"member {member}'s streams {missing} did not take appends within {seconds} s")

    def never_failed(self, member: str) -> None:
        """No append to `member`'s streams was refused or left without an answer."""
        for writer in self.writers:
            for name in writer.names:
                if PLACEMENT.owner(name).id == member:
                    assert not writer.refused[name] and not writer.maybe[name], (
                        f"{name} on {member} saw errors: {len(writer.refused[name])} refused, "
                        f"{len(writer.maybe[name])} unanswered"
                    )

    def check(self, url: str) -> None:
        with httpx.Client(timeout=10) as client:
            for writer in self.writers:
                assert not writer.errors, writer.errors
                for name in writer.names:
                    read = client.get(f"{url}/v1/stream/{name}?offset=-1")
                    assert read.status_code == 200, (name, read.status_code, read.text)
                    check_history(name, read.content, writer)


def check_history(name: str, content: bytes, writer: Writer) -> None:
    messages = [m + BODY_PAD for m in content.split(BODY_PAD) if m]
    assert b"".join(messages) == content, f"{name}: bytes that no client sent"
    acked, maybe, refused = writer.acked[name], writer.maybe[name], writer.refused[name]
    assert len(messages) == len(set(messages)), f"{name}: an append appears twice"
    assert not (set(messages) & (refused - set(acked))), f"{name}: an append answered 503 was stored"
    assert set(acked) <= set(messages), (
        f"{name}: acknowledged appends lost: {sorted(set(acked) - set(messages))[:3]}"
    )
    assert set(messages) <= set(acked) | maybe, f"{name}: appends nobody sent"
    in_order = [m for m in messages if m in set(acked)]
    assert in_order == acked, f"{name}: acknowledged appends out of order"


def owner_and_follower_equal(cluster: Cluster, member: str) -> None:
    """Once quiet, the follower's directory is byte for byte the owner's."""
    deadline = time.monotonic() + 20
    first, second = cluster.directory / f"{member}a", cluster.directory / f"{member}b"
    while True:
        try:
            if tree(first) == tree(second):
                return
        except FileNotFoundError:
            pass  # a file went between listing and reading: the directory is still changing
        if time.monotonic() > deadline:
            one, two = tree(first), tree(second)
            differ = sorted(k for k in set(one) | set(two) if one.get(k) != two.get(k))
            raise AssertionError(f"{member}: the copies differ in {differ[:10]}")
        time.sleep(0.5)


def test_losing_a_machine_and_its_disk_loses_nothing(cluster: Cluster) -> None:
    with Load(cluster.url, "disk-loss") as load:
        load.wait_count(200)
        lost = machine_replicas(1)  # m1a (m1's owner) and m0b (m0's follower)
        for replica in lost:
            pid = cluster.pid(replica)
            assert pid is not None, replica
            os.kill(pid, signal.SIGKILL)
        since = load.restart_clock()
        for replica in lost:  # the machine's disk is gone too
            shutil.rmtree(cluster.directory / replica)
        took = load.failover_seconds("m1", since)
        load.failover_seconds("m0", since)  # the other member never stopped
        load.wait_count(sum(len(a) for w in load.writers for a in w.acked.values()) + 100)
    print(f"machine lost: m1's streams took appends again after {took:.2f} s")
    assert took <= FAILOVER_LIMIT, f"m1's streams answered appends after {took:.1f} s"
    load.never_failed("m0")  # its follower died with the machine: it went on alone, unseen
    views = cluster.wait_redundant()
    assert views["m1"]["replica"] == "m1b" and views["m1"]["epoch"] >= 2, views
    load.check(cluster.url)
    for member in MEMBERS:
        owner_and_follower_equal(cluster, member)


def test_a_paused_owner_is_fenced_and_rejoins_as_follower(cluster: Cluster) -> None:
    owner = cluster.stats("m0")["replica"]
    epoch = cluster.stats("m0")["epoch"]
    pid = cluster.pid(owner)
    assert pid is not None
    with Load(cluster.url, "pause") as load:
        load.wait_count(100)
        os.kill(pid, signal.SIGSTOP)
        since = load.restart_clock()
        try:
            took = load.failover_seconds("m0", since)
            load.wait_count(sum(len(a) for w in load.writers for a in w.acked.values()) + 50)
        finally:
            os.kill(pid, signal.SIGCONT)
        # Woken, it finds another owner at a newer epoch and exits instead of acknowledging.
        deadline = time.monotonic() + 15
        while cluster.pid(owner) == pid and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cluster.pid(owner) != pid, "the paused owner did not fence itself"
        load.wait_count(sum(len(a) for w in load.writers for a in w.acked.values()) + 50)
    print(f"owner paused: m0's streams took appends again after {took:.2f} s")
    assert took <= FAILOVER_LIMIT, f"m0's streams answered appends after {took:.1f} s"
    views = cluster.wait_redundant()
    assert views["m0"]["replica"] != owner and views["m0"]["epoch"] > epoch, views
    assert any("fenced" in line for line in cluster.server.output), "no fencing was reported"
    load.check(cluster.url)


def iptables(*rule: str) -> None:
    subprocess.run(["iptables", *rule], check=True, capture_output=True)


def test_a_partitioned_owner_is_replaced_and_nothing_is_lost(cluster: Cluster) -> None:
    view = cluster.stats("m1")
    owner, address = view["replica"], view["address"].rsplit(":", 1)[0]  # its machine's own address
    rules = [("INPUT", "-s", address), ("INPUT", "-d", address)]
    with Load(cluster.url, "partition") as load:
        load.wait_count(100)
        for chain, flag, where in rules:
            iptables("-I", chain, flag, where, "-j", "DROP", "-m", "comment", "--comment", "streamkeep-test")
        since = load.restart_clock()
        try:
            took = load.failover_seconds("m1", since)
            load.wait_count(sum(len(a) for w in load.writers for a in w.acked.values()) + 50)
        finally:
            for chain, flag, where in rules:
                iptables(
                    "-D", chain, flag, where, "-j", "DROP", "-m", "comment", "--comment", "streamkeep-test"
                )
        load.wait_count(sum(len(a) for w in load.writers for a in w.acked.values()) + 50)
    print(f"owner cut off: m1's streams took appends again after {took:.2f} s")
    assert took <= FAILOVER_LIMIT, f"m1's streams answered appends after {took:.1f} s"
    views = cluster.wait_redundant(90)
    assert views["m1"]["replica"] != owner, views
    load.check(cluster.url)


def test_losing_an_etcd_member_is_unseen(cluster: Cluster) -> None:
    before = {member: cluster.stats(member) for member in MEMBERS}
    leader_first = 0  # members' clients start on the first endpoint
    with Load(cluster.url, "etcd-loss") as load:
        load.wait_count(100)
        cluster.etcd.kill(leader_first)
        try:
            time.sleep(6)  # two lease lifetimes
            load.wait_count(sum(len(a) for w in load.writers for a in w.acked.values()) + 100)
        finally:
            cluster.etcd.restart(leader_first)
    for member in MEMBERS:
        load.never_failed(member)
    after = {member: cluster.stats(member) for member in MEMBERS}
    for member in MEMBERS:  # no failover: nobody's lease lapsed
        assert (after[member]["replica"], after[member]["epoch"]) == (
            before[member]["replica"],
            before[member]["epoch"],
        ), (before, after)
    load.check(cluster.url)


def test_an_owner_back_beside_a_follower_that_lost_its_disk_keeps_serving_its_copy(cluster: Cluster) -> None:
    """Both replicas of a member die at once and the follower's disk is gone with it (torture,
    seed 300: a machine lost with its disk while the other copy's process was killed). The owner
    must not hand the member to the empty follower, whose process runs again: it serves its copy."""
    views = cluster.wait_redundant()
    owner = views["m0"]["replica"]
    follower = "m0b" if owner == "m0a" else "m0a"
    with Load(cluster.url, "both-down") as load:
        load.wait_count(100)
        supervisor = cluster.server.process.pid
        os.kill(supervisor, signal.SIGSTOP)  # it restarts nothing until the disk is gone
        try:
            for replica in (owner, follower):  # the owner first: etcd still records the copy in sync
                pid = cluster.pid(replica)
                assert pid is not None, replica
                os.kill(pid, signal.SIGKILL)
                while cluster.pid(replica) == pid:
                    time.sleep(0.01)
            since = load.restart_clock()
            shutil.rmtree(cluster.directory / follower)
        finally:
            os.kill(supervisor, signal.SIGCONT)
        took = load.failover_seconds("m0", since)
        load.wait_count(sum(len(a) for w in load.writers for a in w.acked.values()) + 100)
    print(f"owner and emptied follower killed: m0's streams took appends again after {took:.2f} s")
    assert took <= 2 * FAILOVER_LIMIT, f"m0's streams answered appends after {took:.1f} s"
    views = cluster.wait_redundant()
    assert views["m0"]["replica"] == owner, views  # the only copy kept the member
    load.check(cluster.url)
    owner_and_follower_equal(cluster, "m0")
