"""Postgres -> stream through crashes: the bridge killed (SIGKILL, by its own crash points) before
the append, after the append, and after the checkpoint; Postgres stopped `-m immediate` mid-stream;
streamkeep killed and restarted on its disk. Each ends with the stream holding every committed
transaction exactly once, in commit order.

The bridge runs as the real `python -m streamkeep sync --config F` in a child process (which
restarts a mapping after a transient failure, as in production), killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest
import trio

from ops import pgserver, serverproc
from streamkeep.sync.config import PgToStream
from streamkeep.sync.stats import MappingStats
from tests import postgres as pg_fixtures
from tests.test_sync_source import (
    ITEMS,
    changes,
    execute,
    fold,
    in_thread,
    live,
    mapping_for,
    snapshot_done,
    stream_messages,
    table_state,
    wait_until,
    with_bridge,
)

postgres = pg_fixtures.postgres
database = pg_fixtures.database
ROOT = Path(__file__).resolve().parent.parent
_logs: dict[int, IO[bytes]] = {}  # each child's stderr


@pytest.fixture(scope="module")
def server() -> Iterator[serverproc.ServerProcess]:
    process = serverproc.start("--storage", "memory")
    yield process
    process.stop()


def child(mapping: PgToStream, url: str, crash_at: str | None = None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "STREAMKEEP_SYNC_CRASH_AT"}
    if crash_at:
        env["STREAMKEEP_SYNC_CRASH_AT"] = crash_at
    config = Path(tempfile.mkdtemp()) / "sync.toml"
    config.write_text(
        f'[streamkeep]\nurl = "{url}"\n[sync]\nport = 0\n[[pg_to_stream]]\nname = "{mapping.name}"\n'
        f'dsn = "{mapping.dsn}"\ntables = {json.dumps(list(mapping.tables))}\nstream = "{mapping.stream}"\n'
        f'slot = "{mapping.slot}"\npublication = "{mapping.publication}"\nbatch_rows = {mapping.batch_rows}\n'
        f'batch_wait = "{int(mapping.batch_wait * 1000)}ms"\n'
    )
    log = tempfile.TemporaryFile()  # a file, not a pipe nobody drains: a full pipe would block it
    process = subprocess.Popen(
        [sys.executable, "-m", "streamkeep", "sync", "--config", str(config), "--log-level", "warning"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    _logs[process.pid] = log
    return process


def kill(process: subprocess.Popen[bytes]) -> str:
    """SIGKILLs the child (if still there); returns what it wrote to stderr."""
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    log = _logs.pop(process.pid, None)
    if log is None:
        return ""
    with log:
        log.seek(0)
        return log.read().decode(errors="replace")


def crashed(process: subprocess.Popen[bytes], timeout: float = 40) -> None:
    """Waits for the child to kill itself at its crash point; says what it printed if it did not."""
    try:
        code: int | None = process.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
    output = kill(process)
    assert code == -signal.SIGKILL, f"exit {code} instead of the crash point's SIGKILL:\n{output[-3000:]}"


def write(dsn: str, first: int, transactions: int, rows: int = 3) -> int:
    """`transactions` transactions of `rows` inserts each, ids from `first`; returns the next id."""
    for _ in range(transactions):
        execute(
            dsn, *(f"INSERT INTO items (id, name) VALUES ({first + i}, 'r{first + i}')" for i in range(rows))
        )
        first += rows
    return first


def wait_for_rows(url: str, stream: str, count: int, timeout: float = 15) -> list[dict[str, Any]]:
    async def main() -> list[dict[str, Any]]:
        return await wait_until(url, stream, lambda ms: len(live(ms)) >= count, timeout)

    return trio.run(main)


@pytest.mark.parametrize("point", ["source.before_append", "source.after_append", "source.after_checkpoint"])
def test_killed_at_each_crash_point(point: str, database: str, server: serverproc.ServerProcess) -> None:
    execute(database, *ITEMS)
    mapping = mapping_for(database, batch_rows=7)  # 3 transactions (9 rows) per batch
    with_bridge(mapping, server.url, lambda stats: wait_until(server.url, mapping.stream, snapshot_done))
    next_id = write(database, 1, 10)  # waiting in the slot: 4 batches
    crashing = child(mapping, server.url, crash_at=f"{point}:2")  # the second batch
    crashed(crashing)
    # Whole transactions only (batches close on rows or on batch_wait, which a loaded machine
    # may reach first): the first batch, and the second where the kill came after its append.
    after_crash = [key for _, key, _ in live(stream_messages(server.url, mapping.stream))]
    assert after_crash == [str(i) for i in range(1, len(after_crash) + 1)] and len(after_crash) % 3 == 0
    with psycopg.connect(database) as conn:
        row = conn.execute(
            "SELECT pending_seq FROM streamkeep_sync.checkpoints WHERE name = %s", (mapping.name,)
        ).fetchone()
    # Killed before the checkpoint moved: the batch is pending, and the restart rebuilds it from
    # the slot and re-sends it under its seq (after_append: a duplicate the server drops).
    assert row is not None and (row[0] is None) == (point == "source.after_checkpoint")
    restarted = child(mapping, server.url)
    try:
        wait_for_rows(server.url, mapping.stream, 30)
        write(database, next_id, 5)
        messages = wait_for_rows(server.url, mapping.stream, 45)
    finally:
        kill(restarted)
    keys = [key for _, key, _ in live(messages)]
    assert keys == [str(i) for i in range(1, 46)]
    assert fold(messages) == table_state(database)


def test_postgres_stopped_immediate_mid_stream(
    database: str, postgres: pgserver.PostgresServer, server: serverproc.ServerProcess
) -> None:
    execute(database, *ITEMS)
    mapping = mapping_for(database, batch_rows=5)

    async def body(stats: MappingStats) -> None:
        await wait_until(server.url, mapping.stream, snapshot_done)
        await in_thread(write, database, 1, 10)
        await wait_until(server.url, mapping.stream, lambda ms: len(live(ms)) >= 3)
        # A crash: no checkpoint, so the slot's confirmed position falls back and Postgres
        # replays transactions the stream already holds; the bridge's checkpoint filters them.
        await in_thread(postgres.stop, "immediate")
        await in_thread(postgres.start)
        await in_thread(write, database, 31, 10)
        await wait_until(server.url, mapping.stream, lambda ms: len(live(ms)) >= 60, timeout=30)

    stats = with_bridge(mapping, server.url, body)
    messages = stream_messages(server.url, mapping.stream)
    assert [key for _, key, _ in live(messages)] == [str(i) for i in range(1, 61)]
    assert fold(messages) == table_state(database)
    assert stats.retries >= 1


def test_streamkeep_killed_and_restarted(database: str, tmp_path: Path) -> None:
    port = pgserver.free_port()
    args = ("--storage", "disk", "--data-dir", str(tmp_path / "data"), "--port", str(port))
    streamkeep = serverproc.start(*args)
    execute(database, *ITEMS)
    mapping = mapping_for(database, batch_rows=5)
    bridge = child(mapping, streamkeep.url)
    try:
        trio.run(wait_until, streamkeep.url, mapping.stream, snapshot_done)
        next_id = write(database, 1, 5)
        wait_for_rows(streamkeep.url, mapping.stream, 15)
        streamkeep.stop(signal.SIGKILL)
        next_id = write(database, next_id, 5)  # the bridge's appends fail while streamkeep is down
        streamkeep = serverproc.start(*args)
        # The same sync process goes on: its failed appends are retried (the mapping restarted
        # from its checkpoint, with backoff) until streamkeep is back on the same port.
        write(database, next_id, 5)
        messages = wait_for_rows(streamkeep.url, mapping.stream, 45, timeout=30)
    finally:
        kill(bridge)
        streamkeep.stop()
    assert [key for _, key, _ in live(messages)] == [str(i) for i in range(1, 46)]


def test_killed_mid_snapshot_starts_it_over_behind_a_reset(
    database: str, server: serverproc.ServerProcess
) -> None:
    execute(database, *ITEMS)
    write(database, 1, 1, rows=40)
    mapping = mapping_for(database, batch_rows=10)
    crashing = child(mapping, server.url, crash_at="source.snapshot_append:2")
    crashed(crashing)
    partial = live(stream_messages(server.url, mapping.stream))
    assert partial[0] == ("control", "snapshot-start", None) and len(partial) == 21  # 2 batches
    write(database, 41, 1)  # in the new snapshot
    restarted = child(mapping, server.url)
    try:
        trio.run(wait_until, server.url, mapping.stream, snapshot_done)
        write(database, 44, 1)
        messages = wait_for_rows(server.url, mapping.stream, 3)
    finally:
        kill(restarted)
    assert [key for _, key, _ in live(messages)] == ["44", "45", "46"]
    controls = [name for op, name, _ in changes(messages) if op == "control"]
    assert controls == ["snapshot-start", "reset", "snapshot-start", "snapshot-end"]
    assert fold(messages) == table_state(database)
