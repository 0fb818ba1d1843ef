"""`streamkeep cluster run --replicas 2`: a replicated cluster on one machine, supervised.

Each member has two replicas, `<member>a` and `<member>b`, each a `streamkeep serve --replicas 2`
process with its own data directory (`DIR/m0a`, `DIR/m0b`, ...). etcd (started here on loopback
unless `--etcd` names one) says which replica of each member owns it; the owner serves and sends
every change of its data directory to the other, which keeps the copy and takes over when the
owner's lease expires. HAProxy's backend for a member has both replicas as servers; only the owner
listens, so health checks route to it. The members reach each other through one HAProxy frontend
per member (their `[cluster]` addresses), so they need not know which replica owns.

Placement on machines: replica b of member i is laid out as if on the machine of member i + 1 (no
machine is idle: each runs one owner and one follower); `hosts()` says which processes share a
machine, and tests kill a whole machine by killing those.

It is a supervisor: a replica that exits (crashed, killed, or fenced because it lost ownership) is
started again after a backoff and said so; it comes back as the follower when the other replica
took over. Only Ctrl-C/SIGTERM, or HAProxy or etcd ending, stops the cluster.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamkeep.cluster import haproxy
from streamkeep.cluster.placement import Member, Placement
from streamkeep.cluster.run import (
    ClusterError,
    check_arguments,
    cluster_secret,
    free_port,
    front_door_pem,
    haproxy_binary,
    member_ids,
    stop_all,
    wait_until_listening,
    write_toml,
)
from streamkeep.coordination.local_etcd import LocalEtcd

FIRST_BACKOFF = 0.5
MOST_BACKOFF = 10.0
STEADY = 30.0  # a replica up this long has recovered: its next exit starts the backoff again


@dataclass
class ReplicaProcess:
    member: str
    replica: str
    http: str
    replication: str
    data_dir: Path
    command: list[str] = field(default_factory=list)
    process: subprocess.Popen[str] | None = None
    started: float = 0.0
    backoff: float = FIRST_BACKOFF
    restart_at: float | None = None
    restarts: int = 0


def hosts(members: list[str]) -> list[list[str]]:
    """Which replicas share a machine: machine i runs member i's replica a and member i-1's b."""
    count = len(members)
    return [[f"{members[i]}a", f"{members[(i - 1) % count]}b"] for i in range(count)]


def machine_addresses(count: int) -> list[str]:
    """Each machine's replicas listen on, and connect from, a loopback address of their own (all of
    127/8 is loopback on Linux), so a test can cut one machine off; a random network per run, so
    that two clusters on one machine do not share them."""
    network = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}"
    return [f"{network}.{machine + 1}" for machine in range(count)]


def relay(name: str, process: subprocess.Popen[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        sys.stderr.write(f"[{name}] {line.replace('streamkeep listening on', 'replica listening on')}")


def _die_with_parent() -> None:
    """In the child: SIGKILL when `cluster run` dies, however it dies (no orphan replica keeps
    serving a member the next `cluster run` starts again)."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(replica: ReplicaProcess, env: dict[str, str]) -> None:
    replica.process = subprocess.Popen(
        replica.command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=_die_with_parent,  # prctl only: nothing that could hold a lock
    )
    replica.started = time.monotonic()
    threading.Thread(target=relay, args=(replica.replica, replica.process), daemon=True).start()


def owner_up(
    replicas: list[ReplicaProcess], every: list[ReplicaProcess], env: dict[str, str], seconds: float = 60
) -> None:
    """Waits until one replica of the member answers /healthz (the owner; followers do not listen),
    starting again any replica that exits meanwhile (a fenced one, say)."""
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for replica in every:
            supervise(replica, env, time.monotonic())
        for replica in replicas:
            try:
                with urllib.request.urlopen(f"http://{replica.http}/healthz", timeout=1) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
        time.sleep(0.1)
    raise ClusterError(f"no replica of member {replicas[0].member} served within {seconds:g} s")


def routed(url: str, member: str, seconds: float = 30) -> None:
    """Until HAProxy sends the member's requests to its owner: a few answers in a row, so that its
    first health checks have had their say."""
    import urllib.request

    deadline = time.monotonic() + seconds
    in_a_row = 0
    while in_a_row < 4:
        if time.monotonic() > deadline:
            raise ClusterError(f"the front door did not route member {member} within {seconds:g} s")
        try:
            with urllib.request.urlopen(url, timeout=1) as answer:
                in_a_row = in_a_row + 1 if answer.status == 200 else 0
        except OSError:
            in_a_row = 0
        time.sleep(0.1)


