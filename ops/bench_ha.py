"""What high availability would cost an append, measured on this machine (docs/scaling.md).

    python -m ops.bench_ha [--samples 1000]

Today an append is acknowledged once its group commit is fdatasync'ed on the local disk. The two
designs of docs/scaling.md acknowledge later: (A) once a follower on another machine has it too,
(B) once the bucket has it. This measures the pieces each waits for; every sample is one call,
timed with time.perf_counter_ns() after a warm-up, and each measurement also stops at a time
budget of its own, so a run takes about a minute:

(a) the local disk: pwrite() of a 4 KiB append at the end of a growing file, then fdatasync(), on
    the file system holding the repository (the data disk); 64 KiB and 1 MiB per fdatasync, a group
    commit of 16 and 256 such appends; and, as root, 4 KiB on a tmpfs mounted under /tmp for the
    run (`mount -t tmpfs`, unmounted after): what a sync costs when nothing reaches a device.
(b) a follower: another process on loopback TCP (TCP_NODELAY) that receives a frame and answers one
    byte, first at once (the round trip alone), then after appending the frame to its own file on
    the data disk and fdatasync'ing it (4 KiB and 64 KiB frames). Loopback has no network in it:
    between two machines, add their round trip.
(c) the bucket: PutObject of 4 KiB and 1 MiB objects to a moto_server process on loopback (the S3
    stand-in the tests start, tests/test_cold.py `Moto`), with boto3 configured as the cold tier
    configures it but with one attempt per call; a conditional PutObject (If-None-Match: *) of 4 KiB
    to new keys, and whether a second one to a key already written is refused with 412 (design B's
    fence). moto is Python holding objects in memory: its figures are what the client, HTTP and
    signing cost on this machine, a floor under a real bucket's, not S3's service time.
(d) streamkeep as it is: `streamkeep serve --storage disk` on the data disk, one client, sequential
    4 KiB POSTs to one stream over one keep-alive HTTP/1.1 connection, with `--fsync always` (what is
    acknowledged is synced) and `--fsync never` (the same path without the sync).

It then estimates an append's latency under each design by adding independent draws from those
samples (the server without a sync, plus what that design waits for), and the appends per second a
member could make durable with one group-commit round in flight.
"""

from __future__ import annotations

import argparse
import http.client
import os
import platform
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

from ops.serverproc import ROOT, start

KIB = 1024
MIB = 1024 * KIB
FRAME = struct.Struct(">IB")  # follower frame header: payload length, 1 = append and fdatasync first
DRAWS = 20_000


@dataclass
class Row:
    label: str
    samples_ms: list[float]

    def q(self, fraction: float) -> float:
        ordered = sorted(self.samples_ms)
        return ordered[max(0, min(len(ordered) - 1, int(fraction * len(ordered) + 0.999999) - 1))]


def timed(call: Callable[[], None], samples: int, budget_s: float, warmup: int = 10) -> list[float]:
    """Milliseconds per call, `samples` of them or as many as fit in `budget_s`."""
    for _ in range(warmup):
        call()
    out: list[float] = []
    deadline = time.perf_counter() + budget_s
    for _ in range(samples):
        started = time.perf_counter_ns()
        call()
        out.append((time.perf_counter_ns() - started) / 1e6)
        if time.perf_counter() > deadline:
            break
    return out


def filesystem(path: Path) -> str:
    """'ext4 on /dev/vda': the mount holding `path`, from /proc/self/mounts."""
    target, best = str(path.resolve()), ("", "?", "?")
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            device, mount, fstype = line.split()[:3]
            mount = mount.replace("\\040", " ")
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best[0]):
                best = (mount, fstype, device)
    return f"{best[1]} on {best[2]}"


def data_disk_dir() -> Path:
    """A scratch directory on the repository's file system (/tmp when it is the same one)."""
    base = Path(tempfile.gettempdir())
    if os.stat(base).st_dev != os.stat(ROOT).st_dev:
        base = ROOT / "data"  # git-ignored
        base.mkdir(exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="bench_ha-", dir=base))


