"""How fast streamkeep.client writes and reads, beside h2load and the PyPI client (issue 24, point 4).

    python -m ops.bench_client [--seconds 5] [--streams 4] [--read-mib 64] [--pypi-python PATH]

One streamkeep server (`--storage disk`, fsync as `make serve` has it) on this machine:

1. appends: h2load with `--streams` HTTP/2 connections, one request in flight each, appending
   100 B to a stream of its own for `--seconds`: appends/s (what one POST per message gives). Then
   `--streams` idempotent producers of ours (one client each, HTTP/2, one connection), appending
   100 B messages as fast as they are taken for the same time (a flush every 20,000 keeps memory
   bounded): messages/s that the server acknowledged. Then, where `--pypi-python` names an
   interpreter with `durable-streams==0.1.0` (the PyPI client; asyncio only), its batching
   `AsyncDurableStream.append` from 64 concurrent tasks per stream: messages/s.
2. catch-up: a stream of `--read-mib` MiB of 1 KiB messages read from offset -1 to its end: MiB/s
   of a plain httpx GET loop (following Stream-Next-Offset: the server's and the disk's speed),
   of our `Stream.read(live=False)`, and of the PyPI client's `stream(live=False)`.

Ratios within this one run are what to read: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from ops.loadtest import h2load
from ops.serverproc import ServerProcess, start
from streamkeep.client import Client

MESSAGE = b"x" * 100
TEXT = {"Content-Type": "application/octet-stream"}

PYPI_APPENDS = """
import asyncio, sys, time
from durable_streams import AsyncDurableStream

async def one(url, seconds, counts):
    async with AsyncDurableStream(url, content_type="application/octet-stream") as stream:
        ends = time.monotonic() + seconds
        async def worker():
            while time.monotonic() < ends:
                await stream.append(b"x" * 100)
                counts[0] += 1
        await asyncio.gather(*(worker() for _ in range(64)))

async def main():
    urls, seconds = sys.argv[1].split(","), float(sys.argv[2])
    counts = [0]
    started = time.monotonic()
    await asyncio.gather(*(one(url, seconds, counts) for url in urls))
    print(counts[0] / (time.monotonic() - started))

asyncio.run(main())
"""

PYPI_READ = """
import asyncio, sys, time
from durable_streams import astream

async def main():
    started = time.monotonic()
    total = 0
    async with astream(sys.argv[1], offset="-1", live=False) as response:
        async for chunk in response:
            total += len(chunk)
    print(total, time.monotonic() - started)

asyncio.run(main())
"""


def make_streams(server: ServerProcess, prefix: str, count: int) -> list[str]:
    paths = [f"/v1/stream/{prefix}-{time.time_ns()}-{n}" for n in range(count)]
    with httpx.Client(timeout=10) as client:
        for path in paths:
            assert client.put(server.url + path, headers=TEXT).status_code == 201
    return paths


def tail(server: ServerProcess, path: str) -> int:
    """The stream's length in bytes, from its Stream-Next-Offset."""
    answer = httpx.head(server.url + path, timeout=10)
    return int(answer.headers["stream-next-offset"].rsplit("_", 1)[-1])


async def our_producers(server: ServerProcess, paths: list[str], seconds: float) -> float:
    """Messages/s acknowledged: every producer appends until the time is up, then flushes."""

    async def one(path: str) -> int:
        sent = 0
        async with Client(server.url, http2=True) as client:
            stream = client.stream(path, content_type="application/octet-stream")
            async with stream.producer(f"bench-{path.rsplit('/', 1)[-1]}") as producer:
                ends = time.monotonic() + seconds
                while time.monotonic() < ends:
                    for _ in range(1000):
                        producer.append(MESSAGE)
                    sent += 1000
                    if sent % 20_000 == 0:
                        await producer.flush()
                    else:
                        await asyncio.sleep(0)
                await producer.flush()
        return sent

    started = time.monotonic()
    counts = await asyncio.gather(*(one(path) for path in paths))
    return sum(counts) / (time.monotonic() - started)


