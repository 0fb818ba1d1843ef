"""Soak under churn: does the server hold its descriptors and memory flat over time?

    python -m ops.soak --minutes 30 [--cold] [--seed N] [--tracemalloc]   (make soak DURATION=30)
    python -m ops.soak --minutes 120 --replicas 2 [--processes 2] --writers 4 --readers 4

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

`--replicas 2` soaks a replicated cluster instead: `streamkeep cluster run --processes N --replicas 2
--fsync always` (its own etcd and HAProxy; disk storage in a temporary directory), waits until every
member's follower is in sync, and points the churn at the front door. Every sample then covers
every process of the cluster, found as the children of the `cluster run` supervisor: each member's
two replicas (owner and follower: `m0a`, `m0b`, ...), etcd, HAProxy, and the supervisor itself.
The verdict holds per process (one that grows fails the run), with a table of them and each one's
RSS slope. A replica the supervisor restarts is a finding (it fails the run) and its new process is
a new series (`m0a#2`). At the end the followers must be in sync again within a minute.
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
from collections.abc import Callable
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


def start_churn(
    url: str, seed: int, tally: Tally, stop: threading.Event, writers: int, readers: int
) -> list[threading.Thread]:
    churn = Churn(url, seed, tally, stop)
    threads = [threading.Thread(target=churn.writer, args=(i,), daemon=True) for i in range(writers)]
    threads += [threading.Thread(target=churn.reader, args=(i,), daemon=True) for i in range(readers)]
    for thread in threads:
        thread.start()
    return threads


def run(
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
        threads = start_churn(server.url, seed, tally, stop, writers, readers)
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


# ---- a replicated cluster (`--replicas 2`) ------------------------------------------------------


def cluster_command(data: Path, processes: int) -> list[str]:
    """`cluster run --replicas 2` with the single server's serve flags (disk storage, small
    segments, short long-polls), every commit synced on both replicas."""
    return [
        sys.executable, "-m", "streamkeep", "cluster", "run", "--processes", str(processes),
        "--replicas", "2", "--port", "0", "--data-dir", str(data / "cluster"), "--fsync", "always",
        "--no-ui", "--storage", "disk", "--segment-max-bytes", "256KiB", "--long-poll-timeout", "5",
    ]  # fmt: skip


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (by /proc/*/stat: this kernel has no task/*/children)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            found.append(int(entry.name))
    return sorted(found)


def argument(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args[:-1] else None


def process_name(args: list[str]) -> str:
    """A replica by its `--replica` (m0a, m0b, ...); anything else by its program (etcd, haproxy)."""
    return argument(args, "--replica") or Path(args[0]).name


def cluster_processes(supervisor: int) -> list[tuple[str, int]]:
    """The supervisor and its children, by name. A child between fork and exec still shows the
    supervisor's command line: left out."""
    own = cmdline(supervisor)
    found = [("supervisor", supervisor)]
    for pid in children(supervisor):
        args = cmdline(pid)
        if args and args != own:
            found.append((process_name(args), pid))
    return found


def follower_in_sync(url: str) -> dict[str, bool]:
    """Per member: its owner says its follower is in sync (the front door's /stats?cluster=1, as
    tests/test_replication_cluster.py's `Cluster.stats` reads it)."""
    with httpx.Client(timeout=3) as client:
        views = client.get(f"{url}/stats?cluster=1").json()["members"]
    return {
        member: isinstance(view, dict) and bool((view.get("replication") or {}).get("follower_in_sync"))
        for member, view in views.items()
    }


def wait_redundant(url: str, members: int, seconds: float) -> dict[str, bool]:
    """Until every member's follower is in sync (`Cluster.wait_redundant` of the tests, for any
    number of members); the last view either way."""
    deadline = time.monotonic() + seconds
    last: dict[str, bool] = {}
    while time.monotonic() < deadline:
        try:
            last = follower_in_sync(url)
        except (httpx.HTTPError, KeyError, ValueError):
            last = {}
        if len(last) == members and all(last.values()):
            break
        time.sleep(0.5)
    return last


