"""Durable append benchmark: streamkeep (disk, fsync=always) beside the Node reference server
(file-backed, fsync per append), same machine, same load, one run.

    python -m ops.bench_disk [--seconds 5] [--clients 16]

Load comes from h2load over HTTP/1.1 (Debian's nghttp2-client; a Python client tops out first):
16 clients each appending 100 B to its own stream, then 16 clients on one shared stream. Latency is
a single client's sequential appends (p50/p99). Server CPU per append comes from /proc.
"""

from __future__ import annotations

import argparse
import http.client
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

from ops.loadtest.servers import cpu_seconds, node
from ops.serverproc import ROOT, ServerProcess, start

BENCH_DIR = ROOT / "ops" / "bench"
PAYLOAD = b"x" * 100
CT = "text/plain"


@dataclass
class Result:
    server: str
    scenario: str
    appends_per_s: float
    cpu_us_per_append: float
    note: str = ""


def start_node(data_dir: Path) -> ServerProcess:
    return node(data_dir)


def request(url: str, method: str, path: str, body: bytes = b"") -> int:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    connection.request(method, path, body=body, headers={"Content-Type": CT})
    status = connection.getresponse().status
    connection.close()
    return status


def h2load(urls: list[str], clients_each: int, seconds: float, body_file: Path) -> tuple[int, int]:
    """Runs one h2load per URL at once; returns (2xx responses, other responses)."""
    procs = [
        subprocess.Popen(
            [
                "h2load",
                "--h1",
                "-c",
                str(clients_each),
                "-m",
                "1",
                "-D",
                f"{seconds:g}",
                "-d",
                str(body_file),
                "-H",
                f"Content-Type: {CT}",
                url,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for url in urls
    ]
    ok = bad = 0
    for proc in procs:
        out, _ = proc.communicate(timeout=seconds + 60)
        match = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
        if not match:
            raise RuntimeError("h2load output not understood:\n" + out)
        ok += int(match.group(1))
        bad += int(match.group(2)) + int(match.group(3)) + int(match.group(4))
    return ok, bad


def throughput(
    server: ServerProcess,
    name: str,
    scenario: str,
    paths: list[str],
    clients_each: int,
    seconds: float,
    body_file: Path,
) -> Result:
    before = cpu_seconds(server.process.pid)
    started = time.monotonic()
    ok, bad = h2load([server.url + p for p in paths], clients_each, seconds, body_file)
    elapsed = time.monotonic() - started
    cpu = cpu_seconds(server.process.pid) - before
    if bad:
        raise RuntimeError(f"{name} {scenario}: {bad} non-2xx responses")
    return Result(name, scenario, ok / elapsed, cpu / max(ok, 1) * 1e6)


def latency(server: ServerProcess, path: str, count: int) -> tuple[float, float]:
    parts = urlsplit(server.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        connection.request("POST", path, body=PAYLOAD, headers={"Content-Type": CT})
        response = connection.getresponse()
        response.read()
        samples.append(time.perf_counter() - started)
        if response.status not in (200, 204):
            raise RuntimeError(f"append answered {response.status}")
    connection.close()
    samples.sort()
    return statistics.median(samples) * 1e3, samples[int(len(samples) * 0.99) - 1] * 1e3


def run(seconds: float, clients: int) -> str:
    if shutil.which("h2load") is None:
        raise SystemExit("h2load is missing: apt-get install nghttp2-client (make bench does)")
    results: list[Result] = []
    latencies: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        body_file = Path(tmp) / "body"
        body_file.write_bytes(PAYLOAD)

        def streamkeep(method: str) -> ServerProcess:
            data = f"{tmp}/sk-{method}"
            return start(
                "--storage",
                "disk",
                "--data-dir",
                data,
                "--fsync",
                "always",
                "--sync-method",
                method,
                "--log-level",
                "warning",
            )

        servers = {
            "streamkeep disk": lambda: streamkeep("fdatasync"),
            "streamkeep disk syncfs": lambda: streamkeep("syncfs"),
            "node file-backed": lambda: start_node(Path(tmp) / "node"),
        }
        for name, launch in servers.items():
            server = launch()
            try:
                own = [f"/v1/stream/own-{i}" for i in range(clients)]
                for path in [*own, "/v1/stream/shared", "/v1/stream/latency"]:
                    assert request(server.url, "PUT", path) == 201
                print(f"{name}: {clients} clients on their own streams ...", flush=True)
                results.append(throughput(server, name, "own streams", own, 1, seconds, body_file))
                print(f"{name}: {clients} clients on one shared stream ...", flush=True)
                results.append(
                    throughput(
                        server, name, "shared stream", ["/v1/stream/shared"], clients, seconds, body_file
                    )
                )
                print(f"{name}: sequential latency ...", flush=True)
                latencies[name] = latency(server, "/v1/stream/latency", 500)
            finally:
                server.stop()
    return report(results, latencies, seconds, clients)


def report(
    results: list[Result], latencies: dict[str, tuple[float, float]], seconds: float, clients: int
) -> str:
    by = {(r.server, r.scenario): r for r in results}
    lines = [
        f"date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; machine: {platform.node()}, {os.cpu_count()} cores, "
        f"{platform.python_implementation()} {platform.python_version()}; {seconds:g} s per scenario, "
        f"{clients} clients, 100 B appends, HTTP/1.1",
        "",
        "| scenario | streamkeep disk (appends/s) | node file-backed (appends/s) | ratio | "
        "streamkeep CPU/append | node CPU/append |",
        "|---|---|---|---|---|---|",
    ]
    for scenario in ("own streams", "shared stream"):
        node = by[("node file-backed", scenario)]
        for name in ("streamkeep disk", "streamkeep disk syncfs"):
            sk = by[(name, scenario)]
            lines.append(
                f"| {clients} clients, {scenario}, {name.removeprefix('streamkeep disk').strip() or 'fdatasync'} | "
                f"{sk.appends_per_s:,.0f} | {node.appends_per_s:,.0f} | {sk.appends_per_s / node.appends_per_s:.2f}x | "
                f"{sk.cpu_us_per_append:.0f} us | {node.cpu_us_per_append:.0f} us |"
            )
    for name, (p50, p99) in latencies.items():
        lines.append(f"| 1 client sequential latency, {name} | p50 {p50:.2f} ms | p99 {p99:.2f} ms | | | |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=16)
    args = parser.parse_args()
    if not (BENCH_DIR / "node_modules").is_dir():
        print("ops/bench/node_modules is missing: run `make bench` (it runs npm ci)", file=sys.stderr)
        return 2
    print(run(args.seconds, args.clients))
    return 0


if __name__ == "__main__":
    sys.exit(main())