def fsync_appends(directory: Path, size: int, samples: int, budget_s: float) -> list[float]:
    """pwrite `size` bytes at the end of a growing file, then fdatasync: a commit round's work."""
    path = directory / f"appends-{size}.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    block = os.urandom(size)
    offset = 0

    def append() -> None:
        nonlocal offset
        written = os.pwrite(fd, block, offset)
        if written != size:
            raise OSError(f"short write: {written} of {size}")
        offset += written
        os.fdatasync(fd)

    try:
        return timed(append, samples, budget_s)
    finally:
        os.close(fd)
        path.unlink()


@contextmanager
def tmpfs() -> Iterator[Path | None]:
    """A tmpfs mounted under /tmp for the run and unmounted after (root only; else None)."""
    if os.geteuid() != 0:
        yield None
        return
    mountpoint = Path(tempfile.mkdtemp(prefix="bench_ha-tmpfs-", dir="/tmp"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(mountpoint)], capture_output=True
    )
    try:
        yield mountpoint if mounted.returncode == 0 else None
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", str(mountpoint)], check=False)
        mountpoint.rmdir()


# (b) The follower: a process of its own, `python -m ops.bench_ha --follower DIR`.


def recv_exact(connection: socket.socket, view: memoryview) -> bool:
    while view:
        got = connection.recv_into(view)
        if not got:
            return False
        view = view[got:]
    return True


def follower_main(directory: Path) -> None:
    """Prints its port, takes one connection, and answers each frame with one byte (after
    appending it to its file and fdatasync'ing, when the frame asks)."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    connection, _ = listener.accept()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    fd = os.open(directory / "follower.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    header = bytearray(FRAME.size)
    buffer = bytearray(4 * MIB)
    offset = 0
    while recv_exact(connection, memoryview(header)):
        length, sync = FRAME.unpack(header)
        payload = memoryview(buffer)[:length]
        if not recv_exact(connection, payload):
            break
        if sync:
            offset += os.pwrite(fd, payload, offset)
            os.fdatasync(fd)
        connection.sendall(b"A")
    os.close(fd)


class Follower:
    def __init__(self, directory: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ops.bench_ha", "--follower", str(directory)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        port = int(self.process.stdout.readline())
        self.socket = socket.create_connection(("127.0.0.1", port))
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._answer = bytearray(1)

    def round_trip(self, payload: bytes, sync: bool) -> None:
        self.socket.sendall(FRAME.pack(len(payload), int(sync)) + payload)
        if not recv_exact(self.socket, memoryview(self._answer)):
            raise ConnectionError("the follower hung up")

    def close(self) -> None:
        self.socket.close()
        self.process.wait(10)


# (c) The bucket.


def bucket_rows(samples: int) -> tuple[list[Row], str]:
    from botocore.config import Config
    from botocore.exceptions import ClientError

    from tests.test_cold import Moto

    moto = Moto()
    moto.start()
    try:
        client = moto.client(
            Config(retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=5, read_timeout=30)
        )
        client.create_bucket(Bucket="wal")
        rows = []
        for label, size, count, budget in (
            ("(c) S3 PutObject, 4 KiB (moto_server, loopback)", 4 * KIB, samples, 15.0),
            ("(c) S3 PutObject, 1 MiB (moto_server, loopback)", MIB, max(50, samples // 5), 15.0),
        ):
            body = os.urandom(size)
            keys = iter(range(1 << 30))

            def put(body: bytes = body, size: int = size, keys: Iterator[int] = keys) -> None:
                client.put_object(Bucket="wal", Key=f"plain/{size}/{next(keys):020d}", Body=body)

            rows.append(Row(label, timed(put, count, budget)))
        body = os.urandom(4 * KIB)
        keys = iter(range(1 << 30))

        def conditional_put() -> None:
            client.put_object(Bucket="wal", Key=f"log/{next(keys):020d}", Body=body, IfNoneMatch="*")

        rows.append(
            Row(
                "(c) S3 PutObject If-None-Match: *, 4 KiB, new key (moto_server)",
                timed(conditional_put, max(100, samples // 2), 8.0),
            )
        )
        try:
            client.put_object(Bucket="wal", Key=f"log/{0:020d}", Body=body, IfNoneMatch="*")
            fence = "a second conditional PutObject to a written key was ACCEPTED (no fence)"
        except ClientError as error:
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            fence = f"a second conditional PutObject to a written key was refused with {status}"
        return rows, fence
    finally:
        moto.stop()


# (d) streamkeep itself.


def streamkeep_appends(directory: Path, fsync: str, samples: int, budget_s: float) -> list[float]:
    server = start(
        "--storage", "disk", "--fsync", fsync, "--data-dir", str(directory), "--log-level", "warning"
    )
    try:
        parts = urlsplit(server.url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        headers = {"Content-Type": "application/octet-stream"}
        connection.request("PUT", "/v1/stream/bench-ha", headers=headers)
        response = connection.getresponse()
        response.read()
        if response.status not in (200, 201):
            raise RuntimeError(f"create answered {response.status}")
        body = os.urandom(4 * KIB)

        def append() -> None:
            connection.request("POST", "/v1/stream/bench-ha", body=body, headers=headers)
            answer = connection.getresponse()
            answer.read()
            if answer.status not in (200, 204):
                raise RuntimeError(f"append answered {answer.status}")

        try:
            return timed(append, samples, budget_s, warmup=50)
        finally:
            connection.close()
    finally:
        server.stop()


# Estimates and output.


def draws(combine: Callable[..., float], *rows: Row, seed: int = 16) -> Row:
    """`combine` of independent draws, one from each row's samples."""
    rng = random.Random(seed)
    return Row("", [combine(*(rng.choice(row.samples_ms) for row in rows)) for _ in range(DRAWS)])