def fill(server: ServerProcess, path: str, mib: int) -> None:
    """`mib` MiB of 1 KiB messages, 256 per POST (one JSON-free byte stream)."""
    chunk = b"y" * 1024
    with httpx.Client(timeout=30) as client:
        for _ in range(mib * 4):
            answer = client.post(server.url + path, headers=TEXT, content=chunk * 256)
            assert answer.status_code in (200, 204), answer.status_code


def plain_read(server: ServerProcess, path: str) -> float:
    """MiB/s of GETs following Stream-Next-Offset until up to date."""
    total, offset, started = 0, "-1", time.monotonic()
    with httpx.Client(timeout=30) as client:
        while True:
            answer = client.get(server.url + path, params={"offset": offset})
            total += len(answer.content)
            offset = answer.headers["stream-next-offset"]
            if answer.headers.get("stream-up-to-date") == "true":
                break
    return total / (time.monotonic() - started) / (1 << 20)


async def our_read(server: ServerProcess, path: str) -> float:
    total, started = 0, time.monotonic()
    async with Client(server.url) as client:
        async with client.stream(path).read(offset="-1", live=False) as reader:
            async for batch in reader:
                total += len(batch.data)
    return total / (time.monotonic() - started) / (1 << 20)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--read-mib", type=int, default=64)
    parser.add_argument("--pypi-python", help="an interpreter with durable-streams==0.1.0 installed")
    args = parser.parse_args()
    if not h2load.available():
        print("h2load is not installed (make h2load)", file=sys.stderr)
        return 2
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-client-") as data:
        server = start("--storage", "disk", "--data-dir", data, "--log-level", "warning")
        try:
            body = Path(data) / "body"
            body.write_bytes(MESSAGE)
            paths = make_streams(server, "h2load", args.streams)
            load = h2load.run(
                server, paths, clients=args.streams, body=body, content_type=TEXT["Content-Type"], h2=True,
                seconds=args.seconds,
            )  # fmt: skip
            results["h2load appends/s"] = load.per_second
            paths = make_streams(server, "producer", args.streams)
            results["streamkeep.client producer messages/s"] = asyncio.run(
                our_producers(server, paths, args.seconds)
            )
            assert sum(tail(server, p) for p in paths) > 0
            if args.pypi_python:
                paths = make_streams(server, "pypi", args.streams)
                urls = ",".join(server.url + p for p in paths)
                done = subprocess.run(
                    [args.pypi_python, "-c", PYPI_APPENDS, urls, str(args.seconds)],
                    capture_output=True, text=True, timeout=args.seconds * 10 + 60, check=True,
                )  # fmt: skip
                results["durable-streams 0.1.0 messages/s"] = float(done.stdout.strip())
            (path,) = make_streams(server, "read", 1)
            fill(server, path, args.read_mib)
            results["plain GET loop MiB/s"] = plain_read(server, path)
            results["streamkeep.client reader MiB/s"] = asyncio.run(our_read(server, path))
            if args.pypi_python:
                done = subprocess.run(
                    [args.pypi_python, "-c", PYPI_READ, server.url + path],
                    capture_output=True, text=True, timeout=600, check=True,
                )  # fmt: skip
                total, seconds = done.stdout.split()
                results["durable-streams 0.1.0 reader MiB/s"] = int(total) / float(seconds) / (1 << 20)
        finally:
            server.stop()
    print(
        f"\ndate: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; machine: {platform.node()}, {os.cpu_count()} cores; "
        f"CPython {platform.python_version()}; command: python -m ops.bench_client " + " ".join(sys.argv[1:])
    )
    print("\n| measure | value | vs h2load / vs plain GET |\n|---|---|---|")
    for name, value in results.items():
        base = (
            results["h2load appends/s"]
            if "/s" in name and "MiB" not in name
            else results["plain GET loop MiB/s"]
        )
        print(f"| {name} | {value:,.1f} | {value / base:.2f}x |")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
