"""Appends through HAProxy to two single-writer processes, beside one process direct (issue 16).

    python -m ops.bench_cluster [--seconds 4] [--storage memory|disk]

In one run on this machine: one `streamkeep serve` direct, then `streamkeep cluster run
--processes 2` (HAProxy in front), each loaded by h2load (16 connections, 100 B appends to 16
streams of their own) over HTTP/1.1 and over h2c. Server CPU per append is read from /proc for
every process that serves (HAProxy and the members together), so the front door's cost counts.
Nothing is pinned: the cluster's point is to use every core. Prints a Markdown table and a
projection of appends/s on 16 cores from the measured CPU per append (a projection, not a
measurement: it assumes CPU is the limit and the cores scale linearly).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from ops.loadtest import h2load
from ops.loadtest.servers import cpu_seconds
from ops.serverproc import ServerProcess, launch, start

CLIENTS = 16


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


def measure(server: ServerProcess, body: Path, h2: bool, seconds: float) -> tuple[float, float]:
    """(appends/s, server CPU us per append) of CLIENTS connections appending to streams of their own."""
    paths = [f"/v1/stream/bench-{time.time_ns()}-{i}" for i in range(CLIENTS)]
    with httpx.Client(timeout=10) as client:
        for path in paths:
            assert client.put(server.url + path, headers={"Content-Type": "text/plain"}).status_code == 201
    pids = children(server.process.pid)
    before = sum(cpu_seconds(pid) for pid in pids)
    load = h2load.run(
        server, paths, clients=CLIENTS, body=body, content_type="text/plain", h2=h2, seconds=seconds
    )
    used = sum(cpu_seconds(pid) for pid in pids) - before
    if load.failed or not load.ok:
        raise RuntimeError(f"{load.failed} appends failed")
    return load.per_second, used / load.ok * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--storage", choices=("memory", "disk"), default="memory")
    args = parser.parse_args()
    if not h2load.available():
        print("h2load is missing: apt-get install nghttp2-client (make bench does)", file=sys.stderr)
        return 2
    rows: list[tuple[str, str, float, float]] = []
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        work = Path(tmp)
        body = work / "body"
        body.write_bytes(b"x" * 100)
        storage = ["--storage", args.storage, "--log-level", "warning"]
        if args.storage == "disk":
            storage += ["--fsync", "always"]
        print("one process, direct ...", flush=True)
        single = start(*storage, "--data-dir", str(work / "single"))
        try:
            for protocol, h2 in (("h1", False), ("h2c", True)):
                rows.append(("1 process, direct", protocol, *measure(single, body, h2, args.seconds)))
        finally:
            single.stop()
        print("2 processes behind HAProxy ...", flush=True)
        front = [sys.executable, "-m", "streamkeep", "cluster", "run", "--processes", "2", "--port", "0"]
        cluster = launch([*front, "--data-dir", str(work / "cluster"), *storage], timeout=60)
        try:
            for protocol, h2 in (("h1", False), ("h2c", True)):
                rows.append(
                    ("2 processes behind HAProxy", protocol, *measure(cluster, body, h2, args.seconds))
                )
        finally:
            cluster.stop()
    print(
        f"\ndate: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; machine: {platform.node()}, {os.cpu_count()} cores, "
        f"CPython {platform.python_version()}; storage {args.storage}; command: python -m ops.bench_cluster "
        + " ".join(sys.argv[1:])
        + "\n"
    )
    print("| setup | protocol | appends/s | server CPU per append (all processes) | 16-core projection |")
    print("|---|---|---|---|---|")
    for setup, protocol, rate, cpu in rows:
        print(f"| {setup} | {protocol} | {rate:,.0f} | {cpu:,.0f} us | {16e6 / cpu:,.0f}/s |")
    by = {(setup, protocol): rate for setup, protocol, rate, _ in rows}
    front_h1, front_h2 = by[("2 processes behind HAProxy", "h1")], by[("2 processes behind HAProxy", "h2c")]
    print(
        f"\nh2c through the front door / h1 through the front door: {front_h2 / front_h1:.2f}x (target 0.9x)"
    )
    print(
        f"front door (2 processes) / 1 process direct, h1: {front_h1 / by[('1 process, direct', 'h1')]:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
