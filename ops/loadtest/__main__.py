"""Load tests: streamkeep beside the Node reference server and a Python peer, same machine, same run.

    python -m ops.loadtest [--quick] [--seconds 2] [--servers NAMES] [--scenarios NAMES] [--json FILE]

Starts each server in turn as its own process on loopback (streamkeep memory and disk, the Node
reference server in memory and file-backed, rakaia-streams, the Python peer, on uvicorn in memory
and on its fsync'd JSONL store, and the ceiling: streamkeep's HTTP edge with an empty app), runs
every scenario that applies, and prints a Markdown table with ratios and the targets of issues 7 and
15. A scenario a peer (Node, rakaia) fails is marked in its cell and explained under the table, and
the run goes on; h2c rows say n/a for servers that do not speak it. Load comes from h2load (appends)
and from bare socket loops in other processes (producers, catch-up, fan-out); server CPU per request
is read from /proc. `--quick` is a smaller run for development (under 2 minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from ops.loadtest import h2load, scenarios
from ops.loadtest.scenarios import Row, Settings
from ops.loadtest.servers import KINDS, NODE_DIR, RAKAIA_PYTHON, pin, pinned_cpus
from ops.serverproc import ServerProcess

Scenario = Callable[[ServerProcess, Settings, bool], list[Row]]

# name -> (scenario, runs on the ceiling too, needs a server of its own). Fan-out measures server
# memory per reader, which only means something on a fresh process: Python and Node keep the memory
# earlier scenarios used and hand it out again.
SCENARIOS: dict[str, tuple[Scenario, bool, bool]] = {
    "sse-10k": (scenarios.sse_fan_out_large, False, True),
    "sse": (scenarios.sse_fan_out, False, True),
    "long-poll": (scenarios.long_poll_fan_out, False, True),
    "round-trip": (scenarios.round_trip, True, False),
    "throughput": (scenarios.throughput, True, False),
    "producers": (scenarios.producers, False, False),
    "client-producer": (scenarios.client_producer, False, False),
    "big-appends": (scenarios.big_appends, False, False),
    "catch-up": (scenarios.catch_up, False, False),
    "cardinality": (scenarios.cardinality, False, False),
}
QUICK = ["sse", "round-trip", "throughput", "catch-up", "cardinality"]
COLUMNS = [
    "streamkeep memory",
    "streamkeep disk",
    "node memory",
    "node file",
    "rakaia memory",
    "rakaia jsonl",
    "ceiling",
]
# (column, ours, theirs): ours / theirs, shown when both ran.
RATIOS = [
    ("memory vs node memory", "streamkeep memory", "node memory"),
    ("disk vs node file", "streamkeep disk", "node file"),
    ("memory vs rakaia memory", "streamkeep memory", "rakaia memory"),
    ("disk vs rakaia jsonl", "streamkeep disk", "rakaia jsonl"),
]


def run(
    names: list[str],
    chosen: list[str],
    settings: Settings,
    notes: dict[str, dict[str, str]],
    server_cpu: int | None = None,
) -> dict[str, list[Row]]:
    """Runs `chosen` on each server (pinned to `server_cpu` if given); a peer's failure goes into
    notes[server][scenario]."""
    results: dict[str, list[Row]] = {}
    started = time.monotonic()
    for name in names:
        kind = KINDS[name]
        results[name] = []
        server: ServerProcess | None = None
        try:
            for scenario_name in chosen:
                scenario, on_ceiling, fresh = SCENARIOS[scenario_name]
                if name.startswith("ceiling") and not on_ceiling:
                    continue
                if server is None or fresh:
                    if server is not None:
                        server.stop()
                    data = settings.work / f"{name}-{scenario_name}".replace(" ", "-")
                    data.mkdir()
                    server = kind.launch(data)
                    if server_cpu is not None:
                        pin(server.process.pid, server_cpu)
                print(f"[{time.monotonic() - started:5.0f} s] {name}: {scenario_name} ...", flush=True)
                try:
                    rows = scenario(server, settings, kind.h2c)
                except Exception as error:
                    if not kind.peer:
                        raise
                    notes.setdefault(name, {})[scenario_name] = f"failed: {error}".splitlines()[0][:200]
                    print(f"    {name} failed {scenario_name}: {error}", flush=True)
                    server.stop()  # it may be wedged; the next scenario gets a fresh one
                    server = None
                    continue
                for row in rows:
                    row.group = scenario_name
                results[name] += rows
                if fresh:
                    server.stop()
                    server = None
        finally:
            if server is not None:
                server.stop()
    print(f"[{time.monotonic() - started:5.0f} s] done", flush=True)
    return results


def fmt(row: Row | None) -> str:
    if row is None:
        return "-"
    if math.isnan(row.value):
        return "failed: " + ", ".join(f"{key} {number:,.0f}" for key, number in row.extra.items())
    value = (
        f"{row.value:,.0f}"
        if row.value >= 100
        else f"{row.value:,.3g}"
        if row.unit == "ms"
        else f"{row.value:,.1f}"
    )
    details = [f"{key} {number:,.3g}" for key, number in row.extra.items()]
    if row.cpu_us is not None:
        details.append(f"{row.cpu_us:,.0f} us CPU")
    return value + (f" ({', '.join(details)})" if details else "")


def ratio(a: Row | None, b: Row | None) -> str:
    if a is None or b is None or not b.value:
        return "-"
    return f"{a.value / b.value:.2f}x"


def table(results: dict[str, list[Row]], notes: dict[str, dict[str, str]] | None = None) -> str:
    notes = notes or {}
    keys: list[tuple[str, str]] = []
    groups: dict[tuple[str, str], str] = {}  # row -> the scenario that measured it
    by: dict[tuple[str, str, str], Row] = {}
    for server, rows in results.items():
        for row in rows:
            key = (row.scenario, row.protocol)
            if key not in keys:
                keys.append(key)
            groups[key] = row.group
            by[(server, *key)] = row
    present = [c for c in COLUMNS if c in results] + [c for c in results if c not in COLUMNS]
    ratios = [r for r in RATIOS if r[1] in results and r[2] in results]
    lines = [
        "| scenario | protocol | " + " | ".join(present + [r[0] for r in ratios]) + " |",
        "|---" * (len(present) + len(ratios) + 2) + "|",
    ]

    def cell(server: str, scenario: str, protocol: str) -> str:
        row = by.get((server, scenario, protocol))
        if row is None and protocol == "h2c" and server in KINDS and not KINDS[server].h2c:
            return "n/a"
        if row is None and groups[(scenario, protocol)] in notes.get(server, {}):
            return notes[server][groups[(scenario, protocol)]].split(":")[0]
        return fmt(row)

    for scenario, protocol in keys:
        cells = [cell(c, scenario, protocol) for c in present]
        cells += [
            ratio(by.get((ours, scenario, protocol)), by.get((theirs, scenario, protocol)))
            for _, ours, theirs in ratios
        ]
        lines.append(f"| {scenario} | {protocol} | " + " | ".join(cells) + " |")
    failures = [f"- {server}, {name}: {note}" for server, got in notes.items() for name, note in got.items()]
    return "\n".join(lines + (["", *failures] if failures else []))


def targets(results: dict[str, list[Row]]) -> list[str]:
    """Issues 7 and 15's targets, each as a line saying met or missed and by how much."""

    def find(server: str, prefix: str, protocol: str = "h1", key: str | None = None) -> float | None:
        for row in results.get(server, []):
            if row.scenario.startswith(prefix) and row.protocol == protocol:
                return row.value if key is None else row.extra.get(key)
        return None

    lines = []

    def check(
        label: str, value: float | None, goal: float, *, at_most: bool = False, unit: str = "x"
    ) -> None:
        if value is None:
            lines.append(f"- {label}: not measured in this run")
            return
        met = value <= goal if at_most else value >= goal
        lines.append(
            f"- {label}: {value:,.2f}{unit} (target {'<=' if at_most else '>='} {goal:g}{unit}) -> "
            f"{'met' if met else 'MISSED'}"
        )

    def cpu(server: str, prefix: str) -> float | None:
        for row in results.get(server, []):
            if row.scenario.startswith(prefix) and row.protocol == "h1":
                return row.cpu_us
        return None

    def quotient(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or not b else a / b

    for clients in (16, 64):
        own, shared = (
            f"appends/s, {clients} clients, own streams",
            f"appends/s, {clients} clients, one shared",
        )
        check(
            f"durable appends, {clients} clients on own streams, vs node file",
            quotient(find("streamkeep disk", own), find("node file", own)),
            3,
        )
        check(
            f"durable appends, {clients} clients on one shared stream, vs node file",
            quotient(find("streamkeep disk", shared), find("node file", shared)),
            5,
        )
    own = "appends/s, 16 clients, own streams"
    check(
        "memory appends vs rakaia memory, 16 clients own streams, h1 (issue 15)",
        quotient(find("streamkeep memory", own), find("rakaia memory", own)),
        1.3,
    )
    for protocol, goal in (("h1", 0.6), ("h2c", 0.65)):
        check(
            f"memory appends vs the ceiling, 16 clients own streams, {protocol}",
            quotient(find("streamkeep memory", own, protocol), find("ceiling", own, protocol)),
            goal,
        )
    check(
        "server CPU per in-memory append, 16 clients own streams, h1 (issue 15; pinned)",
        cpu("streamkeep memory", own),
        70,
        at_most=True,
        unit=" us",
    )
    small = "sse fan-out, 1,000 readers"
    for ours, theirs in (("streamkeep memory", "node memory"), ("streamkeep disk", "node file")):
        check(
            f"SSE 1,000 readers p99, {ours} / {theirs}",
            quotient(find(ours, small, key="p99 ms"), find(theirs, small, key="p99 ms")),
            1,
            at_most=True,
        )
    large = "sse fan-out, 10,000 readers"
    for ours in ("streamkeep memory", "streamkeep disk"):
        for label, key, goal, unit in (
            ("every event reached all", "all reached (max ms)", 1000, " ms"),
            ("server memory per reader", "KB per reader", 20, " KB"),
        ):
            check(
                f"SSE 10,000 readers, {label} ({ours})",
                find(ours, large, key=key),
                goal,
                at_most=True,
                unit=unit,
            )
    for ours, theirs in (("streamkeep memory", "node memory"), ("streamkeep disk", "node file")):
        check(
            f"catch-up MiB/s, {ours} / {theirs}",
            quotient(find(ours, "catch-up"), find(theirs, "catch-up")),
            1,
        )
    for ours in ("streamkeep memory", "streamkeep disk"):
        check(
            f"appends/s at 10,000 streams vs 10 streams ({ours})",
            quotient(
                find(ours, "appends/s, 16 clients over 10,000"), find(ours, "appends/s, 16 clients over 10 ")
            ),
            0.8,
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a smaller run for development")
    parser.add_argument("--seconds", type=float, default=None, help="seconds per throughput run")
    parser.add_argument("--servers", default=",".join(COLUMNS), help="comma-separated: " + ", ".join(KINDS))
    parser.add_argument("--scenarios", default=None, help="comma-separated: " + ", ".join(SCENARIOS))
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="do not pin: by default every server runs on one CPU and the load on another (taskset-style)",
    )
    args = parser.parse_args()
    cpus = None if args.no_pin else pinned_cpus()
    if cpus is not None:
        # The load (h2load, client loops, subscriber processes) inherits this; servers are moved
        # to the other CPU as they start. Per-request CPU then counts one core's work, undisturbed.
        os.sched_setaffinity(0, {cpus[1]})
    if not h2load.available():
        print("h2load is missing: apt-get install nghttp2-client (make bench does)", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    if any(n.startswith("node") for n in names) and not (NODE_DIR / "node_modules").is_dir():
        print("ops/bench/node_modules is missing: run `make bench` (it runs npm ci)", file=sys.stderr)
        return 2
    if any(n.startswith("rakaia") for n in names) and not RAKAIA_PYTHON.exists():
        print(
            "ops/bench/.venv-rakaia is missing: run `make bench` (it installs rakaia-streams)",
            file=sys.stderr,
        )
        return 2
    unknown = [n for n in names if n not in KINDS]
    chosen = (args.scenarios or ",".join(QUICK if args.quick else SCENARIOS)).split(",")
    unknown += [n for n in chosen if n not in SCENARIOS]
    if unknown:
        print(f"unknown server or scenario: {', '.join(unknown)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="loadtest-", dir=scenarios.ROOT) as tmp:
        settings = Settings(
            seconds=args.seconds or (1.5 if args.quick else 3),
            work=Path(tmp),
            cardinalities=(10, 1000) if args.quick else (10, 1000, 10000),
            quick=args.quick,
        )
        notes: dict[str, dict[str, str]] = {}
        results = run(names, chosen, settings, notes, None if cpus is None else cpus[0])
    pinning = "not pinned" if cpus is None else f"servers pinned to CPU {cpus[0]}, load to CPU {cpus[1]}"
    header = (
        f"date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; machine: {platform.node()}, {os.cpu_count()} cores, "
        f"{platform.python_implementation()} {platform.python_version()}, {pinning}; command: "
        "python -m ops.loadtest " + " ".join(sys.argv[1:])
    )
    print("\n" + header + "\n")
    print(table(results, notes))
    print("\nTargets (issues 7 and 15):")
    print("\n".join(targets(results)))
    if args.json:
        args.json.write_text(json.dumps({k: [r.__dict__ for r in v] for k, v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