def ms(value: float) -> str:
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 100 else f"{value:.0f}"


def rate(value: float) -> str:
    return f"{value:,.0f}"


def run(samples: int) -> str:
    started = time.monotonic()
    rows: dict[str, Row] = {}

    def add(key: str, label: str, values: list[float]) -> None:
        rows[key] = Row(label, values)

    disk = data_disk_dir()
    disk_fs = filesystem(disk)
    tmpfs_note = "not measured (needs root)"
    try:
        add(
            "a4", "(a) pwrite + fdatasync, 4 KiB append, data disk", fsync_appends(disk, 4 * KIB, samples, 15)
        )
        add(
            "a64",
            "(a) pwrite + fdatasync, 64 KiB (16 appends), data disk",
            fsync_appends(disk, 64 * KIB, max(100, samples // 4), 8),
        )
        add(
            "a1m",
            "(a) pwrite + fdatasync, 1 MiB (256 appends), data disk",
            fsync_appends(disk, MIB, max(50, samples // 10), 10),
        )
        with tmpfs() as memory:
            if memory is not None:
                add(
                    "t4",
                    "(a) pwrite + fdatasync, 4 KiB append, tmpfs",
                    fsync_appends(memory, 4 * KIB, samples, 5),
                )
                tmpfs_note = f"tmpfs mounted at {memory} for the run, then unmounted"

        follower_dir = Path(tempfile.mkdtemp(prefix="follower-", dir=disk))
        follower = Follower(follower_dir)
        try:
            small, large = os.urandom(4 * KIB), os.urandom(64 * KIB)
            add(
                "rtt",
                "(b) loopback TCP round trip, 4 KiB frame, 1-byte answer",
                timed(lambda: follower.round_trip(small, False), samples, 5),
            )
            add(
                "f4",
                "(b) follower round trip, 4 KiB, follower fdatasyncs first",
                timed(lambda: follower.round_trip(small, True), samples, 10),
            )
            add(
                "f64",
                "(b) follower round trip, 64 KiB, follower fdatasyncs first",
                timed(lambda: follower.round_trip(large, True), max(100, samples // 4), 8),
            )
        finally:
            follower.close()

        bucket, fence = bucket_rows(samples)
        for key, row in zip(("p4", "p1m", "c4"), bucket, strict=True):
            rows[key] = row

        appends = min(samples, 500)
        add(
            "d",
            "(d) streamkeep append round trip, 4 KiB, 1 client, --fsync always",
            streamkeep_appends(Path(tempfile.mkdtemp(prefix="server-", dir=disk)), "always", appends, 10),
        )
        add(
            "dn",
            "(d) streamkeep append round trip, 4 KiB, 1 client, --fsync never",
            streamkeep_appends(Path(tempfile.mkdtemp(prefix="server-", dir=disk)), "never", appends, 6),
        )
    finally:
        subprocess.run(["rm", "-rf", str(disk)], check=False)

    r = rows
    estimates = [
        ("today: local fdatasync (row d, measured)", r["d"], "measured"),
        (
            "today, modelled: server without sync + local fdatasync",
            draws(lambda d, a: d + a, r["dn"], r["a4"]),
            "dn + a(4 KiB): checks the model against the row above",
        ),
        (
            "A: local fdatasync and follower fdatasync, in parallel",
            draws(lambda d, a, f: d + max(a, f), r["dn"], r["a4"], r["f4"]),
            "dn + max(a, follower round trip with fdatasync); add the network RTT",
        ),
        (
            "A': follower acknowledges on receipt, syncs later",
            draws(lambda d, a, t: d + max(a, t), r["dn"], r["a4"], r["rtt"]),
            "dn + max(a, loopback round trip); add the network RTT",
        ),
        (
            "B: PutObject to the bucket (moto on loopback)",
            draws(lambda d, p: d + p, r["dn"], r["c4"]),
            "dn + conditional PutObject 4 KiB; a floor: real S3 adds its service time",
        ),
    ]
    throughput = [
        ("today: one fdatasync per round", 16 / (r["a64"].q(0.5) / 1e3), "16 appends / a(64 KiB) p50"),
        ("", 256 / (r["a1m"].q(0.5) / 1e3), "256 appends / a(1 MiB) p50"),
        (
            "A: local and follower fdatasync per round",
            16 / (max(r["a64"].q(0.5), r["f64"].q(0.5)) / 1e3),
            "16 appends / max(a(64 KiB), follower 64 KiB) p50, loopback",
        ),
        (
            "B: one PutObject per round, one in flight",
            256 / (r["p1m"].q(0.5) / 1e3),
            "256 appends / PutObject 1 MiB p50 (moto)",
        ),
    ]

    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"date: {now}; machine: {platform.node()}, {os.cpu_count()} CPUs; "
        f"{platform.python_implementation()} {platform.python_version()}; "
        f"command: python -m ops.bench_ha --samples {samples}; wall time {time.monotonic() - started:.0f} s",
        f"data disk: {disk_fs} (the repository's file system); {tmpfs_note}; {fence}.",
        "",
        "| measure | n | p50 (ms) | p99 (ms) | max (ms) |",
        "|---|---|---|---|---|",
    ]
    for row in rows.values():
        lines.append(
            f"| {row.label} | {len(row.samples_ms)} | {ms(row.q(0.5))} | {ms(row.q(0.99))} | "
            f"{ms(max(row.samples_ms))} |"
        )
    lines += [
        "",
        f"Estimated append round trip, 4 KiB, one client (sums of independent draws from the rows above, "
        f"{DRAWS:,} draws; dn = streamkeep with --fsync never, a = local 4 KiB fdatasync):",
        "",
        "| acknowledged when | p50 (ms) | p99 (ms) | how |",
        "|---|---|---|---|",
    ]
    for label, row, how in estimates:
        lines.append(f"| {label} | {ms(row.q(0.5))} | {ms(row.q(0.99))} | {how} |")
    lines += [
        "",
        "Durable appends/s of 4 KiB a member's storage path allows with one group-commit round in flight "
        "(HTTP and the server's CPU cap it lower, docs/benchmarks.md):",
        "",
        "| design | appends/s | from |",
        "|---|---|---|",
    ]
    for label, value, how in throughput:
        lines.append(f"| {label} | {rate(value)} | {how} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--samples", type=int, default=1000, help="samples per 4 KiB measurement (default 1000)"
    )
    parser.add_argument("--follower", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.follower is not None:
        follower_main(args.follower)
        return 0
    if args.samples < 10:
        parser.error("--samples must be at least 10")
    print(run(args.samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
