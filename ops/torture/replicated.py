"""The black-box tier on a replicated cluster (issue 23): every member on two replicas, under kill -9,
disk loss, SIGSTOP pauses, partitions and etcd member loss.

    python -m ops.torture blackbox --cluster 3 --replicas 2 --seed 7 --duration 120 [--replica-faults K,..]
    make torture ARGS="blackbox --cluster 3 --replicas 2 --minutes 30"

What runs: a 3-member etcd (`LocalEtcd(members=3)`, so one member can be killed and restarted) and
`streamkeep cluster run --processes N --replicas 2 --etcd <its URLs>` with the single-server run's
flags (`--fsync always` etc.; no cold tier and no retention rules: `cluster run` gives every
replica the same flags and its own `--config`, so neither a per-member bucket prefix nor our rules
file could reach them). `cluster run` restarts any replica that exits. The workers are the cluster
run's (ops/torture/cluster.py): the whole operation registry through the front door (HAProxy).

"Machine" k runs replicas `m{k}a` and `m{k-1}b` on a loopback address of its own (127.X.Y.{k+1},
the network chosen by `cluster run`; read from the addresses it prints). The seeded
fault schedule (`replica_faults`: each kind once, in a seeded order, then seeded picks), one fault
at a time:

- machine_kill: SIGKILL both replica processes of a machine;
- disk_loss: the same, then their data directories deleted before they start again (the
  supervisor, `cluster run`, is SIGSTOPped meanwhile so it cannot restart them early). Only with
  every member's follower in sync first (losing both copies loses data by design): the fault waits
  for it, and is skipped ("disk_loss_skipped") if it does not come;
- disk_loss_kill: a disk loss on machine k, then 0-4 s later a kill -9 of machine k+1, which holds
  the surviving copy of member k (promoting, or not even that yet) while the wiped replica is to
  copy from it: the only good copy is killed, and must come back as the owner with nothing lost;
- pause: SIGSTOP one replica for 1-6 s, then SIGCONT (an owner is deposed meanwhile and fences
  itself when it wakes);
- partition: every packet between the machine's address and this run's ports dropped for 2-6 s
  (ops/torture/partition.py);
- split: the same, but only etcd's ports and the replication ports: HAProxy still reaches the
  machine's replicas, so a deposed owner that has not fenced itself yet still gets requests while
  the promoted one serves too (HAProxy sends to whichever of the two passes its checks): the
  two-owners case made as likely as it can be from outside;
- etcd_kill: SIGKILL one etcd member, restarted 1-5 s later (two of three keep the quorum).

A fault waits for the one before it to end (its members serving again); the workload lasts until
every kind ran once even when recoveries on a loaded machine push that past the duration (at most
three times it). `--replica-faults` picks kinds.

Clients see 503s, 502s, timeouts and dropped connections meanwhile. For the model, a fault on a
machine is a "kill" of each member with a replica there (a member-down window, ops/torture/
membership.py: a 503 of its streams is allowed, a timeout or a dropped connection is an
ambiguous outcome that may or may not have happened), closed by a "restart" once a replica of the
member has served /healthz for 3 s without a break (an owner may fence itself just after a
partition heals). etcd member loss opens no window: it must not be visible to clients.

Judged besides the model's usual checks (every acknowledged append present exactly once and in
order, bytes only from appends that were sent, each at most once, producers' seqs never
duplicated, offsets stable: the same offset returns the same bytes for the whole run): one owner
per member and epoch, from every replica's /stats and etcd's member records, sampled each 0.5 s
(ops/torture/operations/replication.py). At the end: every fault healed, a wait until every member
has an in-sync follower, the full read of every stream through the front door, then each member's
two data directories compared byte for byte once quiet.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from base64 import b64decode, b64encode
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ops.torture import partition
from ops.torture.blackbox import Options, Result
from ops.torture.checker import Checker
from ops.torture.cluster import ClusterRun, haproxy_binary
from ops.torture.history import Call, Fault, OpEnded, OpStarted, Outcome
from ops.torture.model import RunConfig
from ops.torture.operations import GenContext
from ops.torture.operations.replication import IDENTICAL, IN_SYNC, ROLES
from ops.torture.rig import CREDENTIALS, free_port
from ops.torture.transport import HttpTransport
from streamkeep.cluster.placement import Member, Placement
from streamkeep.coordination.local_etcd import LocalEtcd

KINDS = ("machine_kill", "disk_loss", "disk_loss_kill", "pause", "partition", "split", "etcd_kill")
WEIGHTS = (0.2, 0.1, 0.1, 0.2, 0.15, 0.15, 0.1)
MARKER = "replica.json"  # each replica's own: what its directory is a copy of (never replicated)
SERVE_TIMEOUT = 60.0  # seconds a member may take to serve again after a fault ends
SETTLE = 3.0  # ... and then serve without a break for this long (a late fence: await_members)
IN_SYNC_TIMEOUT = 90.0  # ... to have an in-sync follower again
TMPFS_BYTES = 1 << 30  # six replicas' copies, no retention: more room than a single server's 48 MiB
_REPLICA_LINE = re.compile(r"(m\d+[ab]) at http://([\d.]+):(\d+) \(([^)]+)\)")
_BIND = re.compile(r"^\s*bind\s+\S*?:(\d+)", re.MULTILINE)


@dataclass
class ReplicaFault:
    at: float  # seconds after the workload starts (a fault waits for the one before to end)
    kind: str
    machine: int = 0  # machine_kill, disk_loss, partition; pause: the paused replica's machine
    duration: float = 0.0  # pause, partition, etcd_kill: how long; disk_loss_kill: the delay
    replica: str = ""  # pause: which replica
    etcd: int = 0  # etcd_kill: which member


@dataclass
class Replica:
    name: str  # m0a
    member: str  # m0
    machine: int
    http: str  # host:port
    data: Path


def replica_faults(options: Options, members: int, rng: random.Random) -> list[ReplicaFault]:
    """Each kind once in a seeded order, then seeded picks, until the end of the workload (the
    kinds of `options.replica_faults`, or all)."""
    unknown = set(options.replica_faults) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown replica fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    kinds = [k for k in KINDS if k in options.replica_faults or not options.replica_faults]
    weights = [w for k, w in zip(KINDS, WEIGHTS, strict=True) if k in kinds]
    first = rng.sample(kinds, len(kinds))
    plan: list[ReplicaFault] = []
    at = 3.0
    while at < options.duration - 6:
        kind = first.pop(0) if first else rng.choices(kinds, weights)[0]
        fault = ReplicaFault(at, kind, machine=rng.randrange(members))
        if kind == "pause":
            fault.replica = f"m{rng.randrange(members)}{rng.choice('ab')}"
            fault.machine = machine_of(fault.replica, members)
            fault.duration = rng.uniform(1.0, 6.0)
        elif kind in ("partition", "split"):
            fault.duration = rng.uniform(2.0, 6.0)
        elif kind == "etcd_kill":
            fault.etcd = rng.randrange(3)
            fault.duration = rng.uniform(1.0, 5.0)
        elif kind == "disk_loss_kill":
            fault.duration = rng.choice((0.0, 0.2, 0.5, 1.0, 2.0, 4.0))
        plan.append(fault)
        at += fault.duration + rng.uniform(2.0, 5.0)
    return plan


def machine_of(replica: str, members: int) -> int:
    """`cluster run`'s layout (streamkeep/cluster/run_replicated.py `hosts`): mXa on machine X, mXb
    on machine X+1."""
    number = int(replica[1:-1])
    return number if replica.endswith("a") else (number + 1) % members


def pids_of(data: Path) -> list[int]:
    """The `streamkeep serve` processes whose --data-dir is `data` (by the exact argument: other
    runs on this machine use the same replica names)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in args and b"--data-dir" in args:
            at = args.index(b"--data-dir")
            if at + 1 < len(args) and args[at + 1] == str(data).encode():
                found.append(int(entry.name))
    return found


