"""Soak under churn: does the server hold its descriptors and memory flat over time?

    python -m ops.soak --minutes 30 [--cold] [--seed N] [--tracemalloc]   (make soak DURATION=30)

Starts a real `streamkeep serve` (disk storage in a temporary directory; with `--cold` also a moto
S3 server and the cold tier, with small segments so rotation and uploads never stop), then runs a
seeded churn for the given time: writers create streams, append to them (plain and idempotent
producers), delete them (while appends and live reads are in flight) and create them again under
the same names; readers follow them live (SSE and long-poll, staying connected a while) and catch
up from the start. Every 10 s it samples the server process: open descriptors, how many of them
are on deleted files, RSS, threads, and the answers so far by status.

Verdict: "flat" when the median of the last third of the samples is within the tolerance of the
median of the middle third (descriptors: +10 % or +8, whichever is more, since live readers come
and go; RSS: +10 %, since Python's allocator keeps what it once used, so only growth that goes on
counts). The first third is warm-up (caches fill, the allocator grows). Any 5xx answer fails it.
Exit status 1 unless flat and no 5xx. It also prints the slope of RSS over the last half (least
squares, KiB per minute) beside the streams created per minute, so a slow leak shows as bytes per
stream created. `--tracemalloc` runs the server under tracemalloc (ops/traced_serve.py; about half
as fast) and prints where the memory kept between the middle and the end of the run was allocated.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ops.serverproc import ServerProcess, launch, start

SAMPLE_EVERY = 10.0
NAMES = 24
T = {"Content-Type": "text/plain"}


@dataclass
class Sample:
    at: float
    fds: int
    deleted_fds: int
    rss_kib: int
    threads: int
    requests: int
    creates: int = 0


@dataclass
class Tally:
    statuses: Counter[int] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    creates: int = 0  # PUTs answered 201: streams that did not exist before

    def add(self, status: int, *, create: bool = False) -> None:
        with self.lock:
            self.statuses[status] += 1
            self.creates += create and status == 201


def sample(pid: int, started: float, tally: Tally) -> Sample:
    fds = deleted = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        fds += 1
        try:
            deleted += fd.readlink().name.endswith(" (deleted)")
        except OSError:
            pass
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    with tally.lock:
        requests = sum(tally.statuses.values())
        creates = tally.creates
    return Sample(
        time.monotonic() - started,
        fds,
        deleted,
        int(status["VmRSS"].split()[0]),
        int(status["Threads"]),
        requests,
        creates,
    )


def growth(samples: list[Sample]) -> tuple[float, float]:
    """Over the last half of the samples: RSS's least-squares slope (KiB a minute) and the streams
    created a minute (their ratio is what a leak costs per stream created)."""
    half = samples[len(samples) // 2 :]
    if len(half) < 2 or half[-1].at <= half[0].at:
        return 0.0, 0.0
    minutes = [s.at / 60 for s in half]
    mean_t, mean_r = statistics.fmean(minutes), statistics.fmean(s.rss_kib for s in half)
    spread = sum((t - mean_t) ** 2 for t in minutes)
    slope = sum((t - mean_t) * (s.rss_kib - mean_r) for t, s in zip(minutes, half, strict=True)) / spread
    creates = (half[-1].creates - half[0].creates) / (minutes[-1] - minutes[0])
    return slope, creates


def top_growth(folder: Path, count: int = 15) -> list[str]:
    """Where the memory kept between the middle snapshot and the last was allocated (by traceback,
    the newest frames first), from ops/traced_serve.py's snapshots."""
    snapshots = sorted(folder.glob("*.snapshot"))
    if len(snapshots) < 2:
        return [f"tracemalloc: only {len(snapshots)} snapshots"]
    first, last = snapshots[len(snapshots) // 2], snapshots[-1]
    old, new = tracemalloc.Snapshot.load(str(first)), tracemalloc.Snapshot.load(str(last))
    stats = new.compare_to(old, "traceback")
    total = sum(stat.size_diff for stat in stats)
    totals = [int(line.split()[1]) for line in (folder / "traced.txt").read_text().splitlines()]
    trend = " ".join(f"{value / 1024:.0f}" for value in totals[:: max(1, len(totals) // 12)])
    lines = [
        f"tracemalloc: traced KiB over the run: {trend}",
        f"tracemalloc: {total / 1024:+.0f} KiB traced from {first.stem} to {last.stem}; top growth:",
    ]
    for stat in [stat for stat in stats if stat.size_diff > 0][:count]:
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(stat.traceback))
        lines.append(f"  {stat.size_diff:+9d} B {stat.count_diff:+6d} blocks  {where}")
    return lines


def verdict(samples: list[Sample]) -> tuple[bool, str]:
    """Flat or not, and why: the last third's medians against the middle third's (see above)."""
    if len(samples) < 6:
        return False, f"only {len(samples)} samples: run longer (at least a minute)"
    third = len(samples) // 3
    middle, last = samples[third : 2 * third], samples[2 * third :]
    reasons = []
    fds_mid, fds_last = statistics.median(s.fds for s in middle), statistics.median(s.fds for s in last)
    if fds_last > max(fds_mid * 1.10, fds_mid + 8):
        reasons.append(f"descriptors grew from a median of {fds_mid:.0f} to {fds_last:.0f}")
    rss_mid, rss_last = (
        statistics.median(s.rss_kib for s in middle),
        statistics.median(s.rss_kib for s in last),
    )
    if rss_last > rss_mid * 1.10:
        reasons.append(f"RSS grew from a median of {rss_mid / 1024:.1f} MiB to {rss_last / 1024:.1f} MiB")
    deleted = max(s.deleted_fds for s in last)
    if deleted > 2:
        reasons.append(f"up to {deleted} descriptors open on deleted files in the last third")
    if reasons:
        return False, "; ".join(reasons)
    return True, (
        f"flat: descriptors {fds_mid:.0f} -> {fds_last:.0f} (median, middle third -> last third), "
        f"RSS {rss_mid / 1024:.1f} -> {rss_last / 1024:.1f} MiB"
    )


class Churn:
    def __init__(self, url: str, seed: int, tally: Tally, stop: threading.Event) -> None:
        self.url = url
        self.seed = seed
        self.tally = tally
        self.stop = stop

    def writer(self, number: int) -> None:
        rng = random.Random(f"{self.seed}/writer/{number}")
        seqs: Counter[str] = Counter()
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.is_set():
                name = f"/v1/stream/soak-{rng.randrange(NAMES)}"
                roll = rng.random()
                try:
                    if roll < 0.04:
                        response = client.delete(name)
                        seqs[name] = 0
                    elif roll < 0.10:
                        response = client.put(name, headers=T)
                        self.tally.add(response.status_code, create=True)
                        continue
                    elif roll < 0.55:
                        body = rng.randbytes(rng.randint(10, 4000)).hex().encode()
                        response = client.post(name, content=body, headers=T)
                    else:
                        producer = {
                            **T,
                            "Producer-Id": f"w{number}",
                            "Producer-Epoch": "0",
                            "Producer-Seq": str(seqs[name]),
                        }
                        response = client.post(name, content=b"p%d;" % seqs[name], headers=producer)
                        if response.status_code in (200, 204):
                            seqs[name] += 1
                        elif response.status_code in (404, 409):
                            seqs[name] = int(response.headers.get("producer-expected-seq", 0))
                except httpx.HTTPError:
                    continue
                self.tally.add(response.status_code)

    def reader(self, number: int) -> None:
        rng = random.Random(f"{self.seed}/reader/{number}")
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.is_set():
                name = f"/v1/stream/soak-{rng.randrange(NAMES)}"
                roll = rng.random()
                try:
                    if roll < 0.4:  # SSE, connected for a while
                        with client.stream("GET", name, params={"offset": "-1", "live": "sse"}) as sse:
                            self.tally.add(sse.status_code)
                            until = time.monotonic() + rng.uniform(1, 8)
                            for _ in sse.iter_bytes():
                                if time.monotonic() > until or self.stop.is_set():
                                    break
                    elif roll < 0.7:
                        response = client.get(name, params={"offset": "now", "live": "long-poll"})
                        self.tally.add(response.status_code)
                    else:
                        response = client.get(name, params={"offset": "-1"})
                        self.tally.add(response.status_code)
                except httpx.HTTPError:
                    continue


def run(  # type: ignore[no-untyped-def]
    minutes: float,
    seed: int,
    cold: bool,
    writers: int,
    readers: int,
    *,
    every: float = SAMPLE_EVERY,
    out=print,
    traced: int = 0,
) -> tuple[bool, list[Sample], Tally]:
    tally = Tally()
    stop = threading.Event()
    moto = None
    with tempfile.TemporaryDirectory() as data:
        snapshots = Path(data) / "tracemalloc"
        args = [
            "--storage",
            "disk",
            "--data-dir",
            data,
            "--segment-max-bytes",
            "256KiB",
            "--long-poll-timeout",
            "5",
        ]
        env = None
        if cold:
            from tests.test_cold import CREDENTIALS, Moto

            moto = Moto()
            moto.start()
            args += ["--cold-url", "s3://soak/p", "--cold-endpoint", moto.url, "--cold-create-bucket"]
            args += ["--segment-max-age", "5"]
            env = CREDENTIALS
        if traced:  # the same server under tracemalloc (`traced` frames deep), a snapshot every sample
            command = [sys.executable, "-m", "ops.traced_serve", str(snapshots), str(every), str(traced)]
            server: ServerProcess = launch([*command, "serve", "--port", "0", *args], env=env, timeout=60)
        else:
            server = start(*args, env=env)
        churn = Churn(server.url, seed, tally, stop)
        threads = [threading.Thread(target=churn.writer, args=(i,), daemon=True) for i in range(writers)]
        threads += [threading.Thread(target=churn.reader, args=(i,), daemon=True) for i in range(readers)]
        for thread in threads:
            thread.start()
        started = time.monotonic()
        samples: list[Sample] = []
        out(
            f"soak: {minutes:g} min, seed {seed}, {writers} writers, {readers} readers, cold tier {'on' if cold else 'off'}"
        )
        try:
            while time.monotonic() - started < minutes * 60:
                time.sleep(every)
                if not server.alive:
                    out("the server died:\n" + "".join(server.output[-30:]))
                    return False, samples, tally
                current = sample(server.process.pid, started, tally)
                samples.append(current)
                out(
                    f"  {current.at:7.0f} s  fds {current.fds:4d} ({current.deleted_fds} deleted)  "
                    f"RSS {current.rss_kib / 1024:6.1f} MiB  threads {current.threads:3d}  "
                    f"requests {current.requests}  creates {current.creates}"
                )
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=40)
            server.stop()
            if moto is not None:
                moto.stop()
            traced_lines = top_growth(snapshots) if traced else []
            shutil.rmtree(snapshots, ignore_errors=True)
    flat, why = verdict(samples)
    errors = {status: n for status, n in tally.statuses.items() if status >= 500}
    out("")
    out("| sample | s | fds | on deleted files | RSS MiB | threads | requests | creates |")
    out("|---|---|---|---|---|---|---|---|")
    for number, s in enumerate(samples, 1):
        out(
            f"| {number} | {s.at:.0f} | {s.fds} | {s.deleted_fds} | {s.rss_kib / 1024:.1f} | {s.threads} "
            f"| {s.requests} | {s.creates} |"
        )
    out("")
    out(f"answers by status: {dict(sorted(tally.statuses.items()))}")
    slope, creates = growth(samples)
    per_stream = f", {slope * 1024 / creates:.0f} bytes per stream created" if creates else ""
    out(
        f"last half: RSS {slope:+.0f} KiB a minute (least squares), {creates:.0f} streams created a minute"
        f"{per_stream}"
    )
    for line in traced_lines:
        out(line)
    out(f"verdict: {why}; {'no 5xx' if not errors else f'5xx answers: {errors}'}")
    return flat and not errors, samples, tally


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cold", action="store_true", help="also run the cold tier on a moto S3 server")
    parser.add_argument("--writers", type=int, default=12)
    parser.add_argument("--readers", type=int, default=12)
    parser.add_argument(
        "--tracemalloc",
        action="store_true",
        help="run the server under tracemalloc and say where memory grew",
    )
    args = parser.parse_args()
    ok, _, _ = run(args.minutes, args.seed, args.cold, args.writers, args.readers, traced=args.tracemalloc)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