def replica_roles(supervisor: int) -> dict[str, str]:
    """Each replica's role now: the owner answers /healthz on its address, a follower does not listen."""
    roles = {}
    for pid in children(supervisor):
        args = cmdline(pid)
        name, host, port = argument(args, "--replica"), argument(args, "--host"), argument(args, "--port")
        if name is None or host is None or port is None:
            continue
        try:
            answer = httpx.get(f"http://{host}:{port}/healthz", timeout=2)
            roles[name] = "owner" if answer.status_code == 200 else f"follower ({answer.status_code})"
        except httpx.HTTPError:
            roles[name] = "follower"
    return dict(sorted(roles.items()))


@dataclass
class Watch:
    """Every process's samples, one series per process: a process that takes the place of another
    of the same name (the supervisor restarted it) starts a new series, `m0a#2`, and is a restart."""

    started: float
    series: dict[str, list[Sample]] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)  # series -> its process
    latest: dict[str, str] = field(default_factory=dict)  # name -> its current series
    restarts: list[str] = field(default_factory=list)

    def label(self, name: str, pid: int) -> str:
        current = self.latest.get(name)
        if current is not None and self.pids[current] == pid:
            return current
        label = name
        if current is not None:
            label = f"{name}#{sum(1 for known in self.pids if known.split('#')[0] == name) + 1}"
            at = time.monotonic() - self.started
            self.restarts.append(f"{name}: pid {self.pids[current]} -> {pid} (series {label}) by {at:.0f} s")
        self.latest[name], self.pids[label] = label, pid
        return label

    def take(self, processes: list[tuple[str, int]], tally: Tally) -> dict[str, Sample]:
        taken = {}
        for name, pid in processes:
            try:
                current = sample(pid, self.started, tally)
            except (OSError, KeyError):  # it ended between the listing and the sample
                continue
            label = self.label(name, pid)
            self.series.setdefault(label, []).append(current)
            taken[label] = current
        return taken


def sample_line(taken: dict[str, Sample]) -> str:
    first = next(iter(taken.values()))
    parts = [f"{label} {s.rss_kib / 1024:.1f}M/{s.fds}fd" for label, s in sorted(taken.items())]
    return f"  {first.at:7.0f} s  requests {first.requests}  creates {first.creates}  | " + "  ".join(parts)