def argument(pid: int, flag: str) -> str | None:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    return args[args.index(flag) + 1] if flag in args and args.index(flag) + 1 < len(args) else None


def gone(pid: int) -> bool:
    """Dead (a zombie counts: its files are closed) or reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def tree_digest(root: Path) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for path in sorted(root.rglob("*")):
        relative = str(path.relative_to(root))
        if path.is_file() and relative != MARKER:
            with contextlib.suppress(OSError):
                files[relative] = path.read_bytes()
    return files


def differences(one: Path, other: Path) -> tuple[list[str], int]:
    a, b = tree_digest(one), tree_digest(other)
    differ = sorted(p for p in set(a) | set(b) if a.get(p) != b.get(p))
    return differ, len(set(a) | set(b))


class ReplicatedRun(ClusterRun):
    def __init__(self, options: Options, log: Callable[[str], None]) -> None:
        options.cold = False  # see the module docstring
        options.retention = False
        super().__init__(options, log)
        self.ids = tuple(f"m{i}" for i in range(options.cluster))
        self.history.meta.update(tier="blackbox-replicated", members=",".join(self.ids))
        config = RunConfig(
            fsync=options.fsync, fsync_interval=options.fsync_interval, cold=False, members=self.ids
        )
        self.checker = Checker(config)
        self.placement = Placement.of([Member(m, "127.0.0.1:1") for m in self.ids], 1)
        self.disk.SIZES = {**self.disk.SIZES, "tmpfs": TMPFS_BYTES}
        self.etcd: LocalEtcd | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.output = self.root / "cluster.log"
        self.data = Path()
        self.replicas: dict[str, Replica] = {}
        self.coordination_ports: list[int] = []
        self.partitions: partition.Partitions | None = None
        self.paused: set[int] = set()
        self.etcd_down: set[int] = set()
        self.down: set[str] = set()  # members whose down window is open
        self.latest: dict[str, Any] = {}  # the last sample of the replicas' /stats
        self.sample_lock = threading.Lock()
        self.applied = 0  # faults applied so far
        self.first_round = threading.Event()  # every kind of the schedule applied once

    # ---- setup and teardown -------------------------------------------------------------

    def setup(self) -> None:
        if haproxy_binary() is None:
            raise RuntimeError("haproxy is not installed: apt-get install haproxy (make system-tools does)")
        binary = partition.iptables()
        if binary is None:
            raise RuntimeError("iptables is not installed: apt-get install iptables (make system-tools does)")
        partition.clear_stale(binary)
        mount = self.disk.setup()
        self.etcd = LocalEtcd(self.root / "etcd", members=3)
        self.etcd.start()
        self.data = mount / "cluster"
        port = free_port()
        serve = self.server_args(self.data)
        at = serve.index("--data-dir")
        del serve[at : at + 2]
        command = [
            sys.executable, "-m", "streamkeep", "cluster", "run", "--processes", str(len(self.ids)),
            "--replicas", "2", "--port", str(port), "--data-dir", str(self.data),
            "--etcd", ",".join(self.etcd.endpoints), *serve,
        ]  # fmt: skip
        with open(self.output, "ab") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **CREDENTIALS}
            )
        deadline = time.monotonic() + 120
        while "streamkeep listening on" not in self.output.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"cluster run did not start:\n{self.tail(40)}")
            time.sleep(0.2)
        for name, host, http, data in _REPLICA_LINE.findall(self.output.read_text(errors="replace")):
            self.replicas[name] = Replica(
                name, name[:-1], machine_of(name, len(self.ids)), f"{host}:{http}", Path(data)
            )
        self.partitions = partition.Partitions(binary, self.ports())
        self.coordination_ports = self.ports(http=False)
        self.front = f"http://127.0.0.1:{port}"
        self.receiver.server_url = self.front
        # HAProxy takes every server for up until its checks say otherwise (2 x 0.5 s): until then a
        # member's requests may go to its follower, which does not listen (FINDINGS.md).
        time.sleep(1.5)
        transport = HttpTransport(self.front, self.history.clock, timeout=10)
        try:
            self.wait_routed(transport)
        finally:
            transport.close()
        self.initialize()

    def ports(self, http: bool = True) -> list[int]:
        """Every port of this run that a machine's traffic may use: etcd's client ports, each
        replica's replication port, and (`http`) each replica's HTTP port and HAProxy's."""
        assert self.etcd is not None
        ports = [int(url.rsplit(":", 1)[1]) for url in self.etcd.endpoints]
        for replica in self.replicas.values():
            if http:
                ports.append(int(replica.http.rsplit(":", 1)[1]))
            for pid in pids_of(replica.data):
                listen = argument(pid, "--replication-listen")
                if listen:
                    ports.append(int(listen.rsplit(":", 1)[1]))
        for config in (self.data / "haproxy").glob("*.cfg") if http else ():
            ports += [int(p) for p in _BIND.findall(config.read_text())]
        return ports

    def tail(self, lines: int) -> str:
        try:
            return "\n".join(self.output.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def teardown(self) -> None:
        parts: list[Callable[[], object]] = [
            self.heal_all,
            self.resume_all,
            self.stop_cluster,
            self.stop_etcd,
            self.receiver.close,
            self.disk.close,
        ]
        for part in parts:
            try:
                part()
            except Exception as error:  # keep tearing down: rules and mounts must go
                self.log(f"teardown: {error!r}")

    def heal_all(self) -> None:
        if self.partitions is not None:
            self.partitions.heal_all()

    def stop_etcd(self) -> None:
        if self.etcd is not None:
            self.etcd.stop()

    def resume_all(self) -> None:
        for pid in list(self.paused):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.paused.clear()
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)

    def stop_cluster(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for replica in self.replicas.values():  # any the supervisor left behind
            for pid in pids_of(replica.data):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def all_output(self) -> str:
        parts = [self.tail(4000)]
        for log in sorted((self.root / "etcd").glob("*.log")):  # LocalEtcd's, one per member
            lines = log.read_text(errors="replace").splitlines()[-300:]
            parts.append(f"==== {log.name} ====\n" + "\n".join(lines))
        return "\n".join(parts)

    def dump_stem(self) -> str:
        o = self.options
        return f"blackbox-replicated{o.cluster}-seed{o.seed}-{o.fsync}-{o.disk}"

    # ---- observing the replicas -------------------------------------------------------------

    def probe(self) -> None:
        """Samples every replica's role and etcd's records twice a second (`replica_roles`)."""
        while not self.stop.is_set():
            self.sample()
            self.sleep(0.5)

    def probe_fds(self, quiet: bool) -> None:
        pass  # six processes that come and go: the single-server and cluster runs look at descriptors

    def sample(self) -> dict[str, Any]:
        call = Call("GET", "/stats of every replica, /streamkeep/members/ of etcd")
        started = self.history.start(ROLES, "monitor", None, {}, call)
        replicas: dict[str, Any] = {}
        with httpx.Client(timeout=0.4) as client:
            for name, replica in self.replicas.items():
                try:
                    section = client.get(f"http://{replica.http}/stats").json().get("replication") or {}
                    replicas[name] = {
                        k: section.get(k) for k in ("member", "role", "epoch", "follower_in_sync", "follower")
                    }
                except (httpx.HTTPError, ValueError):
                    replicas[name] = None
        body = {"replicas": replicas, "records": self.records()}
        self.history.end(started, Outcome(200, body=json.dumps(body), verdict="ok"))
        with self.sample_lock:
            self.latest = body
        return body

    def records(self) -> dict[str, Any]:
        """etcd's member records, from the first member that answers."""
        assert self.etcd is not None
        prefix = b"/streamkeep/members/"
        query = {"key": b64encode(prefix).decode(), "range_end": b64encode(prefix[:-1] + b"0").decode()}
        for index, endpoint in enumerate(self.etcd.endpoints):
            if index in self.etcd_down:
                continue
            try:
                answer = httpx.post(f"{endpoint}/v3/kv/range", json=query, timeout=0.5).json()
            except (httpx.HTTPError, ValueError):
                continue
            records = {}
            for kv in answer.get("kvs", []):
                key = b64decode(kv["key"]).decode().removeprefix(prefix.decode())
                with contextlib.suppress(ValueError):
                    records[key] = json.loads(b64decode(kv["value"]))
            return records
        return {}

    def owner_of(self, member: str) -> Replica | None:
        """The replica of `member` that answers /healthz (only an owner listens)."""
        for replica in self.replicas.values():
            if replica.member != member:
                continue
            try:
                if httpx.get(f"http://{replica.http}/healthz", timeout=0.5).status_code == 200:
                    return replica
            except httpx.HTTPError:
                continue
        return None

    def in_sync(self) -> dict[str, bool]:
        """Per member: its owner says its follower is in sync (from a fresh sample)."""
        sample = self.sample()
        found = dict.fromkeys(self.ids, False)
        for stats in sample["replicas"].values():
            if stats and stats.get("role") == "owner" and stats.get("follower_in_sync"):
                found[str(stats["member"])] = True
        return found

    def wait_in_sync(self, seconds: float, stoppable: bool = True) -> dict[str, bool]:
        deadline = time.monotonic() + seconds
        while True:
            found = self.in_sync()
            if all(found.values()) or time.monotonic() > deadline or self.dead:
                return found
            if stoppable and self.stop.is_set():
                return found
            time.sleep(0.5)

    # ---- faults ---------------------------------------------------------------------------------

    def faults(self, began: float) -> None:
        rng = random.Random(f"{self.options.seed}/faults")
        plan = replica_faults(self.options, len(self.ids), rng)
        first = len({fault.kind for fault in plan})

        def apply(fault: ReplicaFault) -> None:
            self.replica_fault(fault)
            self.applied += 1
            if self.applied >= first:
                self.first_round.set()

        self.follow(plan, began, apply)
        self.first_round.set()

    def workload_done(self, elapsed: float) -> bool:
        """Not before every kind was applied once (recoveries on a loaded machine can push the
        first round past the duration), but at most three times the duration."""
        duration = self.options.duration
        return elapsed >= duration and (self.first_round.is_set() or elapsed >= 3 * duration)

    def machine_address(self, machine: int) -> str:
        """The loopback address machine k's replicas use (m{k}a's: `cluster run` picks a network
        per run)."""
        return self.replicas[f"m{machine}a"].http.rsplit(":", 1)[0]

    def on_machine(self, machine: int) -> list[Replica]:
        return [r for r in self.replicas.values() if r.machine == machine]

    def replica_fault(self, plan: ReplicaFault) -> None:
        kind = plan.kind
        if kind == "etcd_kill":
            assert self.etcd is not None
            self.history.fault(kind, etcd=plan.etcd, duration=round(plan.duration, 2))
            self.etcd_down.add(plan.etcd)
            self.etcd.kill(plan.etcd)
            self.log(f"etcd member {plan.etcd} killed for {plan.duration:.1f} s")
            self.sleep(plan.duration)
            self.restart_etcd(plan.etcd)
            return
        if kind in ("disk_loss", "disk_loss_kill"):
            ready = self.wait_in_sync(IN_SYNC_TIMEOUT)
            if not all(ready.values()):
                self.history.fault("disk_loss_skipped", machine=plan.machine, in_sync=ready)
                self.log(f"disk loss on machine {plan.machine} skipped: not every member is in sync: {ready}")
                return
        hit = [self.replicas[plan.replica]] if kind == "pause" else self.on_machine(plan.machine)
        later = self.on_machine((plan.machine + 1) % len(self.ids)) if kind == "disk_loss_kill" else []
        hit += later
        members = sorted({r.member for r in hit})
        detail = {
            "machine": plan.machine,
            "replicas": [r.name for r in hit],
            "duration": round(plan.duration, 2),
        }
        self.history.fault(kind, **detail)
        for member in members:
            self.history.fault("kill", member=member, cause=kind)
            self.down.add(member)
        self.log(f"{kind} {', '.join(r.name for r in hit)} (machine {plan.machine})")
        if kind in ("machine_kill", "disk_loss"):
            self.kill_machine(hit, wipe=kind == "disk_loss")
        elif kind == "disk_loss_kill":
            self.kill_machine([r for r in hit if r not in later], wipe=True)
            self.sleep(plan.duration)
            self.kill_machine(later, wipe=False)
        elif kind == "pause":
            pids = pids_of(hit[0].data)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
                self.paused.add(pid)
            self.sleep(plan.duration)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                self.paused.discard(pid)
        elif kind in ("partition", "split"):
            assert self.partitions is not None
            address = self.machine_address(plan.machine)
            self.partitions.cut(address, None if kind == "partition" else self.coordination_ports)
            self.sleep(plan.duration)
            self.partitions.heal(address)
            self.history.fault("partition_healed", machine=plan.machine)
        self.await_members(members)

    def kill_machine(self, hit: list[Replica], wipe: bool) -> None:
        """SIGKILL the machine's replicas; with `wipe`, delete their directories once they are dead
        and before the supervisor (held stopped meanwhile) can start them again."""
        assert self.process is not None
        if wipe:
            os.kill(self.process.pid, signal.SIGSTOP)
        try:
            pids = [pid for replica in hit for pid in pids_of(replica.data)]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if wipe:
                deadline = time.monotonic() + 10
                while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
                    time.sleep(0.01)
                for replica in hit:
                    shutil.rmtree(replica.data, ignore_errors=True)
        finally:
            if wipe:
                os.kill(self.process.pid, signal.SIGCONT)

    def restart_etcd(self, index: int) -> None:
        assert self.etcd is not None
        try:
            self.etcd.restart(index)
            self.etcd_down.discard(index)
            self.history.fault("etcd_restart", etcd=index)
        except Exception as error:
            self.history.fault("start_failed", output=f"etcd member {index} did not start again: {error}")
            self.dead = True
            self.stop.set()

    def await_members(
        self, members: list[str], seconds: float = SERVE_TIMEOUT, stoppable: bool = True
    ) -> None:
        """Until each member has served /healthz for `SETTLE` seconds without a break: that
        closes its down window ("restart"). A fault's effects may outlast it (an owner that could
        not reach etcd during a partition fences itself just after it heals, and its member is
        down for a restart), hence the settling. One that does not within `seconds` is a finding,
        and ends the run. When the workload ends meanwhile, the rest is left to `undo_faults`."""
        deadline = time.monotonic() + seconds
        for member in members:
            since: float | None = None
            while since is None or time.monotonic() - since < SETTLE:
                if stoppable and self.stop.is_set():
                    return
                if time.monotonic() > deadline or self.dead:
                    self.history.fault(
                        "start_failed",
                        member=member,
                        output=f"member {member}: no replica served within {seconds:g} s\n{self.tail(60)}",
                    )
                    self.dead = True
                    self.stop.set()
                    return
                serving = self.owner_of(member) is not None
                since = (since or time.monotonic()) if serving else None
                time.sleep(0.1)
            self.history.fault("restart", member=member)
            self.down.discard(member)

    def undo_faults(self) -> None:
        if self.partitions is not None:
            for address in list(self.partitions.active):
                self.partitions.heal(address)
                self.history.fault("partition_healed", address=address)
        for pid in list(self.paused):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            self.paused.discard(pid)
        for index in sorted(self.etcd_down):
            self.restart_etcd(index)
        self.await_members(sorted(self.down), stoppable=False)

    # ---- the end ------------------------------------------------------------------------------

    def final(self) -> None:
        """Every member with an in-sync follower, the full read through the front door, then
        each member's two copies compared."""
        began = time.monotonic()
        found = self.wait_in_sync(IN_SYNC_TIMEOUT, stoppable=False)
        waited = round(time.monotonic() - began, 1)
        started = self.history.start(IN_SYNC, "final", None, {"waited": waited}, Call("GET", "/stats"))
        self.history.end(started, Outcome(200, body=json.dumps(found), verdict="ok"))
        self.log(f"in sync after {waited} s: {found}")
        transport = HttpTransport(self.front, self.history.clock, timeout=30)
        ctx = GenContext("final", random.Random(0), self.view)
        try:
            self.wait_routed(transport)
            self.read_everything(transport, ctx)
        finally:
            transport.close()
        self.log(f"final reads done after {time.monotonic() - began:.1f} s")
        self.compare_copies()
        self.log(f"copies compared after {time.monotonic() - began:.1f} s")

    def compare_copies(self, attempts: int = 10) -> None:
        """Each member's owner's and follower's directories, byte for byte, until they agree (a
        last commit may be on its way) or `attempts` seconds have passed."""
        compared: dict[str, Any] = {}
        for _ in range(attempts):
            compared = {}
            for member in self.ids:
                owner = self.owner_of(member)
                if owner is None:
                    compared[member] = {"owner": None}
                    continue
                follower = next(r for r in self.replicas.values() if r.member == member and r is not owner)
                differ, files = differences(owner.data, follower.data)
                compared[member] = {
                    "owner": owner.name,
                    "follower": follower.name,
                    "differ": differ[:20],
                    "files": files,
                }
            if all(part.get("differ") == [] for part in compared.values()):
                break
            time.sleep(1)
        call = Call("GET", "data directories of every member's replicas")
        started = self.history.start(IDENTICAL, "final", None, {}, call)
        self.history.end(started, Outcome(200, body=json.dumps(compared), verdict="ok"))

    # ---- results --------------------------------------------------------------------------------

    def add_results(self, result: Result) -> None:
        result.cluster = replicated_counts(self.history.events)


def replicated_counts(events: list[OpStarted | OpEnded | Fault]) -> dict[str, int]:
    """What the faults did and what was acknowledged, from the history."""
    faults = Counter(e.kind for e in events if isinstance(e, Fault))
    starts = {e.id: e for e in events if isinstance(e, OpStarted)}
    acked = Counter(
        starts[e.id].op
        for e in events
        if isinstance(e, OpEnded)
        and starts[e.id].op in ("append", "produce", "close")
        and e.outcome.verdict == "ok"
        and e.outcome.status in (200, 204)
        and starts[e.id].worker != "final"
    )
    owners: set[tuple[str, int]] = set()
    compared = 0
    for event in events:
        if isinstance(event, OpEnded) and starts[event.id].op == ROLES:
            with contextlib.suppress(ValueError):
                for member, record in json.loads(event.outcome.body).get("records", {}).items():
                    owners.add((member, int(record.get("epoch", 0))))
        if isinstance(event, OpEnded) and starts[event.id].op == IDENTICAL:
            with contextlib.suppress(ValueError):
                compared += sum(int(p.get("files") or 0) for p in json.loads(event.outcome.body).values())
    members = {m for m, _ in owners}
    return {
        **{kind: faults[kind] for kind in (*KINDS, "disk_loss_skipped")},
        "appends acknowledged": acked["append"] + acked["produce"],
        "closes acknowledged": acked["close"],
        "epochs seen in etcd beyond the first": len(owners) - len(members),
        "producer retries of an ambiguous seq": sum(
            1 for e in starts.values() if e.op == "produce" and e.params.get("attempt")
        ),
        "... answered 204 (a duplicate)": sum(
            1
            for e in events
            if isinstance(e, OpEnded)
            and starts[e.id].op == "produce"
            and starts[e.id].params.get("attempt")
            and e.outcome.status == 204
        ),
        "role samples": sum(1 for e in starts.values() if e.op == ROLES),
        "files compared between copies": compared,
    }


def run(options: Options, log: Callable[[str], None] = print) -> Result:
    """One run of the black-box tier on a replicated cluster (`options.cluster` members, each on
    two replicas)."""
    return ReplicatedRun(options, log).run()


__all__ = ["ReplicatedRun", "replica_faults", "replicated_counts", "run"]
