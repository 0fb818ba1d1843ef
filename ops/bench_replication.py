"""What replication costs and how fast it heals, through the front door (issue 23, point 8).

    python -m ops.bench_replication [--rounds 3] [--seconds 4] [--failovers 3] [--fill-mib 1024]
                                    [--streams 100000] [--parts throughput,pinned,failover,redundancy,many]

Every part runs `streamkeep cluster run --processes 2` (HAProxy in front, etcd started by it) on
this machine, a fresh cluster each time, data under a temporary directory on the data disk:

1. throughput: `--replicas 1` and `--replicas 2` in alternating rounds, `--storage disk --fsync
   always`; h2load with 16 HTTP/1.1 connections appending 100 B to 16 streams of their own (spread
   over both members), then one connection appending 100 B sequentially (latency p50/p99, h2load's
   per-request log), over two streams, one on each member. A replicated cluster is measured only
   once both owners report their follower in sync. Medians of the rounds and their ratio.
1b. pinned: part 1's 16-connection load with every serving replica (each member's owner, or its
   only copy) on core 0 and everything else (followers, HAProxy, etcd, h2load) on core 1, so the
   follower's work does not come out of the owners' CPU, as on machines of their own. Needs 2
   cores; appends/s, CPU per append and how busy core 0 was, per round and as medians.
2. failover: `--replicas 2 --fsync always`; a trickle of appends (one client per member, 100 B
   every 20 ms, retrying a failed append every 50 ms) to 8 streams on m0 and 8 on m1; the owner of
   m0 is killed with SIGKILL; failover = kill until an append to one of m0's streams (sent after
   the kill) succeeds, and until every one of the 8 has; redundancy = kill until the new owner's
   /stats says its follower (the killed replica, restarted by `cluster run`) is in sync again.
3. redundancy per GiB: `--replicas 2 --fsync always`; m0 is filled with `--fill-mib` MiB (1 MiB
   appends to 32 streams, h2load); then, with 4 clients appending 100 B sequentially to other m0
   streams, m0's follower is killed with SIGKILL and its data directory deleted; redundancy = kill
   until the owner's /stats shows the follower in sync with a new `last_copy`; the appends'
   throughput and latency before the kill and during the copy.
4. many streams: `--replicas 2 --fsync always --no-registry` (the registry makes each create a
   second write on another member: too slow to fill on 2 cores); `--streams` streams
   created on m0 (h2load PUT, 8-byte first append each), then m0's owner killed with SIGKILL;
   failover = kill until an append to one of 32 sampled streams succeeds, and until all do; the
   promoted replica's "recovered N streams ... in X s" line says where the time went.

The replica to kill is found among `cluster run`'s own children by its `--replica mXy` argument
(what `pgrep -f -- "--replica m0a"` finds, without touching another cluster on the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from ops.bench_cluster import children, measure
from ops.bench_recovery import write_streams
from ops.loadtest import h2load
from ops.loadtest.servers import cpu_seconds
from ops.serverproc import ServerProcess, launch
from streamkeep.cluster.placement import Member, Placement

PLACEMENT = Placement.of([Member("m0", ""), Member("m1", "")], 1)  # owners depend on the ids only
TEXT = {"Content-Type": "text/plain"}
PARTS = ("throughput", "pinned", "failover", "redundancy", "many")
MIB = 1 << 20
LOGS: Path | None = None  # --logs


def names_on(member: str, count: int, prefix: str) -> list[str]:
    """`count` stream names that `member` of a 2-member cluster owns."""
    found: list[str] = []
    i = 0
    while len(found) < count:
        name = f"{prefix}-{i}"
        if PLACEMENT.owner(name).id == member:
            found.append(name)
        i += 1
    return found


def path(name: str) -> str:
    return f"/v1/stream/{name}"


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def quantile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


@dataclass
class Cluster:
    server: ServerProcess
    data: Path
    replicas: dict[str, str] = field(default_factory=dict)  # replica -> its HTTP host:port

    @property
    def url(self) -> str:
        return self.server.url

    def pid(self, replica: str) -> int | None:
        """The live process of `replica` among this cluster's own processes."""
        for pid in children(self.server.process.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if (
                state != "Z"
                and b"--replica" in argv
                and argv[argv.index(b"--replica") + 1] == replica.encode()
            ):
                return pid
        return None

    def stats(self, replica: str) -> dict[str, Any] | None:
        """The replication section of `replica`'s /stats; None while it does not serve."""
        try:
            answer = httpx.get(f"http://{self.replicas[replica]}/stats", timeout=2)
            return answer.json().get("replication") if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def owner(self, member: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for letter in "ab":
                stats = self.stats(member + letter)
                if stats is not None and stats.get("role") == "owner":
                    return member + letter
            time.sleep(0.1)
        raise RuntimeError(f"no owner of {member} serves")

    def wait_in_sync(self, members: tuple[str, ...] = ("m0", "m1"), timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        for member in members:
            owner = self.owner(member)
            while not (self.stats(owner) or {}).get("follower_in_sync"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{member}'s follower is not in sync after {timeout:g} s")
                time.sleep(0.1)

    def log(self, pattern: str) -> list[str]:
        return [line.rstrip() for line in list(self.server.output) if re.search(pattern, line)]

    def stop(self) -> None:
        self.server.stop(timeout=30)
        if LOGS is not None:  # the whole output of `cluster run`, for what the tables do not say
            LOGS.mkdir(parents=True, exist_ok=True)
            (LOGS / f"{self.data.name}.log").write_text("".join(self.server.output))


def start_cluster(
    work: Path, replicas: int, *serve: str, prefill: Callable[[Path], None] | None = None
) -> Cluster:
    """`prefill(data_dir)` runs before the cluster starts (to write streams straight to files)."""
    data = Path(tempfile.mkdtemp(prefix=f"{datetime.now(UTC):%H%M%S}-r{replicas}-", dir=work))
    if prefill is not None:
        prefill(data)
    command = [sys.executable, "-m", "streamkeep", "cluster", "run", "--processes", "2", "--port", "0"]
    command += ["--replicas", str(replicas), "--data-dir", str(data), "--storage", "disk", *serve]
    cluster = Cluster(launch(command, timeout=120), data)
    for line in cluster.server.output:
        for replica, address in re.findall(r"(m\d+[ab]) at http://([\d.]+:\d+)", line):
            cluster.replicas[replica] = address
    if replicas == 2:
        cluster.wait_in_sync(timeout=900 if prefill is not None else 60)  # a prefilled copy takes long
    return cluster


def create(cluster: Cluster, names: list[str], body: bytes = b"") -> None:
    with httpx.Client(timeout=10) as client:
        for name in names:
            answer = client.put(cluster.url + path(name), headers=TEXT, content=body)
            if answer.status_code not in (200, 201):
                raise RuntimeError(f"PUT {name}: {answer.status_code} {answer.text[:200]}")


def kill(cluster: Cluster, replica: str) -> float:
    """SIGKILL to `replica`'s process; returns when it was sent (time.monotonic)."""
    pid = cluster.pid(replica)
    if pid is None:
        raise RuntimeError(f"{replica} has no process to kill")
    sent = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return sent


def back_to_two(cluster: Cluster, member: str, killed: float, timeout: float) -> tuple[float, dict[str, Any]]:
    """Seconds from `killed` until a replica of `member` owns it with its follower in sync again,
    and that owner's replication stats. After a SIGKILL either may own it: the follower, promoted
    once the killed owner's lease expired, or the killed owner itself, when `cluster run` started
    it again before that and it found itself still named the owner (it then recovers its own
    directory and serves, and the follower copies from it again)."""
    while time.monotonic() < killed + timeout:
        for letter in "ab":
            stats = cluster.stats(member + letter)
            if stats and stats.get("role") == "owner" and stats.get("follower_in_sync"):
                return time.monotonic() - killed, stats
        time.sleep(0.05)
    return float("nan"), {}


def gone(cluster: Cluster, replica: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while cluster.pid(replica) is not None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{replica} did not die")
        time.sleep(0.005)


# ---- clients ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    name: str
    sent: float
    done: float
    ok: bool
    status: int  # 0: no answer (connection refused or reset, timeout)


class Appender(threading.Thread):
    """Appends 100 B to `names` in turn over one keep-alive connection through the front door,
    `interval` apart; a failed append (5xx, connection error, timeout) is tried again after 50 ms."""

    def __init__(self, url: str, names: list[str], interval: float) -> None:
        super().__init__(daemon=True)
        self.url, self.names, self.interval = url, names, interval
        self.attempts: list[Attempt] = []
        self.halt = threading.Event()

    def run(self) -> None:
        turn = 0
        with httpx.Client(timeout=3) as client:
            while not self.halt.is_set():
                name = self.names[turn % len(self.names)]
                sent = time.monotonic()
                try:
                    status = client.post(self.url + path(name), headers=TEXT, content=b"x" * 100).status_code
                except httpx.HTTPError:
                    status = 0
                ok = 200 <= status < 300
                self.attempts.append(Attempt(name, sent, time.monotonic(), ok, status))
                if ok:
                    turn += 1
                    if self.interval:
                        self.halt.wait(self.interval)
                else:
                    self.halt.wait(0.05)

    def stop(self) -> None:
        self.halt.set()
        self.join(10)

    def recovered(self, since: float) -> tuple[float, float]:
        """(first success, last stream's first success) of appends sent after `since`, in seconds
        after it; nan if some stream never succeeded."""
        first = self.first_each(since)
        if not first:
            return float("nan"), float("nan")
        every = max(first.values()) if len(first) == len(set(self.names)) else float("nan")
        return min(first.values()), every

    def first_each(self, since: float) -> dict[str, float]:
        """Each stream's first successful append sent after `since`, done how long after it."""
        first: dict[str, float] = {}
        for attempt in self.attempts:
            if attempt.ok and attempt.sent >= since and attempt.name not in first:
                first[attempt.name] = attempt.done - since
        return first

    def failures(self, since: float) -> int:
        return sum(1 for attempt in self.attempts if not attempt.ok and attempt.sent >= since)

    def failed(self, since: float) -> dict[str, Any]:
        """What the failed appends sent after `since` got, and when (s after it)."""
        bad = [a for a in self.attempts if not a.ok and a.sent >= since]
        return {
            "count": len(bad),
            "statuses": sorted({a.status for a in bad}),
            "from_s": round(bad[0].sent - since, 2) if bad else None,
            "to_s": round(bad[-1].done - since, 2) if bad else None,
        }

    def window(self, start: float, end: float) -> tuple[float, list[float]]:
        """(successful appends/s, their latencies in ms) of appends done within [start, end)."""
        done = [a for a in self.attempts if a.ok and start <= a.done < end]
        return len(done) / (end - start), [(a.done - a.sent) * 1e3 for a in done]


# ---- the parts -------------------------------------------------------------------------------


def throughput(work: Path, rounds: int, seconds: float, count: int) -> dict[str, Any]:
    body = work / "body100"
    body.write_bytes(b"x" * 100)
    runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    for number in range(rounds):
        order = (1, 2) if number % 2 == 0 else (2, 1)  # alternate which goes first
        for replicas in order:
            cluster = start_cluster(work, replicas, "--fsync", "always", "--log-level", "warning")
            try:
                rate, cpu = measure(cluster.server, body, False, seconds)
                names = [names_on("m0", 1, f"lat-{number}")[0], names_on("m1", 1, f"lat-{number}")[0]]
                create(cluster, names)
                paths = [path(name) for name in names]
                h2load.run(
                    cluster.server,
                    paths,
                    clients=1,
                    body=body,
                    content_type="text/plain",
                    h2=False,
                    count=200,
                )
                load = h2load.run(
                    cluster.server, paths, clients=1, body=body, content_type="text/plain", h2=False,
                    count=count, latencies=True,
                )  # fmt: skip
                if load.failed:
                    raise RuntimeError(f"{load.failed} sequential appends failed")
                result = {
                    "appends_per_s": rate,
                    "cpu_us": cpu,
                    "p50_ms": load.percentile_ms(0.50),
                    "p99_ms": load.percentile_ms(0.99),
                    "sequential_per_s": load.per_second,
                }
            finally:
                cluster.stop()
            runs[replicas].append(result)
            print(f"  round {number + 1}, --replicas {replicas}: {json.dumps(result)}", flush=True)
    return {"runs": runs}


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of `pid` (a process's threads each have their own affinity) onto `cores`."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, OSError):
            pass  # a thread that ended meanwhile


def owners_pinned(work: Path, rounds: int, seconds: float) -> dict[str, Any]:
    """Part 1 with the owners on a core of their own: every serving replica (the members'
    owners, or the single copies) on core 0, everything else (followers, HAProxy, etcd, the
    supervisor, h2load) on core 1. On 2 cores this is the closest we get to the follower being
    another machine's work: the ratio then says what replicating costs the owner itself."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        raise RuntimeError("needs 2 cores and sched_setaffinity")
    body = work / "body100"
    body.write_bytes(b"x" * 100)
    mine = os.sched_getaffinity(0)
    runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    os.sched_setaffinity(0, {1})  # h2load, started from here, inherits it
    try:
        for number in range(rounds):
            for replicas in (1, 2) if number % 2 == 0 else (2, 1):
                cluster = start_cluster(work, replicas, "--fsync", "always", "--log-level", "warning")
                try:
                    owners = serving_pids(cluster, replicas)
                    for pid in children(cluster.server.process.pid):
                        pin(pid, {0} if pid in owners else {1})
                    before = {pid: cpu_seconds(pid) for pid in owners}
                    started = time.monotonic()
                    rate, cpu = measure(cluster.server, body, False, seconds)
                    wall = time.monotonic() - started
                    owner_core = sum(cpu_seconds(pid) - before[pid] for pid in owners) / wall
                    result = {"appends_per_s": rate, "cpu_us": cpu, "owner_core_busy": owner_core}
                finally:
                    cluster.stop()
                runs[replicas].append(result)
                print(f"  pinned round {number + 1}, --replicas {replicas}: {json.dumps(result)}", flush=True)
    finally:
        os.sched_setaffinity(0, mine)
    return {"runs": runs}


def serving_pids(cluster: Cluster, replicas: int) -> set[int]:
    """The processes that serve HTTP: each member's owner (or its only copy)."""
    if replicas == 2:
        found = {cluster.pid(cluster.owner(member)) for member in ("m0", "m1")}
        return {pid for pid in found if pid is not None}
    serving = set()
    for pid in children(cluster.server.process.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and b"streamkeep" in argv:
            serving.add(pid)
    return serving


def failover(work: Path, trials: int) -> dict[str, Any]:
    results = []
    for number in range(trials):
        cluster = start_cluster(work, 2, "--fsync", "always", "--log-level", "info")
        try:
            lost, kept = names_on("m0", 8, f"fo-{number}"), names_on("m1", 8, f"fo-{number}")
            create(cluster, lost + kept)
            owner = cluster.owner("m0")
            trickles = [Appender(cluster.url, lost, 0.02), Appender(cluster.url, kept, 0.02)]
            for trickle in trickles:
                trickle.start()
            time.sleep(2)
            killed = kill(cluster, owner)
            redundant, stats = back_to_two(cluster, "m0", killed, 90)
            time.sleep(1)
            for trickle in trickles:
                trickle.stop()
            first, every = trickles[0].recovered(killed)
            result = {
                "first_ok_s": first,
                "all_ok_s": every,
                "redundant_s": redundant,
                "served_by": f"{stats.get('replica')} at epoch {stats.get('epoch')}",
                "other_member_failures": trickles[1].failures(killed - 2),
                "other_member_failed": trickles[1].failed(killed - 2),
                "lost_member_failed": trickles[0].failed(killed - 2),
                "appends_lost_member": sum(a.ok for a in trickles[0].attempts),
                "recovery": cluster.log(r"recovered \d+ streams")[2:],
                "ownership": cluster.log(r"owns it at epoch [2-9]|promoted:")
                + cluster.log(r"owns it at epoch")[2:],
            }
        finally:
            cluster.stop()
        results.append(result)
        print(f"  failover {number + 1}: {json.dumps(result)}", flush=True)
    return {"trials": results}


def redundancy(work: Path, fill_mib: int, wait: float) -> dict[str, Any]:
    cluster = start_cluster(work, 2, "--fsync", "always", "--log-level", "info")
    try:
        big = names_on("m0", 32, "fill")
        create(cluster, big)
        chunk = work / "body1m"
        chunk.write_bytes(b"y" * MIB)
        filled = time.monotonic()
        load = h2load.run(
            cluster.server, [path(n) for n in big], clients=4, body=chunk,
            content_type="text/plain", h2=False, count=fill_mib,
        )  # fmt: skip
        if load.failed:
            raise RuntimeError(f"{load.failed} of the 1 MiB appends failed")
        fill_s = time.monotonic() - filled
        owner = cluster.owner("m0")
        follower = "m0b" if owner == "m0a" else "m0a"
        cluster.wait_in_sync(("m0",))
        before = (cluster.stats(owner) or {}).get("last_copy")
        on_disk = sum(f.stat().st_size for f in (cluster.data / owner).rglob("*") if f.is_file())
        small = names_on("m0", 8, "during")
        create(cluster, small)
        appenders = [Appender(cluster.url, small[i::4], 0) for i in range(4)]
        for appender in appenders:
            appender.start()
        time.sleep(4)
        killed = kill(cluster, follower)
        gone(cluster, follower)
        # Renamed first (one step), so the replica `cluster run` starts again finds no directory.
        doomed = cluster.data / f"{follower}.deleted"
        (cluster.data / follower).rename(doomed)
        shutil.rmtree(doomed)
        deleted = time.monotonic() - killed
        synced = float("nan")
        copy: dict[str, Any] = {}
        while time.monotonic() < killed + wait:
            stats = cluster.stats(owner) or {}
            if stats.get("follower_in_sync") and stats.get("last_copy") != before:
                synced = time.monotonic() - killed
                copy = stats["last_copy"]
                break
            time.sleep(0.05)
        time.sleep(2)
        for appender in appenders:
            appender.stop()

        def window(start: float, end: float) -> tuple[float, list[float]]:
            rate, latencies = 0.0, []
            for appender in appenders:
                r, lat = appender.window(start, end)
                rate += r
                latencies += lat
            return rate, latencies

        before_rate, before_lat = window(killed - 3, killed)
        during_rate, during_lat = window(killed, killed + synced)
        result = {
            "fill_mib": fill_mib,
            "fill_s": fill_s,
            "owner_dir_bytes": on_disk,
            "delete_s": deleted,
            "redundant_s": synced,
            "last_copy": copy,
            "s_per_gib": synced / (on_disk / (1 << 30)),
            "copy_s_per_gib": copy.get("seconds", float("nan")) / (copy.get("bytes", 1) / (1 << 30)),
            "appends_before": {
                "per_s": before_rate,
                "p50_ms": quantile(before_lat, 0.5),
                "p99_ms": quantile(before_lat, 0.99),
            },
            "appends_during_copy": {
                "per_s": during_rate,
                "p50_ms": quantile(during_lat, 0.5),
                "p99_ms": quantile(during_lat, 0.99),
                "max_ms": max(during_lat, default=float("nan")),
            },
            "failed_appends": sum(appender.failures(killed - 4) for appender in appenders),
            "log": cluster.log(r"in sync: copied|is gone|acknowledging alone"),
        }
    finally:
        cluster.stop()
    print(f"  redundancy: {json.dumps(result)}", flush=True)
    return result


def many(work: Path, streams: int, wait: float) -> dict[str, Any]:
    # Without the registry (it would list 100,000 streams made behind its back), `--fsync always`
    # (a replicated member refuses anything else). The streams are written as files into m0's first
    # replica before the cluster starts (ops.bench_recovery.write_streams, the files a create
    # leaves): creating 100,000 through the front door takes 10-15 minutes on 2 cores. m0a becomes
    # m0's first owner and m0b copies it all before it is in sync.
    names = names_on("m0", streams, "many")
    made = time.monotonic()
    cluster = start_cluster(
        work,
        2,
        "--fsync",
        "always",
        "--no-registry",
        "--log-level",
        "info",
        prefill=lambda data: write_streams(data / "m0a", names, appends=0),
    )
    try:
        create_s = time.monotonic() - made  # files written, the cluster up, m0b's copy in sync
        owner = cluster.owner("m0")
        cluster.wait_in_sync(("m0",))
        held = httpx.get(f"http://{cluster.replicas[owner]}/stats", timeout=10).json().get("streams")
        sampled = names[:: max(1, len(names) // 32)][:32]
        trickle = Appender(cluster.url, sampled, 0.02)
        trickle.start()
        time.sleep(2)
        killed = kill(cluster, owner)
        deadline = killed + 180
        while time.monotonic() < deadline:
            first, every = trickle.recovered(killed)
            if every == every:  # not nan: every sampled stream answered
                break
            time.sleep(0.1)
        redundant, stats = back_to_two(cluster, "m0", killed, wait)
        promoted_at = cluster.log(r"owns it at epoch")[2:]
        recovered = cluster.log(r"recovered \d+ streams|serving now")[2:]
        time.sleep(1)
        trickle.stop()
        first, every = trickle.recovered(killed)
        result = {
            "streams": len(names),
            "owner_streams": held,
            "create_s": create_s,
            "first_ok_s": first,
            "all_ok_s": every,
            "redundant_s": redundant,
            "killed_at": datetime.now(UTC).timestamp() - (time.monotonic() - killed),
            "promoted": promoted_at,
            "recovery": recovered,
            "served_by": f"{stats.get('replica')} at epoch {stats.get('epoch')}",
            "last_copy": stats.get("last_copy"),
            "recovering": cluster.log(r"recovering streams")[2:],
            "failed_appends": trickle.failed(killed),
            "first_ok_each_s": sorted(round(t, 2) for t in trickle.first_each(killed).values()),
            "copy": cluster.log(r"in sync: copied|broke:")[2:],
        }
    finally:
        cluster.stop()
    print(f"  many streams: {json.dumps(result)}", flush=True)
    return result


# ---- report ----------------------------------------------------------------------------------


def report(results: dict[str, Any], argv: list[str]) -> None:
    print(
        f"\ndate: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; machine: {platform.node()}, {os.cpu_count()} cores "
        f"(shared by h2load, HAProxy, etcd and every replica); CPython {platform.python_version()}; "
        "command: python -m ops.bench_replication " + " ".join(argv) + "\n"
    )
    if "throughput" in results:
        runs = results["throughput"]["runs"]
        print("| `cluster run --processes 2`, disk, `--fsync always` | --replicas 1 | --replicas 2 | ratio |")
        print("|---|---|---|---|")
        rows = (
            ("appends/s, 16 connections, 100 B (median)", "appends_per_s", "{:,.0f}"),
            ("server CPU per append, all processes (median)", "cpu_us", "{:,.0f} us"),
            ("1 connection, sequential: p50 (median)", "p50_ms", "{:.3f} ms"),
            ("1 connection, sequential: p99 (median)", "p99_ms", "{:.3f} ms"),
        )
        medians: dict[str, tuple[float, float]] = {}
        for label, key, form in rows:
            one = median([run[key] for run in runs[1]])
            two = median([run[key] for run in runs[2]])
            medians[key] = (one, two)
            print(f"| {label} | {form.format(one)} | {form.format(two)} | {two / one:.2f}x |")
        for key in ("appends_per_s", "p50_ms", "p99_ms"):
            print(
                f"| {key}, every round | "
                + ", ".join(f"{run[key]:,.3g}" for run in runs[1])
                + " | "
                + ", ".join(f"{run[key]:,.3g}" for run in runs[2])
                + " | |"
            )
        rate = medians["appends_per_s"][1] / medians["appends_per_s"][0]
        added50 = medians["p50_ms"][1] - medians["p50_ms"][0]
        added99 = medians["p99_ms"][1] - medians["p99_ms"][0]
        print(
            f"\n- replicated / single appends/s: {rate:.2f}x (target >= 0.8x) -> {'met' if rate >= 0.8 else 'NOT met'}"
        )
        print(
            f"- latency added by the follower: p50 {added50:+.3f} ms, p99 {added99:+.3f} ms (target <= 1 ms) -> "
            + ("met" if max(added50, added99) <= 1 else "NOT met")
        )
    if "pinned" in results:
        runs = results["pinned"]["runs"]
        print("\n| owners on core 0, all else on core 1 | --replicas 1 | --replicas 2 | ratio |")
        print("|---|---|---|---|")
        for label, key, form in (
            ("appends/s, 16 connections, 100 B (median)", "appends_per_s", "{:,.0f}"),
            ("server CPU per append, all processes (median)", "cpu_us", "{:,.0f} us"),
            ("core 0 (the owners) busy (median)", "owner_core_busy", "{:.0%}"),
        ):
            one = median([run[key] for run in runs[1]])
            two = median([run[key] for run in runs[2]])
            print(f"| {label} | {form.format(one)} | {form.format(two)} | {two / one:.2f}x |")
        print(
            "| appends/s, every round | "
            + ", ".join(f"{run['appends_per_s']:,.0f}" for run in runs[1])
            + " | "
            + ", ".join(f"{run['appends_per_s']:,.0f}" for run in runs[2])
            + " | |"
        )
    if "failover" in results:
        trials = results["failover"]["trials"]
        print("\n| failover of m0 (owner SIGKILLed), under a trickle | each trial | median |")
        print("|---|---|---|")
        for label, key in (
            ("first append to m0 succeeds (s after the kill)", "first_ok_s"),
            ("all 8 of m0's streams took an append (s)", "all_ok_s"),
            ("follower back in sync: redundancy (s)", "redundant_s"),
        ):
            values = [t[key] for t in trials]
            print(f"| {label} | {', '.join(f'{v:.2f}' for v in values)} | {median(values):.2f} |")
        print(f"| who serves m0 afterwards | {', '.join(t['served_by'] for t in trials)} | |")
        print(
            f"| failed appends to m1's streams meanwhile | {', '.join(str(t['other_member_failures']) for t in trials)} | |"
        )
    if "redundancy" in results:
        r = results["redundancy"]
        print("\n| m0's follower SIGKILLed and its directory deleted | value |")
        print("|---|---|")
        print(
            f"| m0's data directory | {r['owner_dir_bytes'] / MIB:,.0f} MiB ({r['fill_mib']} x 1 MiB appends in {r['fill_s']:.1f} s) |"
        )
        print(f"| kill until in sync again | {r['redundant_s']:.1f} s ({r['s_per_gib']:.1f} s per GiB) |")
        copy = r["last_copy"]
        print(
            f"| the copy itself (/stats last_copy) | {copy.get('bytes', 0) / MIB:,.0f} MiB in {copy.get('seconds', float('nan')):.1f} s ({r['copy_s_per_gib']:.1f} s per GiB) |"
        )
        b, d = r["appends_before"], r["appends_during_copy"]
        print(
            f"| 4 sequential clients, 3 s before the kill | {b['per_s']:,.0f} appends/s, p50 {b['p50_ms']:.2f} ms, p99 {b['p99_ms']:.2f} ms |"
        )
        print(
            f"| the same during the copy | {d['per_s']:,.0f} appends/s, p50 {d['p50_ms']:.2f} ms, p99 {d['p99_ms']:.2f} ms, max {d['max_ms']:.0f} ms |"
        )
        print(f"| failed appends | {r['failed_appends']} |")
    if "many" in results:
        m = results["many"]
        print(
            f"\n| failover of m0 holding {m['streams']:,} streams (`--fsync always`, `--no-registry`) | value |"
        )
        print("|---|---|")
        print(f"| creating them through the front door | {m['create_s']:.1f} s |")
        print(f"| first of 32 sampled streams takes an append | {m['first_ok_s']:.1f} s after the kill |")
        print(f"| all 32 sampled | {m['all_ok_s']:.1f} s |")
        print(f"| follower back in sync (redundancy) | {m['redundant_s']:.1f} s |")
        print(f"| who serves m0 afterwards | {m['served_by']} (last copy {m['last_copy']}) |")
        for line in m["promoted"] + m["recovery"] + m["copy"]:
            print(f"| log | `{line}` |")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--latency-count", type=int, default=2000)
    parser.add_argument("--failovers", type=int, default=3)
    parser.add_argument("--fill-mib", type=int, default=1024)
    parser.add_argument("--streams", type=int, default=100_000)
    parser.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated subset of " + ", ".join(PARTS)
    )
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    parser.add_argument(
        "--work-dir", type=Path, help="where the clusters' data goes (default: a temporary directory)"
    )
    parser.add_argument(
        "--redundancy-timeout",
        type=float,
        default=600,
        help="how long parts 3 and 4 wait for two copies again",
    )
    parser.add_argument("--logs", type=Path, help="keep each cluster's output here")
    args = parser.parse_args()
    global LOGS
    LOGS = args.logs
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts: {sorted(unknown)}")
    if not h2load.available():
        print("h2load is missing: apt-get install nghttp2-client (make h2load does)", file=sys.stderr)
        return 2
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-replication-", dir=args.work_dir) as tmp:
        work = Path(tmp)
        if "throughput" in parts:
            print("throughput and latency, --replicas 1 and 2 alternating ...", flush=True)
            results["throughput"] = throughput(work, args.rounds, args.seconds, args.latency_count)
        if "pinned" in parts:
            print("throughput with the owners on a core of their own ...", flush=True)
            results["pinned"] = owners_pinned(work, args.rounds, args.seconds)
        if "failover" in parts:
            print("failover under a trickle ...", flush=True)
            results["failover"] = failover(work, args.failovers)
        if "redundancy" in parts:
            print(f"time to redundancy after losing a follower's disk ({args.fill_mib} MiB) ...", flush=True)
            results["redundancy"] = redundancy(work, args.fill_mib, args.redundancy_timeout)
        if "many" in parts:
            print(f"failover of a member holding {args.streams:,} streams ...", flush=True)
            results["many"] = many(work, args.streams, args.redundancy_timeout)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    report(results, sys.argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