def process_row(label: str, pid: int, role: str, samples: list[Sample]) -> tuple[str, bool]:
    """One row of the per-process table, and whether the process held flat (a series too short
    for a verdict, a restarted process's, does not fail by itself: its restart does)."""
    flat, why = verdict(samples)
    short = len(samples) < 6
    third = max(1, len(samples) // 3)
    middle, last = samples[third : 2 * third] or samples, samples[2 * third :] or samples
    fds = f"{statistics.median(s.fds for s in middle):.0f} -> {statistics.median(s.fds for s in last):.0f}"
    rss = (
        f"{statistics.median(s.rss_kib for s in middle) / 1024:.1f} -> "
        f"{statistics.median(s.rss_kib for s in last) / 1024:.1f}"
    )
    slope, creates = growth(samples)
    per_stream = f"{slope * 1024 / creates:.0f}" if creates else "-"
    said = "too short" if short else ("flat" if flat else f"NOT FLAT: {why}")
    row = (
        f"| {label} | {pid} | {role} | {len(samples)} | {fds} | {max(s.deleted_fds for s in samples)} "
        f"| {rss} | {samples[0].rss_kib / 1024:.1f} -> {samples[-1].rss_kib / 1024:.1f} "
        f"| {samples[-1].threads} | {slope:+.0f} | {per_stream} | {said} |"
    )
    return row, flat or short


def trend(samples: list[Sample], points: int = 12) -> str:
    return " ".join(f"{s.rss_kib / 1024:.1f}" for s in samples[:: max(1, len(samples) // points)])


def cluster_report(watch: Watch, tally: Tally, roles: dict[str, str], out: Callable[[str], object]) -> bool:
    """The per-process table and trends; whether every process held flat."""
    out("")
    out(
        "| process | pid | role | samples | fds (median, middle -> last third) | max on deleted files "
        "| RSS MiB (median, middle -> last third) | RSS MiB first -> last | threads "
        "| RSS KiB/min (last half) | bytes per stream created | verdict |"
    )
    out("|---|---|---|---|---|---|---|---|---|---|---|---|")
    all_flat = True
    for label, samples in sorted(watch.series.items()):
        row, flat = process_row(label, watch.pids[label], roles.get(label.split("#")[0], ""), samples)
        out(row)
        all_flat = all_flat and flat
    out("")
    out("RSS MiB over the run (every ~1/12 of the samples):")
    for label, samples in sorted(watch.series.items()):
        out(f"  {label}: {trend(samples)}")
    return all_flat


def run_cluster(
    minutes: float,
    seed: int,
    writers: int,
    readers: int,
    *,
    processes: int = 2,
    every: float = SAMPLE_EVERY,
    out: Callable[[str], object] = print,
) -> tuple[bool, Watch, Tally]:
    """The soak on a replicated cluster (see the module docstring)."""
    tally, stop = Tally(), threading.Event()
    threads: list[threading.Thread] = []
    with tempfile.TemporaryDirectory(prefix="soak-cluster-") as data:
        cluster = launch(cluster_command(Path(data), processes), timeout=180)
        supervisor = cluster.process.pid
        watch = Watch(time.monotonic())
        roles_before: dict[str, str] = {}
        roles: dict[str, str] = {}
        died = True
        try:
            synced = wait_redundant(cluster.url, processes, 180)
            out(
                f"soak: {minutes:g} min, seed {seed}, {writers} writers, {readers} readers, replicated "
                f"cluster of {processes} members at {cluster.url} (data in {data}); followers in sync: {synced}"
            )
            roles_before = replica_roles(supervisor)
            out(f"roles: {roles_before}")
            threads = start_churn(cluster.url, seed, tally, stop, writers, readers)
            watch.started = time.monotonic()
            died = soak_cluster(cluster, watch, tally, minutes * 60, every, out)
            roles = {} if died else replica_roles(supervisor)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=40)
        synced_after = {} if died else wait_redundant(cluster.url, processes, 60)
        cluster.stop(timeout=60)
    exits = [line.strip() for line in cluster.output if " exited (" in line]
    flat = cluster_report(watch, tally, roles, out)
    errors = {status: n for status, n in tally.statuses.items() if status >= 500}
    out("")
    out(f"answers by status: {dict(sorted(tally.statuses.items()))}")
    out(f"streams created: {tally.creates} ({tally.creates / minutes:.0f} a minute)")
    out(f"roles at the start: {roles_before}; at the end: {roles}")
    out(f"followers in sync after the churn: {synced_after}")
    out(f"restarts: {watch.restarts or 'none'}")
    for line in exits:
        out(f"  supervisor: {line}")
    in_sync = len(synced_after) == processes and all(synced_after.values())
    ok = flat and not errors and not watch.restarts and not died and in_sync
    reasons = [
        "every process flat" if flat else "a process grew (see the table)",
        "no 5xx" if not errors else f"5xx answers: {errors}",
        "no restarts" if not watch.restarts else f"{len(watch.restarts)} restarts",
        "followers in sync" if in_sync else "followers NOT in sync after the churn",
    ]
    if died:
        reasons.append("the cluster died")
    out(f"verdict: {'flat' if ok else 'NOT flat'}: {'; '.join(reasons)}")
    return ok, watch, tally


def soak_cluster(
    cluster: ServerProcess,
    watch: Watch,
    tally: Tally,
    seconds: float,
    every: float,
    out: Callable[[str], object],
) -> bool:
    """Samples every process each `every` seconds for `seconds`; True if the cluster died."""
    while time.monotonic() - watch.started < seconds:
        time.sleep(every)
        if not cluster.alive:
            out("the cluster died:\n" + "".join(cluster.output[-40:]))
            return True
        taken = watch.take(cluster_processes(cluster.process.pid), tally)
        if taken:
            out(sample_line(taken))
    return False


def arguments(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
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
        type=int,
        nargs="?",
        const=8,
        default=0,
        metavar="FRAMES",
        help="run the server under tracemalloc (FRAMES deep, 8 if not said) and say where memory grew",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        choices=(1, 2),
        help="2: soak a replicated cluster (`cluster run --replicas 2`) through its front door",
    )
    parser.add_argument(
        "--processes", type=int, default=2, help="with --replicas 2: the cluster's members (default 2)"
    )
    return parser, parser.parse_args(argv)


def main() -> int:
    parser, args = arguments()
    if args.replicas == 2:
        if args.cold or args.tracemalloc:
            parser.error("--cold and --tracemalloc are for the single server, not --replicas 2")
        ok = run_cluster(args.minutes, args.seed, args.writers, args.readers, processes=args.processes)[0]
    else:
        ok = run(args.minutes, args.seed, args.cold, args.writers, args.readers, traced=args.tracemalloc)[0]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
