"""Appends through HAProxy to two single-writer processes, beside one process direct (issues 16, 26).

    python -m ops.bench_cluster [--seconds 4] [--storage memory|disk] [--clients 16] [--streams 64]
                                [--tail-share 0.8] [--rounds 1]

In one run on this machine: one `streamkeep serve` direct, then `streamkeep cluster run
--processes 2` (HAProxy in front, as it generates it), each loaded by h2load (`--clients`
connections, one 100 B append in flight each, cycling over `--streams` streams) over HTTP/1.1 and
over h2c, as fast as they are answered. Server CPU per append is read from /proc for every process
that serves, split into HAProxy and the members, so the front door's cost counts. Then the tail:
the cluster paced at `--tail-share` of the capacity it just showed over HTTP/1.1, where issue 26
wants no append slower than 100 ms; last, one process direct again, paced at the rate each member
took (half the cluster's): what part load alone costs a process, without the hop. Latency
p50/p99/max comes from h2load's log of every request.
Nothing is pinned: the cluster's point is to use every core. `--rounds` repeats the whole
sequence (this machine drifts; compare within a round). Prints Markdown tables and a projection of
appends/s on 16 cores from the measured CPU per append (a projection, not a measurement: it
assumes CPU is the limit and the cores scale linearly).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

from ops.loadtest import h2load
from ops.loadtest.servers import cpu_seconds
from ops.serverproc import ServerProcess, launch, start

DIRECT, FRONT = "1 process, direct", "2 processes behind HAProxy"
TARGET_CPU_RATIO, TARGET_H2_RATIO, TARGET_MAX_MS = 1.3, 0.9, 100.0


def children(pid: int) -> list[int]:
    """`pid` and every process below it (HAProxy and the members of `cluster run`)."""
    found = [pid]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == pid:
                found += children(int(entry.name))
    return found


def is_haproxy(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "haproxy"
    except OSError:
        return False


@dataclass(frozen=True)
class Row:
    setup: str
    protocol: str
    pace: str  # "saturated", or the paced rate
    load: h2load.Load
    haproxy_us: float  # CPU per append
    members_us: float

    @property
    def cpu_us(self) -> float:
        return self.haproxy_us + self.members_us


def create_streams(server: ServerProcess, count: int) -> list[str]:
    paths = [f"/v1/stream/bench-{time.time_ns()}-{i}" for i in range(count)]
    with httpx.Client(timeout=10) as client:
        for path in paths:
            answer = client.put(server.url + path, headers={"Content-Type": "text/plain"})
            if answer.status_code != 201:
                raise RuntimeError(f"create of {path} answered {answer.status_code}: {answer.text}")
    return paths


def measure(
    server: ServerProcess,
    paths: list[str],
    body: Path,
    *,
    setup: str,
    h2: bool,
    clients: int,
    seconds: float,
    rate: float | None = None,
) -> Row:
    pids = children(server.process.pid)
    proxies = [pid for pid in pids if is_haproxy(pid)]
    before = {pid: cpu_seconds(pid) for pid in pids}
    load = h2load.run(
        server,
        paths,
        clients=clients,
        body=body,
        content_type="text/plain",
        h2=h2,
        seconds=seconds,
        latencies=True,
        rate=rate,
    )
    used = {pid: cpu_seconds(pid) - before[pid] for pid in pids}
    if load.failed or not load.ok:
        raise RuntimeError(f"{load.failed} appends failed")
    proxy = sum(used[pid] for pid in proxies)
    pace = "saturated" if rate is None else f"paced at {rate:,.0f}/s"
    return Row(
        setup,
        "h2c" if h2 else "h1",
        pace,
        load,
        proxy / load.ok * 1e6,
        (sum(used.values()) - proxy) / load.ok * 1e6,
    )


def one_round(args: argparse.Namespace, work: Path, body: Path, number: int) -> list[Row]:
    rows: list[Row] = []
    storage = ["--storage", args.storage, "--log-level", "warning"]
    if args.storage == "disk":
        storage += ["--fsync", "always"]
    common = {"clients": args.clients, "seconds": args.seconds}
    progress(f"round {number}: one process, direct ...")
    single = start(*storage, "--data-dir", str(work / f"single-{number}"))
    try:
        paths = create_streams(single, args.streams)
        for h2 in (False, True):
            rows.append(measure(single, paths, body, setup=DIRECT, h2=h2, **common))
    finally:
        single.stop()
    progress(f"round {number}: 2 processes behind HAProxy ...")
    front = [sys.executable, "-m", "streamkeep", "cluster", "run", "--processes", "2", "--port", "0"]
    cluster = launch([*front, "--data-dir", str(work / f"cluster-{number}"), *storage], timeout=60)
    try:
        paths = create_streams(cluster, args.streams)
        for h2 in (False, True):
            rows.append(measure(cluster, paths, body, setup=FRONT, h2=h2, **common))
        rate = rows[-2].load.per_second * args.tail_share
        progress(f"round {number}: the tail, paced at {rate:,.0f} appends/s ...")
        tail = measure(cluster, paths, body, setup=FRONT, h2=False, rate=rate, **common)
    finally:
        cluster.stop()
    # What part load alone costs: one process direct at the rate each member of the cluster took.
    share = rows[-2].load.per_second / 2
    progress(f"round {number}: one process direct, paced at a member's share, {share:,.0f} appends/s ...")
    single = start(*storage, "--data-dir", str(work / f"paced-{number}"))
    try:
        paths = create_streams(single, args.streams)
        rows.append(measure(single, paths, body, setup=DIRECT, h2=False, rate=share, **common))
    finally:
        single.stop()
    return [*rows, tail]


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def haproxy_version() -> str:
    try:
        done = subprocess.run(["haproxy", "-v"], capture_output=True, text=True, timeout=10)
    except OSError:
        return "HAProxy missing"
    return done.stdout.splitlines()[0] if done.stdout else "HAProxy (no version)"


def report(rounds: list[list[Row]], args: argparse.Namespace) -> None:
    print(
        f"\ndate: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; machine: {platform.node()}, {os.cpu_count()} cores, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; CPython {platform.python_version()}; "
        f"{haproxy_version()}; storage {args.storage}; {args.clients} connections over {args.streams} streams, "
        "100 B appends; command: python -m ops.bench_cluster " + " ".join(sys.argv[1:]) + "\n"
    )
    print(
        "| round | setup | protocol | load | appends/s | CPU per append: all | HAProxy | members "
        "| p50 / p99 / max ms | 16-core projection |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for number, rows in enumerate(rounds, 1):
        for row in rows:
            load = row.load
            print(
                f"| {number} | {row.setup} | {row.protocol} | {row.pace} | {load.per_second:,.0f} "
                f"| {row.cpu_us:,.0f} µs | {row.haproxy_us:,.0f} µs | {row.members_us:,.0f} µs "
                f"| {load.percentile_ms(0.5):.1f} / {load.percentile_ms(0.99):.1f} / "
                f"{max(load.latencies_us, default=0) / 1e3:.1f} | {16e6 / row.cpu_us:,.0f}/s |"
            )
    print()
    for number, rows in enumerate(rounds, 1):
        by = {(row.setup, row.protocol, row.pace): row for row in rows}
        direct, front = by[(DIRECT, "h1", "saturated")], by[(FRONT, "h1", "saturated")]
        front_h2 = by[(FRONT, "h2c", "saturated")]
        paced, tail = rows[-2], rows[-1]
        tail_max = max(tail.load.latencies_us, default=0) / 1e3
        print(
            f"round {number}: CPU per append, front door / direct (h1): {front.cpu_us / direct.cpu_us:.2f}x "
            f"(target <= {TARGET_CPU_RATIO}x); h2c / h1 through the front door: "
            f"{front_h2.load.per_second / front.load.per_second:.2f}x (target >= {TARGET_H2_RATIO}x); "
            f"appends/s front door / direct (h1): {front.load.per_second / direct.load.per_second:.2f}x; "
            f"max latency at {args.tail_share:.0%} of capacity: {tail_max:.1f} ms (target < {TARGET_MAX_MS:.0f}); "
            f"one process direct at a member's share / saturated, CPU per append: "
            f"{paced.cpu_us / direct.cpu_us:.2f}x (what part load alone costs a member)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="per pass (default 4)")
    parser.add_argument("--storage", choices=("memory", "disk"), default="memory")
    parser.add_argument("--clients", type=int, default=16, help="h2load connections (default 16)")
    parser.add_argument("--streams", type=int, default=64, help="streams the appends cycle over (default 64)")
    parser.add_argument(
        "--tail-share", type=float, default=0.8, help="the tail pass's rate, of the cluster's capacity"
    )
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    if not h2load.available():
        print("h2load is missing: apt-get install nghttp2-client (make bench does)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        work = Path(tmp)
        body = work / "body"
        body.write_bytes(b"x" * 100)
        rounds = [one_round(args, work, body, number) for number in range(1, args.rounds + 1)]
    report(rounds, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
