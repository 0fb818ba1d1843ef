"""Drives h2load (Debian's nghttp2-client) over HTTP/1.1 or h2c and reads back what it measured."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ops.loadtest.servers import cpu_seconds
from ops.serverproc import ServerProcess


@dataclass(frozen=True)
class Load:
    ok: int
    failed: int
    seconds: float
    cpu_seconds: float
    latencies_us: list[int]

    @property
    def per_second(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu_seconds / max(self.ok, 1) * 1e6

    def percentile_ms(self, fraction: float) -> float:
        ordered = sorted(self.latencies_us)
        return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))] / 1e3 if ordered else float("nan")


@dataclass(frozen=True)
class Counts:
    """What h2load says it did: requests answered 2xx, the others done, the run's length."""

    ok: int
    failed: int
    seconds: float


def parse(out: str) -> Counts:
    """h2load's summary. Every request done and not answered 2xx failed: a reply h2load could not
    read (an HTTP/1.1 status line without a reason phrase, as HAProxy relays an h2 answer) counts
    among its "failed" with no status code, which the status counts alone miss; "started" also
    counts the requests still in flight when a timed run ends, which did not fail."""
    finished = re.search(r"finished in ([\d.]+)(m?s)", out)
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    done = re.search(r"(\d+) started, (\d+) done", out)
    if not (finished and codes and done):
        raise RuntimeError("h2load output not understood:\n" + out)
    seconds = float(finished.group(1)) / (1000 if finished.group(2) == "ms" else 1)
    ok = int(codes.group(1))
    return Counts(ok, int(done.group(2)) - ok, seconds)


def parse_latencies(text: str) -> list[int]:
    """h2load's --log-file: start time, status, duration in µs, tab-separated, a request a line."""
    return [int(line.split("\t")[2]) for line in text.splitlines() if line.count("\t") >= 2]


def available() -> bool:
    return shutil.which("h2load") is not None


def run(
    server: ServerProcess,
    paths: list[str],
    *,
    clients: int,
    body: Path,
    content_type: str,
    h2: bool,
    seconds: float | None = None,
    count: int | None = None,
    latencies: bool = False,
    headers: tuple[str, ...] = (),
    cpus: str | None = None,
    rate: float | None = None,
) -> Load:
    """POSTs `body` to `paths` (each client cycles through all of them) for `seconds` or `count`;
    with `cpus` (a taskset list, "1"), h2load runs on those CPUs only; with `rate` (requests/s in
    all), each connection is paced at its share instead of sending as fast as it is answered."""
    with tempfile.TemporaryDirectory() as tmp:
        uris = Path(tmp) / "uris"
        uris.write_text("".join(server.url + path + "\n" for path in paths))
        log = Path(tmp) / "log"
        command = ["h2load", "-c", str(clients), "-m", "1", "-d", str(body), "-i", str(uris)]
        command += ["-H", f"Content-Type: {content_type}"]
        if rate is not None:
            command += ["--rps", f"{rate / clients:.3f}"]
        for header in headers:
            command += ["-H", header]
        command += ["-D", f"{round(seconds * 1000)}ms"] if seconds is not None else ["-n", str(count)]
        if not h2:
            command.append("--h1")
        if latencies:
            command += ["--log-file", str(log)]
        if cpus is not None:
            command = ["taskset", "-c", cpus, *command]
        before = cpu_seconds(server.process.pid)
        done = subprocess.run(command, capture_output=True, text=True, timeout=(seconds or 60) + 120)
        used = cpu_seconds(server.process.pid) - before
        counts = parse(done.stdout + done.stderr)
        samples = parse_latencies(log.read_text()) if latencies and log.exists() else []
        return Load(counts.ok, counts.failed, counts.seconds, used, samples)
