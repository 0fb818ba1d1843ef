"""The sync tier: `streamkeep sync` between a real Postgres and a real streamkeep, both directions
at once, under seeded faults, judged exactly-once at the end.

    python -m ops.torture sync --seed 7 --minutes 3

The workload: writers run transactions of one to four changes (inserts, updates, deletes, now and
then a value big enough to be TOASTed) on table `items`, published to stream `pg-items`; a
producer (streamkeep.client) appends State Protocol messages to stream `events`, which two sink
mappings apply to `ev_state` (state mode) and `ev_log` (log mode). `ev_state` is in the source's
publication too: the sink's own transactions must not come back (no echo).

The faults, one every 0.5-3 s: the sync killed with SIGKILL (sometimes at a named crash point on
its next start: before an append, after it, after the checkpoint, before and after a sink commit);
the sync paused with SIGSTOP while a second sync starts on the same config (fencing), then one of
them killed; Postgres stopped with `-m immediate` and started again; streamkeep killed with
SIGKILL and started again on its data directory.

At the end (faults off, everything up, the sync caught up), findings:
- `source-fold`: the fold of `pg-items` differs from table `items`;
- `source-duplicate` / `source-order`: a transaction's changes appear twice or apart, or commits
  out of order;
- `source-lost`: a transaction whose COMMIT returned is not on the stream;
- `echo`: a change of `ev_state` (written only by the sink) came back on `pg-items`;
- `sink-state`: `ev_state` differs from the fold of `events`;
- `sink-log`: `ev_log` does not hold each message of `events` exactly once (but those Postgres
  refuses);
- `sink-dead-letter`: `ev_dead` does not hold, for each sink, each message Postgres refuses
  exactly once, and nothing else;
- `stopped`: a mapping stopped (it should heal from every fault here);
- `no-catch-up`: the sync did not catch up within the grace period.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ops import pgserver, serverproc
from ops.torture.stateproto import fold, refused_by_postgres

CRASH_POINTS = (
    "source.snapshot_append",  # fires only while a snapshot is copied (the first start)
    "source.before_append",
    "source.after_append",
    "source.after_checkpoint",
    "sink.before_commit",
    "sink.after_commit",
)
GRACE = 90.0  # seconds the sync gets to catch up once the faults stop


@dataclass
class Options:
    seed: int = 1
    duration: float = 120.0
    dump_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / "torture-runs")

    def replay(self) -> str:
        return f"python -m ops.torture sync --seed {self.seed} --duration {self.duration:g}"


@dataclass
class Result:
    options: Options
    findings: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    root: Path | None = None


SCHEMA = """
CREATE TABLE items (id integer PRIMARY KEY, v integer NOT NULL, note text NOT NULL);
ALTER TABLE items REPLICA IDENTITY FULL;
"""

CONFIG = """\
[streamkeep]
url = "{url}"
[sync]
port = {sync_port}
[[pg_to_stream]]
name = "items"
dsn = "{dsn}"
tables = ["public.items", "public.ev_state"]
stream = "pg-items"
batch_rows = 50
batch_wait = "20ms"
[[stream_to_pg]]
name = "evstate"
stream = "events"
dsn = "{dsn}"
table = "public.ev_state"
mode = "state"
live = "{live_state}"
dead_letter = "public.ev_dead"
[[stream_to_pg]]
name = "evlog"
stream = "events"
dsn = "{dsn}"
table = "public.ev_log"
mode = "log"
live = "{live_log}"
dead_letter = "public.ev_dead"
"""


class Processes:
    """The three real processes, each restartable where it was."""

    def __init__(self, root: Path, rng: random.Random, log: Callable[[str], None]) -> None:
        self.root = root
        self.rng = rng
        self.log = log
        self.postgres = pgserver.create(root / "postgres")
        self.dsn = self.postgres.create_database("torture")
        self.port = pgserver.free_port()
        self.server: serverproc.ServerProcess | None = None
        self.start_server()
        self.live = (rng.choice(["sse", "long-poll"]), rng.choice(["sse", "long-poll"]))
        self.sync_port = 0
        self.syncs: list[subprocess.Popen[bytes]] = []
        self.sync_log = open(root / "sync.log", "ab")  # closed in stop_all

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_server(self) -> None:
        self.server = serverproc.launch(
            [
                sys.executable,
                "-m",
                "streamkeep",
                "serve",
                "--port",
                str(self.port),
                "--data-dir",
                str(self.root / "streams"),
                "--fsync",
                "always",
            ],
            timeout=60,
        )

    def kill_server(self) -> None:
        assert self.server is not None
        self.server.stop(signal.SIGKILL)

    def start_sync(self, crash_at: str | None = None) -> subprocess.Popen[bytes]:
        env = {**os.environ}
        env.pop("STREAMKEEP_SYNC_CRASH_AT", None)
        if crash_at:
            env["STREAMKEEP_SYNC_CRASH_AT"] = crash_at
        self.sync_port = pgserver.free_port()
        config = self.root / f"sync-{self.sync_port}.toml"
        config.write_text(
            CONFIG.format(
                url=self.url,
                dsn=self.dsn,
                sync_port=self.sync_port,
                live_state=self.live[0],
                live_log=self.live[1],
            )
        )
        self.sync_log.write(f"--- sync started{f' (crash at {crash_at})' if crash_at else ''}\n".encode())
        self.sync_log.flush()
        process = subprocess.Popen(
            [sys.executable, "-m", "streamkeep", "sync", "--config", str(config)],
            stdout=self.sync_log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.syncs.append(process)
        return process

    def live_syncs(self) -> list[subprocess.Popen[bytes]]:
        self.syncs = [p for p in self.syncs if p.poll() is None]
        return self.syncs

    def kill_syncs(self) -> None:
        for process in self.live_syncs():
            process.send_signal(signal.SIGCONT)
            process.kill()
            process.wait()
        self.syncs = []

    def stop_all(self) -> None:
        self.kill_syncs()
        if self.server is not None:
            self.server.stop()
        if self.postgres.running:
            self.postgres.stop("immediate")
        self.sync_log.close()


class Writer:
    """Transactions on `items`, each remembered with its xid and whether its COMMIT returned."""

    def __init__(self, dsn: str, rng: random.Random) -> None:
        self.dsn = dsn
        self.rng = rng
        self.committed: dict[int, int] = {}  # xid -> changes in it
        self.unknown: set[int] = set()  # COMMIT sent, no answer (Postgres went away)
        self.ids: list[int] = []
        self.next_id = 1
        self.stop = threading.Event()
        self.errors = 0

    def run(self) -> None:
        import psycopg

        conn: Any = None
        while not self.stop.is_set():
            try:
                if conn is None:
                    conn = psycopg.connect(self.dsn, connect_timeout=3)
                self.transaction(conn)
            except psycopg.Error:
                self.errors += 1
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.2)
        if conn is not None:
            conn.close()

    def transaction(self, conn: Any) -> None:
        changes = self.rng.randint(1, 4)
        planned = []
        for _ in range(changes):
            kind = self.rng.choice(["insert", "insert", "update", "delete"] if self.ids else ["insert"])
            note = "x" * (6000 if self.rng.random() < 0.05 else self.rng.randint(0, 40))
            if kind == "insert":
                planned.append(("insert", self.next_id, note))
                self.next_id += 1
            else:
                planned.append((kind, self.rng.choice(self.ids), note))
        xid = int(conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0])
        done = 0
        for kind, key, note in planned:
            if kind == "insert":
                conn.execute(
                    "INSERT INTO items (id, v, note) VALUES (%s, %s, %s)",
                    (key, self.rng.randint(0, 999), note),
                )
                done += 1
            elif kind == "update":
                done += conn.execute(
                    "UPDATE items SET v = v + 1, note = %s WHERE id = %s", (note, key)
                ).rowcount
            else:
                done += conn.execute("DELETE FROM items WHERE id = %s", (key,)).rowcount
        self.unknown.add(xid)
        conn.commit()
        self.unknown.discard(xid)
        for kind, key, _ in planned:
            if kind == "insert":
                self.ids.append(key)
            elif kind == "delete" and key in self.ids:
                self.ids.remove(key)
        if done:
            self.committed[xid] = done
        time.sleep(self.rng.uniform(0, 0.01))


class Appender:
    """State Protocol messages appended to `events` through streamkeep.client's producer: changes
    over 200 keys; now and then a value Postgres refuses (a string holding U+0000: both sinks
    dead-letter it), a `reset`, or a snapshot of a few keys (`snapshot-start`, inserts,
    `snapshot-end`, appended one by one, so a fault can fall inside one)."""

    def __init__(self, url: str, rng: random.Random) -> None:
        self.url = url
        self.rng = rng
        self.stop = threading.Event()
        self.acknowledged = 0
        self.failed = 0

    def next_messages(self, n: int) -> list[dict[str, Any]]:
        roll = self.rng.random()
        if roll < 0.005:
            return [{"headers": {"control": "reset"}}]
        if roll < 0.015:
            keys = self.rng.sample(range(200), self.rng.randrange(1, 6))
            inserts = [
                {
                    "type": "ev",
                    "key": str(k),
                    "value": {"n": n, "snapshot": True},
                    "headers": {"operation": "insert"},
                }
                for k in keys
            ]
            return [
                {"headers": {"control": "snapshot-start"}},
                *inserts,
                {"headers": {"control": "snapshot-end"}},
            ]
        operation = self.rng.choice(["insert", "update", "update", "delete"])
        message: dict[str, Any] = {
            "type": "ev",
            "key": str(self.rng.randrange(200)),
            "headers": {"operation": operation},
        }
        if operation != "delete":
            message["value"] = {"n": n, "s": "nul \u0000 inside"} if roll > 0.97 else {"n": n}
        return [message]

    def run(self) -> None:
        from streamkeep.client.sync import Client

        epoch = 0
        n = 0
        while not self.stop.is_set():
            try:
                with Client(self.url, retries=8) as client:
                    events = client.stream("events")
                    events.create(content_type="application/json")
                    with events.producer("torture", epoch=epoch, auto_claim=True, linger=0.01) as producer:
                        while not self.stop.is_set():
                            for message in self.next_messages(n):
                                producer.append(message).wait()
                                self.acknowledged += 1
                            n += 1
                            time.sleep(self.rng.uniform(0, 0.02))
            except Exception:  # the server was killed under it: a new producer, a higher epoch
                self.failed += 1
                epoch += 1
                time.sleep(0.3)


def read_stream(url: str, name: str) -> list[Any]:
    from streamkeep.client.sync import Client

    with Client(url, retries=8) as client:
        out: list[Any] = []
        for batch in client.stream(name).read(offset="-1"):
            out.extend(batch.messages or [])
        return out


def judge_source(messages: list[Any], table: dict[str, Any], writer: Writer, findings: list[str]) -> None:
    streamed = fold(messages)
    expected = {("public.items", key): value for key, value in table.items()}
    mine = {k: v for k, v in streamed.items() if k[0] == "public.items"}
    if mine != expected:
        missing = sorted(set(expected) - set(mine))[:5]
        extra = sorted(set(mine) - set(expected))[:5]
        differ = [k for k in expected if k in mine and mine[k] != expected[k]][:5]
        findings.append(f"source-fold: missing {missing}, extra {extra}, different {differ}")
    if any(k[0] == "public.ev_state" for k in streamed) or any(
        isinstance(m, dict) and m.get("type") == "public.ev_state" for m in messages
    ):
        findings.append("echo: a change of ev_state (written only by the sink) came back on pg-items")
    runs: list[tuple[int, str]] = []  # (xid, lsn) of each run of one transaction's changes
    per_xid: Counter[int] = Counter()
    in_snapshot = False
    for message in messages:
        headers = message.get("headers", {}) if isinstance(message, dict) else {}
        control = headers.get("control")
        if control in ("snapshot-start", "snapshot-end"):
            in_snapshot = control == "snapshot-start"
            continue
        if control or in_snapshot or "txid" not in headers:
            continue
        xid = int(headers["txid"])
        lsn = str(headers.get("lsn", ""))
        per_xid[xid] += 1
        if not runs or runs[-1][0] != xid:
            runs.append((xid, lsn))
    seen_runs = Counter(xid for xid, _ in runs)
    twice = [xid for xid, count in seen_runs.items() if count > 1]
    if twice:
        findings.append(f"source-duplicate: transactions {twice[:5]} appear in {len(twice)} separate runs")
    lsns = [_lsn(lsn) for _, lsn in runs if lsn]
    if any(b <= a for a, b in itertools.pairwise(lsns)):
        findings.append("source-order: commit LSNs on the stream are not increasing")
    lost = [xid for xid in writer.committed if xid not in per_xid]
    if lost:
        findings.append(f"source-lost: {len(lost)} committed transactions not on the stream, e.g. {lost[:5]}")
    wrong = [xid for xid, n in writer.committed.items() if xid in per_xid and per_xid[xid] != n]
    if wrong:
        findings.append(
            f"source-duplicate: {len(wrong)} transactions with another number of changes, e.g. {wrong[:5]}"
        )


def _lsn(text: str) -> int:
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) + int(low or "0", 16)


def judge_sink(messages: list[Any], tables: SinkTables, findings: list[str]) -> None:
    accepted = [m for m in messages if not refused_by_postgres(m)]
    expected = fold(accepted)
    if tables.state != expected:
        missing = sorted(set(expected) - set(tables.state))[:5]
        extra = sorted(set(tables.state) - set(expected))[:5]
        differ = [k for k in expected if k in tables.state and tables.state[k] != expected[k]][:5]
        findings.append(f"sink-state: missing {missing}, extra {extra}, different {differ}")
    wanted = Counter(json.dumps(m, sort_keys=True) for m in accepted)
    if tables.log != wanted:
        more = sum((tables.log - wanted).values())
        fewer = sum((wanted - tables.log).values())
        findings.append(f"sink-log: {more} rows beyond the stream's messages, {fewer} messages without a row")
    refused = Counter(json.dumps(m, sort_keys=True) for m in messages if refused_by_postgres(m))
    for mapping in ("evstate", "evlog"):
        dead = tables.dead.get(mapping, Counter())
        if dead != refused:
            findings.append(
                f"sink-dead-letter: {mapping} set aside {sum(dead.values())} messages, "
                f"{sum((dead - refused).values())} of them not refused by Postgres or twice; "
                f"{sum((refused - dead).values())} refused messages not set aside"
            )


@dataclass
class SinkTables:
    state: dict[tuple[str, str], Any]
    log: Counter[str]  # each row's message, as sorted JSON
    dead: dict[str, Counter[str]]  # per mapping, each dead-letter row's message

    def caught_up_with(self, messages: list[Any]) -> bool:
        accepted = [m for m in messages if not refused_by_postgres(m)]
        refused = len(messages) - len(accepted)
        return (
            self.state == fold(accepted)
            and sum(self.log.values()) == len(accepted)
            and all(sum(self.dead.get(m, Counter()).values()) == refused for m in ("evstate", "evlog"))
        )


def snapshot_tables(dsn: str) -> tuple[dict[str, Any], SinkTables]:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        items = {
            str(r[0]): {"id": r[0], "v": r[1], "note": r[2]}
            for r in conn.execute("SELECT id, v, note FROM items")
        }
        state = {(str(r[0]), str(r[1])): r[2] for r in conn.execute("SELECT type, key, value FROM ev_state")}
        log = Counter(json.dumps(r[0], sort_keys=True) for r in conn.execute("SELECT message FROM ev_log"))
        dead: dict[str, Counter[str]] = {}
        exists = conn.execute("SELECT to_regclass('public.ev_dead')").fetchone()
        if exists and exists[0]:
            for mapping, text in conn.execute("SELECT mapping, message::text FROM ev_dead"):
                dead.setdefault(mapping, Counter())[json.dumps(json.loads(text), sort_keys=True)] += 1
    return items, SinkTables(state, log, dead)


def run(options: Options, log: Callable[[str], None] = print) -> Result:
    rng = random.Random(options.seed)
    result = Result(options)
    root = Path(tempfile.mkdtemp(prefix=f"torture-sync-{options.seed}-"))
    result.root = root
    procs = Processes(root, rng, log)
    import psycopg

    with psycopg.connect(procs.dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute("CREATE TABLE ev_state (type text, key text, value jsonb, PRIMARY KEY (type, key))")
        conn.execute("ALTER TABLE ev_state REPLICA IDENTITY FULL")
    procs.start_sync()
    writer = Writer(procs.dsn, random.Random(rng.random()))
    appender = Appender(procs.url, random.Random(rng.random()))
    threads = [
        threading.Thread(target=writer.run, daemon=True),
        threading.Thread(target=appender.run, daemon=True),
    ]
    try:
        _wait_streaming(procs, 60)
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + options.duration
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.5, 3.0))
            fault(procs, rng, result.counts, log)
        writer.stop.set()
        appender.stop.set()
        for thread in threads:
            thread.join(60)
        heal(procs)
        result.counts["transactions committed"] = len(writer.committed)
        result.counts["transactions unknown"] = len(writer.unknown)
        result.counts["messages acknowledged"] = appender.acknowledged
        caught_up = _wait_caught_up(procs, writer, result.findings)
        if caught_up:
            items, sink_tables = snapshot_tables(procs.dsn)
            source_messages = read_stream(procs.url, "pg-items")
            event_messages = read_stream(procs.url, "events")
            result.counts["pg-items messages"] = len(source_messages)
            result.counts["events messages"] = len(event_messages)
            judge_source(source_messages, items, writer, result.findings)
            result.counts["events messages Postgres refuses"] = sum(map(refused_by_postgres, event_messages))
            result.counts["events control messages"] = sum("control" in m["headers"] for m in event_messages)
            judge_sink(event_messages, sink_tables, result.findings)
        health = _health(procs)
        stopped = [name for name, m in health.get("mappings", {}).items() if m.get("state") == "stopped"]
        if stopped:
            result.findings.append(f"stopped: mappings {stopped}: {health}")
    finally:
        procs.stop_all()
    if result.findings:
        options.dump_dir.mkdir(parents=True, exist_ok=True)
        log(f"findings; the run's directory (Postgres, streams, sync.log) is kept: {root}")
    return result


def fault(procs: Processes, rng: random.Random, counts: Counter[str], log: Callable[[str], None]) -> None:
    kind = rng.choice(["kill", "kill", "crash-point", "pause", "postgres", "streamkeep"])
    counts[kind] += 1
    if kind == "kill":
        procs.kill_syncs()
        time.sleep(rng.uniform(0, 1))
        procs.start_sync()
    elif kind == "crash-point":
        procs.kill_syncs()
        procs.start_sync(f"{rng.choice(CRASH_POINTS)}:{rng.randint(1, 3)}")
    elif kind == "pause":
        live = procs.live_syncs()
        if live:
            live[0].send_signal(signal.SIGSTOP)
            second = procs.start_sync()
            time.sleep(rng.uniform(1, 3))
            live[0].send_signal(signal.SIGCONT)
            time.sleep(rng.uniform(0, 1))
            victim = rng.choice([live[0], second])
            victim.kill()
            victim.wait()
    elif kind == "postgres":
        procs.postgres.stop("immediate")
        time.sleep(rng.uniform(0.2, 2))
        procs.postgres.start()
    else:
        procs.kill_server()
        time.sleep(rng.uniform(0, 1))
        procs.start_server()
    if not procs.live_syncs():
        procs.start_sync()  # a crash point fired, or the pause's victim was the only one


def heal(procs: Processes) -> None:
    if not procs.postgres.running:
        procs.postgres.start()
    assert procs.server is not None
    if not procs.server.alive:
        procs.start_server()
    procs.kill_syncs()
    procs.start_sync()


def _health(procs: Processes) -> dict[str, Any]:
    """The /healthz of the sync started last (each start has a port of its own: two run at once
    while one is paused)."""
    try:
        answer: dict[str, Any] = httpx.get(f"http://127.0.0.1:{procs.sync_port}/healthz", timeout=5).json()
        return answer
    except (httpx.HTTPError, ValueError) as error:
        return {"error": str(error)}


def _wait_streaming(procs: Processes, timeout: float) -> None:
    import psycopg

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with psycopg.connect(procs.dsn, autocommit=True) as conn:
                slot = conn.execute(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = 'streamkeep_items'"
                ).fetchone()
            if slot and httpx.head(f"{procs.url}/v1/stream/pg-items").status_code == 200:
                return
        except (psycopg.Error, httpx.HTTPError):
            pass
        time.sleep(0.2)
    raise RuntimeError("the sync did not make its slot and stream within 60 s (see sync.log)")


def _wait_caught_up(procs: Processes, writer: Writer, findings: list[str]) -> bool:
    deadline = time.monotonic() + GRACE
    while time.monotonic() < deadline:
        try:
            items, sink_tables = snapshot_tables(procs.dsn)
            source = fold(read_stream(procs.url, "pg-items"))
            events = read_stream(procs.url, "events")
            have = {k[1] for k in source if k[0] == "public.items"}
            if have == set(items) and sink_tables.caught_up_with(events):
                return True
        except Exception:  # still starting: look again
            pass
        time.sleep(1)
    findings.append(f"no-catch-up: the sync did not catch up within {GRACE:.0f} s of the faults stopping")
    return False
