"""`make bench-sync`: how fast `streamkeep sync` moves rows, beside what Postgres itself commits.

Parts (`--parts`, all by default), each on a fresh Postgres database, one streamkeep server
(`--storage disk`, `--fsync always` unless `--serve-args` says otherwise) and the sync as a real
process (`python -m streamkeep sync --config ...`):

- `ceiling`: one-row INSERT transactions from `--writers` connections for `--seconds`: the rows/s
  Postgres alone commits here (synchronous_commit on, fsync on). The source's target is 50k rows/s
  from one slot, or 0.9x of this ceiling where Postgres cannot reach 50k.
- `source`: `--rows` one-row transactions written while the sync is stopped (its slot keeps them),
  then the sync started: rows/s from one slot until every row is on the stream (the bridge's own
  speed, not the writers'); and the same with the writers running beside it.
- `latency`: writers paced at `--rate` rows/s in total for `--seconds`, an SSE reader on the
  stream: commit-to-readable p50/p99 (commit = when COMMIT returned to the writer).
- `sink`: `--messages` State Protocol messages on a stream (over `--keys` keys), then a `state`
  mapping started: messages/s applied to Postgres from its first commit until all are (and with
  the process's start); beside it the sink's ceiling, Postgres alone running the sink's statement
  over the same answers in transactions of the same size.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

from ops import pgserver, serverproc

PARTS = ("ceiling", "source", "latency", "sink")


@dataclass
class Rig:
    root: Path
    postgres: pgserver.PostgresServer
    server: serverproc.ServerProcess
    results: dict[str, Any] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def writers(
    dsn: str, count: int, seconds: float, rate: float | None, on_commit: Callable[[int, float], None]
) -> int:
    """`count` connections inserting one-row transactions for `seconds` (at `rate` rows/s in total
    if given); `on_commit(id, when)` after each COMMIT returned. Returns rows committed."""
    done = [0] * count
    stop_at = time.monotonic() + seconds

    def write(index: int) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            interval = count / rate if rate else 0.0
            next_at = time.monotonic()
            while time.monotonic() < stop_at:
                if interval:
                    next_at += interval
                    pause = next_at - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)
                row = conn.execute(
                    "INSERT INTO items (name, price) VALUES (%s, %s) RETURNING id", (f"w{index}", 1.5)
                ).fetchone()
                assert row is not None
                on_commit(int(row[0]), time.monotonic())
                done[index] += 1

    threads = [threading.Thread(target=write, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done)


def make_items(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE items (id bigserial PRIMARY KEY, name text NOT NULL, price numeric NOT NULL)"
        )
        conn.execute("ALTER TABLE items REPLICA IDENTITY FULL")


def sync_config(rig: Rig, body: str) -> Path:
    path = rig.root / f"sync-{time.monotonic_ns()}.toml"
    path.write_text(
        f'[streamkeep]\nurl = "{rig.server.url}"\n[sync]\nport = {rig.results["sync_port"]}\n{body}'
    )
    return path


class SyncProcess:
    def __init__(self, rig: Rig, config: Path) -> None:
        self.port = rig.results["sync_port"]
        self.log = open(rig.root / "sync.log", "a")  # closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "streamkeep", "sync", "--config", str(config), "--log-level", "warning"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def rows(self, mapping: str) -> int:
        try:
            text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text
        except httpx.HTTPError:
            return 0
        found = re.search(rf'streamkeep_sync_rows_total{{[^}}]*mapping="{mapping}"[^}}]*}} ([0-9.e+]+)', text)
        return int(float(found.group(1))) if found else 0

    def state(self, mapping: str) -> str:
        try:
            body = httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return "down"
        return str(body["mappings"][mapping]["state"])

    def wait(self, check: Callable[[], bool], timeout: float, what: str) -> float:
        started = time.monotonic()
        while not check():
            if self.process.poll() is not None:
                raise RuntimeError(f"the sync exited ({self.process.returncode}) before {what}; see sync.log")
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}; see sync.log")
            time.sleep(0.02)
        return time.monotonic()

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def part_ceiling(rig: Rig, args: argparse.Namespace) -> None:
    dsn = rig.postgres.create_database("ceiling")
    make_items(dsn)
    started = time.monotonic()
    rows = writers(dsn, args.writers, args.seconds, None, lambda _id, _when: None)
    rate = rows / (time.monotonic() - started)
    rig.results["ceiling rows/s"] = round(rate)
    print(f"ceiling: {args.writers} writers commit {rate:,.0f} one-row transactions/s", flush=True)


def source_config(rig: Rig, dsn: str, name: str) -> Path:
    return sync_config(
        rig,
        f'[[pg_to_stream]]\nname = "{name}"\ndsn = "{dsn}"\ntables = ["public.items"]\nstream = "{name}"\n'
        f"batch_rows = {rig.results['batch_rows']}\n",
    )


def part_source(rig: Rig, args: argparse.Namespace) -> None:
    dsn = rig.postgres.create_database("source")
    make_items(dsn)
    name = "bench_source"
    config = source_config(rig, dsn, name)
    sync = SyncProcess(rig, config)
    sync.wait(lambda: sync.state(name) == "streaming", 60, "the slot is made and the empty snapshot copied")
    sync.stop()
    # Rows written while the bridge is down wait in the slot: the drain below is the bridge's speed.
    started = time.monotonic()
    written = 0
    while written < args.rows:
        written += writers(dsn, args.writers, 2.0, None, lambda _id, _when: None)
    print(
        f"source: {written:,} one-row transactions in the slot ({time.monotonic() - started:.1f} s)",
        flush=True,
    )
    sync = SyncProcess(rig, config)
    began = time.monotonic()
    ended = sync.wait(lambda: sync.rows(name) >= written, 600, f"{written} rows on the stream")
    drain = written / (ended - began)
    rig.results["source drain rows/s"] = round(drain)
    print(
        f"source: drained {written:,} rows from one slot at {drain:,.0f} rows/s (process start included)",
        flush=True,
    )
    # The same bridge while writers run beside it: rows/s it keeps up with.
    before = sync.rows(name)
    began = time.monotonic()
    committed = writers(dsn, args.writers, args.seconds, None, lambda _id, _when: None)
    target = before + committed
    ended = sync.wait(lambda: sync.rows(name) >= target, 300, "the rows written beside it")
    rig.results["source with writers rows/s"] = round(committed / (ended - began))
    print(
        f"source: with {args.writers} writers beside it {committed / (ended - began):,.0f} rows/s", flush=True
    )
    sync.stop()


def part_latency(rig: Rig, args: argparse.Namespace) -> None:
    dsn = rig.postgres.create_database("latency")
    make_items(dsn)
    name = "bench_latency"
    sync = SyncProcess(rig, source_config(rig, dsn, name))
    sync.wait(lambda: sync.state(name) == "streaming", 60, "the mapping streams")
    committed: dict[int, float] = {}
    seen: dict[int, float] = {}
    stop = threading.Event()

    def follow() -> None:
        url = f"{rig.server.url}/v1/stream/{name}"
        with httpx.Client(timeout=None) as client:
            with client.stream("GET", url, params={"offset": "-1", "live": "sse"}) as response:
                for line in response.iter_lines():
                    if stop.is_set():
                        return
                    if line.startswith("data:"):
                        now = time.monotonic()
                        try:
                            messages = json.loads(line[5:])
                        except ValueError:
                            continue
                        for message in messages if isinstance(messages, list) else [messages]:
                            value = message.get("value") if isinstance(message, dict) else None
                            if isinstance(value, dict) and "id" in value:
                                seen.setdefault(int(value["id"]), now)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    time.sleep(0.5)
    writers(dsn, args.writers, args.seconds, args.rate, lambda id_, when: committed.__setitem__(id_, when))
    deadline = time.monotonic() + 30
    while len(seen) < len(committed) and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    sync.stop()
    delays = [(seen[i] - committed[i]) * 1000 for i in committed if i in seen]
    rate = len(committed) / args.seconds
    rig.results["latency at rows/s"] = round(rate)
    rig.results["commit-to-readable p50 ms"] = round(percentile(delays, 0.5), 1)
    rig.results["commit-to-readable p99 ms"] = round(percentile(delays, 0.99), 1)
    rig.results["rows not seen"] = len(committed) - len(delays)
    print(
        f"latency: {rate:,.0f} rows/s, commit-to-readable p50 {percentile(delays, 0.5):.1f} ms, "
        f"p99 {percentile(delays, 0.99):.1f} ms, {len(committed) - len(delays)} not seen",
        flush=True,
    )


def part_sink(rig: Rig, args: argparse.Namespace) -> None:
    dsn = rig.postgres.create_database("sink")
    name = "bench_sink"
    url = f"{rig.server.url}/v1/stream/{name}"
    with httpx.Client(timeout=60) as client:
        client.put(url, headers={"content-type": "application/json"}).raise_for_status()
        batch: list[dict[str, Any]] = []
        for n in range(args.messages):
            operation = "insert" if n < args.keys else ("delete" if n % 10 == 0 else "update")
            message: dict[str, Any] = {
                "type": "item",
                "key": str(n % args.keys),
                "headers": {"operation": operation},
            }
            if operation != "delete":
                message["value"] = {"n": n, "name": f"item {n % args.keys}"}
            batch.append(message)
            if len(batch) == 2000:
                client.post(
                    url, headers={"content-type": "application/json"}, content=json.dumps(batch)
                ).raise_for_status()
                batch = []
        if batch:
            client.post(
                url, headers={"content-type": "application/json"}, content=json.dumps(batch)
            ).raise_for_status()
    config = sync_config(
        rig,
        f'[[stream_to_pg]]\nname = "{name}"\nstream = "{name}"\ndsn = "{dsn}"\ntable = "public.state"\nmode = "state"\n',
    )
    sync = SyncProcess(rig, config)
    began = time.monotonic()
    # From the first commit on: the process's start (imports, connections, tables) is not the
    # sink's speed, and is timed apart.
    first_rows = [0]

    def committed() -> bool:
        first_rows[0] = sync.rows(name)
        return first_rows[0] > 0

    first = sync.wait(committed, 120, "a first commit")
    ended = sync.wait(lambda: sync.rows(name) >= args.messages, 600, f"{args.messages} messages applied")
    sync.stop()
    rate = (args.messages - first_rows[0]) / (ended - first)
    whole = args.messages / (ended - began)
    rig.results["sink state-mode messages/s"] = round(rate)
    rig.results["sink state-mode messages/s, process start included"] = round(whole)
    print(
        f"sink: applied {args.messages:,} State Protocol messages at {rate:,.0f} messages/s "
        f"({whole:,.0f}/s with the process's start)",
        flush=True,
    )
    ceiling = sink_ceiling(rig, url, dsn)
    rig.results["sink ceiling messages/s"] = round(ceiling)
    print(
        f"sink ceiling: Postgres alone applies the same answers with the same statement at {ceiling:,.0f} "
        f"messages/s; the sink is {rate / ceiling:.2f}x that",
        flush=True,
    )


def sink_ceiling(rig: Rig, url: str, dsn: str) -> float:
    """Postgres alone doing the sink's work: the stream's answers, read beforehand, folded and
    upserted by the sink's own statement (state.FAST) into a fresh table, in transactions of up to
    the sink's MAX_MESSAGES, with no HTTP, offsets or origin around it."""
    from psycopg import sql

    from streamkeep.sync.sink import bridge, state

    bodies: list[tuple[str, int]] = []
    offset = "-1"
    with httpx.Client(timeout=60) as client:
        while True:
            answer = client.get(url, params={"offset": offset})
            answer.raise_for_status()
            if answer.content.strip() not in (b"", b"[]"):
                bodies.append((answer.text, answer.text.count('"headers"')))
            offset = answer.headers["stream-next-offset"]
            if answer.headers.get("stream-up-to-date") == "true":
                break
    total = sum(count for _, count in bodies)
    with psycopg.connect(dsn, options=bridge.SESSION_OPTIONS) as conn:
        conn.execute(
            "CREATE TABLE ceiling_state (type text NOT NULL, key text NOT NULL, value jsonb, "
            "PRIMARY KEY (type, key)) WITH (fillfactor = 80)"
        )
        conn.commit()
        statement = sql.SQL(state.FAST).format(table=sql.Identifier("ceiling_state"))
        began = time.monotonic()
        in_transaction = 0
        for text, count in bodies:
            conn.execute(statement, {"data": text}).fetchall()
            in_transaction += count
            if in_transaction >= bridge.MAX_MESSAGES:
                conn.commit()
                in_transaction = 0
        conn.commit()
        return total / (time.monotonic() - began)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ops.bench_sync",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rows", type=int, default=200_000, help="one-row transactions the source drains")
    parser.add_argument("--rate", type=float, default=5000.0, help="rows/s for the latency part")
    parser.add_argument("--messages", type=int, default=200_000, help="messages the sink applies")
    parser.add_argument("--keys", type=int, default=50_000)
    parser.add_argument("--batch-rows", type=int, default=1000)
    parser.add_argument("--serve-args", default="--fsync always", help="flags for streamkeep serve")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-sync-"))
    print(f"bench-sync: Postgres and streamkeep under {root}", flush=True)
    postgres = pgserver.create(root / "postgres")
    server = serverproc.start(
        "--storage", "disk", "--data-dir", str(root / "streams"), *args.serve_args.split()
    )
    rig = Rig(root, postgres, server)
    rig.results.update(
        {
            "machine": f"{platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores, Python {platform.python_version()}",
            "postgres settings": "fsync on, synchronous_commit on, wal_level logical, shared_buffers 128MB",
            "sync_port": pgserver.free_port(),
            "batch_rows": args.batch_rows,
            "writers": args.writers,
        }
    )
    try:
        for part in parts:
            {"ceiling": part_ceiling, "source": part_source, "latency": part_latency, "sink": part_sink}[
                part
            ](rig, args)
    finally:
        server.stop()
        postgres.stop()
    rig.results.pop("sync_port")
    print(json.dumps(rig.results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(rig.results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
