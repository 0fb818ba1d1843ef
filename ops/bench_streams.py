"""Many streams on one disk server: creates/s, RSS per idle stream, appends over all of them.

    python -m ops.bench_streams [--streams 100000] [--clients 64] [--hot 1024] [--json FILE]

One real `streamkeep serve --storage disk` process (fsync always) with a short `--hibernate-after`:

1. creates `--streams` streams with `--clients` connections (PUT, h2load over HTTP/1.1);
2. RSS (from /proc) before, after creating, and after every stream actor hibernated (it waits for
   /stats `actors_active` to fall back to where it was before the creates, not a fixed time);
3. appends (100 B POSTs) spread over all the streams, then the same count over `--hot` streams,
   and their ratio (issue 26: appends over 100,000 streams >= 0.9x appends over 1,024). The hot
   streams were appended to in the first phase too, so they start awake, with their descriptors
   open; `--hot-from-idle` waits until they hibernated again, so both phases start from idle
   streams and the ratio shows only what the number of streams costs.

h2load starts every connection at the top of its URI list (`-i`), so one h2load with 64
connections over N URIs would create only N/64 streams and re-PUT them; each connection here is its
own h2load process with its own slice of the URIs, so every create is a new stream and every
append phase touches each URI of its set equally.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from ops.loadtest import h2load
from ops.loadtest.servers import rss_bytes
from ops.serverproc import ServerProcess, start

CT = "text/plain"
PAYLOAD = b"x" * 100
PROGRESS_EVERY = 5.0  # seconds between progress lines


def cpu_split(pid: int) -> tuple[float, float]:
    """User and system CPU seconds the process has used so far, from /proc (a create is split
    about evenly between Python and the kernel's file work, so the report keeps them apart)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


@dataclass
class Phase:
    ok: int
    failed: int
    seconds: float
    user_seconds: float
    sys_seconds: float
    # the failed ones by h2load's status classes; "unanswered": no status (a connection error)
    failures: dict[str, int] = field(default_factory=dict)

    @property
    def cpu_seconds(self) -> float:
        return self.user_seconds + self.sys_seconds

    @property
    def per_second(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0


@dataclass
class Report:
    streams: int
    clients: int
    hot: int
    server_args: list[str]
    creates_per_s: float
    create_failures: int
    create_cpu_us: float
    create_user_us: float
    create_sys_us: float
    streams_seen: int
    rss_before: int
    rss_created: int
    rss_hibernated: int
    rss_per_idle_stream: float
    hibernate_wait_s: float
    appends_all_per_s: float
    appends_hot_per_s: float
    # Server CPU per append of each phase: where "all" costs more than "hot", and how much
    append_all_cpu_us: float
    append_hot_cpu_us: float
    append_failures: int
    append_failure_classes: dict[str, int]
    ratio: float
    load: str
    hot_from_idle: bool = False  # the hot phase began once every stream hibernated again


def stats(server: ServerProcess) -> dict:
    with urllib.request.urlopen(server.url + "/stats", timeout=10) as response:
        return json.loads(response.read())


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_slices(
    server: ServerProcess,
    slices: list[list[str]],
    work: Path,
    *,
    label: str,
    create: bool,
    requests_each: int | None = None,
    total: int,
) -> Phase:
    """One h2load process per connection, each over its own slice of paths, all at once; a
    progress line every PROGRESS_EVERY seconds (streams counted by /stats for creates)."""
    body = work / "body"
    body.write_bytes(PAYLOAD)
    procs = []
    streams_at_start = stats(server)["streams"] if create else 0
    user_before, sys_before = cpu_split(server.process.pid)
    started = time.monotonic()
    for number, paths in enumerate(slices):
        uris = work / f"{label}-{number}.uris"
        uris.write_text("".join(server.url + path + "\n" for path in paths))
        command = ["h2load", "--h1", "-c", "1", "-m", "1", "-i", str(uris), "-H", f"content-type: {CT}"]
        command += ["-n", str(requests_each if requests_each is not None else len(paths))]
        command += ["-H", ":method: PUT"] if create else ["-d", str(body)]
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs: list[str] = []
    told = started
    for proc in procs:
        while True:
            try:
                out, _ = proc.communicate(timeout=0.5)
                outputs.append(out)
                break
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() - told >= PROGRESS_EVERY:
                told = time.monotonic()
                elapsed = told - started
                if create:
                    made = stats(server)["streams"] - streams_at_start
                    print(
                        f"  {label}: {made}/{total} streams in {elapsed:.0f} s ({made / elapsed:.0f}/s)",
                        flush=True,
                    )
                else:
                    print(f"  {label}: {elapsed:.0f} s ...", flush=True)
    seconds = time.monotonic() - started
    user_after, sys_after = cpu_split(server.process.pid)
    counts = [h2load.parse(out) for out in outputs]
    ok, failed = sum(c.ok for c in counts), sum(c.failed for c in counts)
    return Phase(
        ok,
        failed,
        seconds,
        user_after - user_before,
        sys_after - sys_before,
        failure_classes(outputs, failed),
    )


def failure_classes(outputs: list[str], failed: int) -> dict[str, int]:
    """What the failed requests were answered, so a failure in a report says where to look."""
    classes = {"3xx": 0, "4xx": 0, "5xx": 0}
    for out in outputs:
        codes = re.search(r"status codes: \d+ 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
        if codes is not None:
            for name, count in zip(classes, codes.groups(), strict=True):
                classes[name] += int(count)
    classes["unanswered"] = failed - sum(classes.values())
    return {name: count for name, count in classes.items() if count}


def split(paths: list[str], parts: int) -> list[list[str]]:
    return [paths[i::parts] for i in range(parts) if paths[i::parts]]


def wait_for_hibernation(server: ServerProcess, awake_before: int, timeout: float) -> float:
    """Seconds until /stats says the actors woken by the creates are gone (polled: the server
    runs in another process)."""
    started = time.monotonic()
    while stats(server)["actors_active"] > awake_before:
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"actors still awake after {timeout:.0f} s: {stats(server)['actors_active']}")
        time.sleep(0.25)
    return time.monotonic() - started


def bench(args: argparse.Namespace) -> Report:
    with tempfile.TemporaryDirectory(prefix="bench-streams-") as tmp:
        work = Path(tmp)
        server_args = [
            "--storage",
            "disk",
            "--data-dir",
            str(work / "data"),
            "--hibernate-after",
            f"{args.hibernate_after:g}",
            *args.server_arg,
        ]
        server = start(*server_args)
        try:
            pid = server.process.pid
            time.sleep(0.5)  # the start's own allocations settle
            before = stats(server)
            rss_before = rss_bytes(pid)
            paths = [f"/v1/stream/bench/s{i:07d}" for i in range(args.streams)]
            print(f"creating {args.streams} streams with {args.clients} connections ...", flush=True)
            created = run_slices(
                server, split(paths, args.clients), work, label="create", create=True, total=args.streams
            )
            rss_created = rss_bytes(pid)
            streams_seen = stats(server)["streams"] - before["streams"]
            print(f"waiting for {args.streams} actors to hibernate ...", flush=True)
            waited = wait_for_hibernation(server, before["actors_active"], args.hibernate_after * 4 + 120)
            time.sleep(0.5)  # what hibernation freed is returned to the allocator's pools
            rss_hibernated = rss_bytes(pid)
            appends = args.appends or args.streams
            each = max(1, appends // args.clients)
            print(f"appending {each * args.clients} x 100 B over all {args.streams} streams ...", flush=True)
            all_streams = run_slices(
                server,
                split(paths, args.clients),
                work,
                label="append-all",
                create=False,
                requests_each=each,
                total=appends,
            )
            hot = paths[: args.hot]
            if args.hot_from_idle:
                print("waiting for the streams to hibernate again ...", flush=True)
                wait_for_hibernation(server, before["actors_active"], args.hibernate_after * 4 + 120)
            print(f"appending {each * args.clients} x 100 B over {len(hot)} streams ...", flush=True)
            hot_streams = run_slices(
                server,
                split(hot, args.clients),
                work,
                label="append-hot",
                create=False,
                requests_each=each,
                total=appends,
            )
        finally:
            server.stop()
    return Report(
        streams=args.streams,
        clients=args.clients,
        hot=args.hot,
        server_args=["DIR" if a.startswith(tmp) else a for a in server_args],
        creates_per_s=created.per_second,
        create_failures=created.failed,
        create_cpu_us=created.cpu_seconds / max(created.ok, 1) * 1e6,
        create_user_us=created.user_seconds / max(created.ok, 1) * 1e6,
        create_sys_us=created.sys_seconds / max(created.ok, 1) * 1e6,
        streams_seen=streams_seen,
        rss_before=rss_before,
        rss_created=rss_created,
        rss_hibernated=rss_hibernated,
        rss_per_idle_stream=(rss_hibernated - rss_before) / args.streams,
        hibernate_wait_s=waited,
        appends_all_per_s=all_streams.per_second,
        appends_hot_per_s=hot_streams.per_second,
        append_all_cpu_us=all_streams.cpu_seconds / max(all_streams.ok, 1) * 1e6,
        append_hot_cpu_us=hot_streams.cpu_seconds / max(hot_streams.ok, 1) * 1e6,
        append_failures=all_streams.failed + hot_streams.failed,
        append_failure_classes={
            f"{phase} {name}": count
            for phase, counts in (("all", all_streams.failures), ("hot", hot_streams.failures))
            for name, count in counts.items()
        },
        ratio=all_streams.per_second / hot_streams.per_second if hot_streams.per_second else 0.0,
        load=load_average(),
        hot_from_idle=args.hot_from_idle,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=64, help="connections, one h2load process each")
    parser.add_argument("--hot", type=int, default=1024, help="streams of the second append phase")
    parser.add_argument("--appends", type=int, default=0, help="appends per phase (default: --streams)")
    parser.add_argument("--hibernate-after", type=float, default=5.0, help="the server's, in seconds")
    parser.add_argument(
        "--hot-from-idle",
        action="store_true",
        help="start the hot phase once every stream hibernated again (not awake from the first)",
    )
    parser.add_argument("--server-arg", action="append", default=[], help="passed to serve (repeatable)")
    parser.add_argument("--json", type=Path, help="also write the report here as JSON")
    args = parser.parse_args(argv)
    if not h2load.available():
        print("h2load not found: `make h2load` (Debian: nghttp2-client)", file=sys.stderr)
        return 2
    started = datetime.now(UTC)
    report = bench(args)
    kib = 1 / 1024
    print()
    print(
        f"## Many streams ({started:%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} CPUs, load {report.load})"
    )
    print(f"server: streamkeep serve {' '.join(report.server_args)}")
    print(
        "| streams | creates/s | server CPU per create | RSS before | after creating | after hibernation | per idle stream |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {report.streams_seen} ({report.create_failures} failed) | {report.creates_per_s:,.0f} "
        f"| {report.create_cpu_us:.0f} us ({report.create_user_us:.0f} user, {report.create_sys_us:.0f} sys) "
        f"| {report.rss_before * kib / 1024:.0f} MiB "
        f"| {report.rss_created * kib / 1024:.0f} MiB | {report.rss_hibernated * kib / 1024:.0f} MiB "
        f"(after {report.hibernate_wait_s:.1f} s) | {report.rss_per_idle_stream * kib:.2f} KiB |"
    )
    print()
    print(
        f"| appends over {report.streams} streams | over {report.hot}{' (from idle)' if report.hot_from_idle else ''} "
        "| ratio | server CPU per append, all / hot | failed |"
    )
    print("|---|---|---|---|---|")
    print(
        f"| {report.appends_all_per_s:,.0f}/s | {report.appends_hot_per_s:,.0f}/s | {report.ratio:.2f} "
        f"| {report.append_all_cpu_us:,.0f} / {report.append_hot_cpu_us:,.0f} us "
        f"| {report.append_failures} {report.append_failure_classes or ''} |"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