def run_replicated(
    *,
    processes: int,
    port: int,
    data_dir: Path,
    host: str = "127.0.0.1",
    tls_cert: str | None = None,
    tls_key: str | None = None,
    serve_args: list[str] | None = None,
    etcd: str | None = None,
) -> int:
    check_arguments(processes, tls_cert, tls_key)
    found = haproxy_binary()
    data_dir.mkdir(parents=True, exist_ok=True)
    pem = front_door_pem(data_dir, tls_cert, tls_key)
    ids, epoch = member_ids(data_dir, processes)
    if port == 0:
        port = free_port(host)
    members = [Member(member_id, f"127.0.0.1:{free_port('127.0.0.1')}") for member_id in ids]
    placement = Placement.of(members, epoch)
    toml = data_dir / "cluster.toml"
    secret = cluster_secret(data_dir)
    replicas: dict[str, list[ReplicaProcess]] = {}
    machines = machine_addresses(len(members))
    for number, member in enumerate(members):
        pair = []
        for letter, machine in (("a", number), ("b", (number + 1) % len(members))):
            address = machines[machine]
            pair.append(
                ReplicaProcess(
                    member.id,
                    f"{member.id}{letter}",
                    f"{address}:{free_port(address)}",
                    f"{address}:{free_port(address)}",
                    data_dir / f"{member.id}{letter}",
                )
            )
        replicas[member.id] = pair
    write_toml(
        toml, members, placement.epoch, [Member(r.replica, r.http) for rs in replicas.values() for r in rs]
    )
    local_etcd: LocalEtcd | None = None
    if etcd is None:
        local_etcd = LocalEtcd(data_dir / "etcd", members=1)
        local_etcd.start()
        etcd = ",".join(local_etcd.endpoints)
        print(f"etcd at {etcd} (data in {data_dir / 'etcd'})", flush=True)
    lb = data_dir / "haproxy"
    config = haproxy.write(
        placement,
        lb,
        bind=host,
        port=port,
        tls_cert=None if pem is None else str(pem),
        replicas={m: [(r.replica, r.http) for r in rs] for m, rs in replicas.items()},
    )
    env = {**os.environ, "DS_CLUSTER__SECRET": secret}
    every = [r for rs in replicas.values() for r in rs]
    for replica in every:
        replica.command = [
            sys.executable, "-m", "streamkeep", "serve", *(serve_args or []), "--config", str(toml),
            "--cluster-member", replica.member, "--replicas", "2", "--replica", replica.replica,
            "--replication-listen", replica.replication, "--etcd", etcd,
            "--host", replica.http.rsplit(":", 1)[0], "--port", replica.http.rsplit(":", 1)[1], "--data-dir", str(replica.data_dir),
        ]  # fmt: skip
    stop = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    balancer: subprocess.Popen[Any] | None = None
    try:
        for replica in every:
            spawn(replica, env)
        for member in members:
            owner_up(replicas[member.id], every, env)
        checked = subprocess.run([found, "-c", "-q", "-f", str(config)], capture_output=True, text=True)
        if checked.returncode != 0:
            raise ClusterError(f"haproxy refused {config}: {checked.stdout}{checked.stderr}".strip())
        balancer = subprocess.Popen([found, "-db", "-f", str(config)])
        wait_until_listening(host, port, balancer)
        for member in members:  # through the front door, not only to the replicas themselves
            routed(f"http://{member.address}/healthz", member.id)
        scheme = "https" if pem is not None else "http"
        shown = f"[{host}]" if ":" in host else host
        for number, names in enumerate(hosts(ids)):
            print(f"machine {number} at {machines[number]}: replicas {', '.join(names)}")
        for member in members:
            pair = replicas[member.id]
            print(
                f"member {member.id}: {placement.slots_of(member.id)} of 4096 slots; replicas "
                + ", ".join(f"{r.replica} at http://{r.http} ({r.data_dir})" for r in pair)
            )
        print(f"streamkeep listening on {scheme}://{shown}:{port}", flush=True)
        while not stop:
            if balancer.poll() is not None:
                print(
                    f"haproxy exited with status {balancer.returncode}; stopping the cluster", file=sys.stderr
                )
                return 1
            now = time.monotonic()
            for replica in every:
                supervise(replica, env, now)
            time.sleep(0.1)
        return 0
    finally:
        children = [r.process for r in every if r.process is not None]
        stop_all(children if balancer is None else [balancer, *children])
        if local_etcd is not None:
            local_etcd.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def supervise(replica: ReplicaProcess, env: dict[str, str], now: float) -> None:
    process = replica.process
    if process is None:
        return
    if replica.restart_at is not None:
        if now >= replica.restart_at:
            replica.restart_at = None
            replica.restarts += 1
            spawn(replica, env)
        return
    status = process.poll()
    if status is None:
        return
    if now - replica.started > STEADY:
        replica.backoff = FIRST_BACKOFF
    if status == 2:  # a configuration error: starting it again would only say so again
        raise ClusterError(f"replica {replica.replica} refused its configuration; see its output above")
    why = "fenced: it stopped acknowledging, see its last lines" if status == 75 else f"status {status}"
    print(
        f"replica {replica.replica} exited ({why}); starting it again in {replica.backoff:g} s",
        file=sys.stderr,
        flush=True,
    )
    replica.restart_at = now + replica.backoff
    replica.backoff = min(MOST_BACKOFF, replica.backoff * 2)
