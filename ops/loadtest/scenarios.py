"""The scenarios: each takes a running server and returns rows of measurements.

Appends are driven by h2load (a Python client tops out near 10k requests/s and would measure
itself); producers, catch-up reads and fan-out use the loops in `ops.loadtest.clients`.
"""

from __future__ import annotations

import http.client
import itertools
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from ops.loadtest import clients, h2load
from ops.loadtest.servers import cpu_seconds, rss_bytes
from ops.serverproc import ROOT, ServerProcess

TEXT = "text/plain"
_ids = itertools.count()


@dataclass
class Row:
    scenario: str
    protocol: str
    value: float  # the headline figure, in `unit`
    unit: str
    cpu_us: float | None = None  # server CPU per request
    extra: dict[str, float] = field(default_factory=dict)
    group: str = ""  # the scenario that measured it (ops.loadtest.__main__.SCENARIOS), set by the run


@dataclass(frozen=True)
class Settings:
    seconds: float
    work: Path  # scratch directory (bodies)
    fanout_small: int = 1000
    fanout_large: int = 10000
    cardinalities: tuple[int, ...] = (10, 1000, 10000)
    quick: bool = False


def connection(server: ServerProcess) -> http.client.HTTPConnection:
    parts = urlsplit(server.url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)


def create(server: ServerProcess, count: int, prefix: str, content_type: str = TEXT) -> list[str]:
    """Creates `count` new streams over one keep-alive connection; returns their paths."""
    conn = connection(server)
    run = next(_ids)
    paths = [f"/v1/stream/{prefix}-{run}-{i}" for i in range(count)]
    for path in paths:
        conn.request("PUT", path, headers={"Content-Type": content_type})
        response = conn.getresponse()
        response.read()
        if response.status not in (200, 201, 204):  # 204: the ceiling stores nothing
            raise RuntimeError(f"PUT {path}: {response.status}")
    conn.close()
    return paths


def body_file(settings: Settings, size: int) -> Path:
    path = settings.work / f"body-{size}"
    if not path.exists():
        path.write_bytes(b"x" * size)
    return path


def protocols(h2c: bool) -> list[tuple[str, bool]]:
    return [("h1", False), ("h2c", True)] if h2c else [("h1", False)]


def round_trip(server: ServerProcess, settings: Settings, h2c: bool) -> list[Row]:
    rows = []
    for name, h2 in protocols(h2c):
        [path] = create(server, 1, "rtt")
        load = h2load.run(
            server,
            [path],
            clients=1,
            body=body_file(settings, 100),
            content_type=TEXT,
            h2=h2,
            count=300 if settings.quick else 2000,
            latencies=True,
        )
        check(load, "round trip")
        rows.append(
            Row(
                "append round trip, 1 client, p50 (ms)",
                name,
                load.percentile_ms(0.5),
                "ms",
                load.cpu_us_per_request,
                {"p99 ms": load.percentile_ms(0.99)},
            )
        )
    return rows


def append_rate(
    server: ServerProcess,
    settings: Settings,
    paths: list[str],
    clients: int,
    h2: bool,
    label: str,
    protocol: str,
) -> Row:
    """100 B appends from h2load's `clients` connections, cycling over `paths`, for the set time."""
    load = h2load.run(
        server,
        paths,
        clients=clients,
        body=body_file(settings, 100),
        content_type=TEXT,
        h2=h2,
        seconds=settings.seconds,
    )
    check(load, label)
    return Row(label, protocol, load.per_second, "/s", load.cpu_us_per_request)


def throughput(server: ServerProcess, settings: Settings, h2c: bool) -> list[Row]:
    rows = []
    for name, h2 in protocols(h2c):
        # 64 clients over h2c adds little the 16-client run does not show; it is left out for time.
        for count in (16,) if settings.quick or h2 else (16, 64):
            for shape in ("own streams", "one shared stream"):
                paths = create(server, count if shape == "own streams" else 1, "tp")
                rows.append(
                    append_rate(
                        server, settings, paths, count, h2, f"appends/s, {count} clients, {shape}", name
                    )
                )
    return rows


def big_appends(server: ServerProcess, settings: Settings, h2c: bool) -> list[Row]:
    rows = []
    for name, h2 in protocols(h2c):
        paths = create(server, 4, "mib", "application/octet-stream")
        load = h2load.run(
            server,
            paths,
            clients=4,
            body=body_file(settings, 1 << 20),
            content_type="application/octet-stream",
            h2=h2,
            count=40 if settings.quick else 160,
        )
        check(load, "1 MiB appends")
        rows.append(
            Row("1 MiB appends, 4 clients (MiB/s)", name, load.per_second, "MiB/s", load.cpu_us_per_request)
        )
    return rows


def cardinality(server: ServerProcess, settings: Settings, h2c: bool) -> list[Row]:
    rows = []
    for streams in settings.cardinalities:
        paths = create(server, streams, f"card{streams}")
        rows.append(
            append_rate(
                server, settings, paths, 16, False, f"appends/s, 16 clients over {streams:,} streams", "h1"
            )
        )
    return rows


def check(load: h2load.Load, what: str) -> None:
    if load.failed or not load.ok:
        raise RuntimeError(f"{what}: {load.ok} succeeded, {load.failed} failed")


def producers(server: ServerProcess, settings: Settings, h2c: bool) -> list[Row]:
    [path] = create(server, 1, "producers", "application/json")
    before = cpu_seconds(server.process.pid)
    acked, duplicates = clients.producers(server.url, path, 16, settings.seconds)
    used = cpu_seconds(server.process.pid) - before
    if duplicates:
        raise RuntimeError(f"producers: {duplicates} fresh appends were reported as duplicates")
    rate = acked / settings.seconds
    return [
        Row(
            "idempotent producers, 16 on one stream (appends/s)", "h1", rate, "/s", used / max(acked, 1) * 1e6
        )
    ]


CLIENT_PRODUCERS = 4
CLIENT_MESSAGE = b"m" * 100


def client_producer(server: ServerProcess, settings: Settings, h2c: bool) -> list[Row]:
    """The project's own client (streamkeep.client, issue 24): one IdempotentProducer per stream,
    batching on, appending 100 B messages as fast as it takes them. Not a load generator like the
    socket loops (it runs in this process and measures itself too): the row says what an
    application using the client gets from each server. ops/bench_client.py sets it beside h2load
    and the PyPI client on streamkeep alone.

    HTTP/1.1 only: over h2c, pipelined batches whose bodies together pass the 64 KiB window stall
    in httpcore until the read timeout (concurrent uploads on one HTTP/2 connection: a raw httpx
    loop of 5 concurrent 100 KB POSTs times out against both of streamkeep's edges; upstream,
    pydantic/httpx2 issue 1133), so an h2c row would measure that stall (1,299 messages/s against
    131,360 over HTTP/1.1, streamkeep memory, 2026-11-26)."""
    import asyncio

    rows = []
    for protocol, h2 in protocols(False):
        paths = create(server, CLIENT_PRODUCERS, f"client-producer-{protocol}", "application/octet-stream")
        before = cpu_seconds(server.process.pid)
        started = time.monotonic()
        acked = asyncio.run(_client_producers(server.url, paths, settings.seconds, h2))
        elapsed = time.monotonic() - started
        used = cpu_seconds(server.process.pid) - before
        rows.append(
            Row(
                f"streamkeep.client producers, {CLIENT_PRODUCERS} streams, 100 B messages (messages/s)",
                protocol,
                acked / elapsed,
                "/s",
                used / max(acked, 1) * 1e6,
            )
        )
    return rows


async def _client_producers(url: str, paths: list[str], seconds: float, http2: bool) -> int:
    """Messages acknowledged: every producer appends until the time is up, then flushes (a failed
    batch raises: a scenario that lost messages must not report them)."""
    import asyncio

    from streamkeep.client import Client

    async def one(path: str) -> int:
        sent = 0
        async with Client(url, http2=http2) as client:
            stream = client.stream(path, content_type="application/octet-stream")
            async with stream.producer(f"load-{path.rsplit('/', 1)[-1]}", linger=0.005) as producer:
                ends = time.monotonic() + seconds
                while time.monotonic() < ends:
                    for _ in range(1000):
                        producer.append(CLIENT_MESSAGE)
                    sent += 1000
                    if sent % 20_000 == 0:  # appends outrun any server: keep the backlog small
                        await producer.flush()
                    else:
                        await asyncio.sleep(0)
                await producer.flush()
        return sent

    return sum(await asyncio.gather(*(one(path) for path in paths)))


def catch_up(server: ServerProcess, settings: Settings, h2c: bool) -> list[Row]:
    mib = 10 if settings.quick else 50
    [path] = create(server, 1, "catchup", "application/octet-stream")
    load = h2load.run(
        server,
        [path],
        clients=1,
        body=body_file(settings, 1 << 20),
        content_type="application/octet-stream",
        h2=False,
        count=mib,
    )
    check(load, "filling the catch-up stream")
    rates = []
    before = cpu_seconds(server.process.pid)
    for _ in range(3):
        size, seconds = clients.catch_up(server.url, path)
        if size != mib << 20:
            raise RuntimeError(f"catch-up read {size} bytes, expected {mib << 20}")
        rates.append(size / seconds / (1 << 20))
    used = cpu_seconds(server.process.pid) - before
    return [
        Row(
            f"catch-up read of a {mib} MiB stream (MiB/s, median of 3)",
            "h1",
            sorted(rates)[1],
            "MiB/s",
            extra={"server CPU s per GiB": used / (3 * mib) * 1024},
        )
    ]


def fan_out(
    server: ServerProcess, settings: Settings, mode: str, readers: int, rate: float, seconds: float
) -> Row:
    """`readers` live readers (SSE or long-poll) on one stream while one writer appends at `rate`/s.

    A server that cannot take the appends at that rate slows the writer; past four times the planned
    time the writer stops early, and the row says what rate it reached.
    """
    label = f"{mode} fan-out, {readers:,} readers, {rate:g} msg/s: delivery p50 (ms)"
    [path] = create(server, 1, f"fan-{mode}", "application/json")
    pid = server.process.pid
    rss_before = rss_bytes(pid)
    out = settings.work / f"fan-{mode}-{readers}.json"
    command = [sys.executable, "-m", "ops.loadtest.subscribers", server.url, path]
    command += ["--count", str(readers), "--mode", mode, "--offset", "now", "--out", str(out)]
    command += ["--deadline", str(seconds * 4 + 30)]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"{mode} readers did not connect: {line!r}")
    rss_connected = rss_bytes(pid)
    cpu_before = cpu_seconds(pid)
    conn = connection(server)
    planned = int(rate * seconds)
    started = time.monotonic()
    peak = rss_connected
    sent = 0
    while sent < planned and time.monotonic() - started < seconds * 4:
        delay = started + sent / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        post(conn, path, b'{"i":%d,"t":%.6f}' % (sent, time.time()))
        sent += 1
        if sent % 20 == 0:
            peak = max(peak, rss_bytes(pid))
    achieved = sent / (time.monotonic() - started)
    post(conn, path, b'{"i":-1,"t":%.6f}' % time.time())
    line = proc.stdout.readline()  # "done": every reader has every message, or the deadline passed
    cpu = cpu_seconds(pid) - cpu_before
    if proc.wait(timeout=seconds * 4 + 120) != 0 or line.strip() != "done":
        raise RuntimeError(f"{mode} readers failed")
    conn.close()
    results = json.loads(out.read_text())
    expected = [*range(sent), -1]
    wrong = [_first_difference(r["i"], expected) for r in results if r["i"] != expected]
    if wrong or len(results) != readers:
        return Row(label, "h1", float("nan"), "ms", extra={"readers missing messages": len(wrong)})
    # Delivery delay of each message to each reader; the slowest reader of each message says how long
    # the message took to reach everyone.
    delays = sorted(d for r in results for d in r["delay"][:-1])
    slowest = [max(r["delay"][n] for r in results) for n in range(sent)]
    extra = {
        "p99 ms": delays[int(len(delays) * 0.99)] * 1e3,
        "all reached (max ms)": max(slowest) * 1e3,
        "KB per reader": (max(peak, rss_connected) - rss_before) / readers / 1024,
    }
    if achieved < rate * 0.9:
        extra["writer reached msg/s"] = achieved
    return Row(label, "h1", delays[len(delays) // 2] * 1e3, "ms", cpu / (sent * readers) * 1e6, extra)


def post(conn: http.client.HTTPConnection, path: str, body: bytes) -> None:
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    if response.status not in (200, 204):
        raise RuntimeError(f"fan-out append answered {response.status}")


def sse_fan_out(server: ServerProcess, settings: Settings, h2c: bool) -> list[Row]:
    return [fan_out(server, settings, "sse", settings.fanout_small, 100, 2 if settings.quick else 3)]


def sse_fan_out_large(server: ServerProcess, settings: Settings, h2c: bool) -> list[Row]:
    return [fan_out(server, settings, "sse", settings.fanout_large, 2, 5)]


def long_poll_fan_out(server: ServerProcess, settings: Settings, h2c: bool) -> list[Row]:
    return [fan_out(server, settings, "long-poll", settings.fanout_small, 10, 2 if settings.quick else 3)]


def _first_difference(got: list[int], expected: list[int]) -> str:
    for index, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            return f"at {index}: got {got[index : index + 5]}, expected {expected[index : index + 5]}"
    return f"got {len(got)} messages, expected {len(expected)}"
