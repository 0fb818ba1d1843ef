"""The sink through failures, against a real Postgres and real streamkeep processes: the sync
process SIGKILLed before and after its commit, Postgres crashed (`-m immediate`) and started again,
streamkeep killed and started again (disk storage), retention passing the stored offset. Each ends
with the table equal to the stream, exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from ops import pgserver, serverproc
from streamkeep.client import Client
from streamkeep.sync import process
from streamkeep.sync.config import StreamToPg
from streamkeep.sync.sink import run
from streamkeep.sync.stats import MappingStats, MappingStopped
from tests import postgres as pg_fixtures
from tests import sync_sink_helpers
from tests.sync_sink_helpers import (
    append,
    assert_log_is_stream,
    assert_state_is_fold,
    caught_up,
    change,
    mapping,
    run_until_caught_up,
    state_table,
    stored_offset,
    wait_for,
)

postgres, database = pg_fixtures.postgres, pg_fixtures.database  # the fixtures, under their names
server = sync_sink_helpers.server  # a streamkeep for the module, a fixture too


def config_file(directory: Path, url: str, sink: StreamToPg) -> Path:
    path = directory / "sync.toml"
    path.write_text(
        f"""
[streamkeep]
url = "{url}"
[sync]
port = 0
[[stream_to_pg]]
name = "{sink.name}"
stream = "{sink.stream}"
dsn = "{sink.dsn}"
table = "{sink.table}"
mode = "{sink.mode}"
"""
    )
    return path


def spawn(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=serverproc.ROOT, stdout=out, stderr=subprocess.STDOUT)


def run_sync_until_killed(config: Path, crash_at: str) -> None:
    """`python -m streamkeep sync` with a crash point: it must SIGKILL itself there."""
    child = subprocess.Popen(
        [sys.executable, "-m", "streamkeep", "sync", "--config", str(config), "--log-level", "warning"],
        env={**os.environ, "STREAMKEEP_SYNC_CRASH_AT": crash_at},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=serverproc.ROOT,
    )
    try:
        output, _ = child.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        output, _ = child.communicate()
    assert child.returncode == -signal.SIGKILL, output


@pytest.mark.parametrize("mode", ["log", "state"])
@pytest.mark.parametrize("crash_at", ["sink.before_commit", "sink.after_commit"])
async def test_the_sync_process_killed_around_its_commit_repeats_nothing_and_loses_nothing(
    server: str, database: str, tmp_path: Path, crash_at: str, mode: str
) -> None:
    sink = mapping(database, f"crash_{mode}", mode)  # a stream of its own on the module's server
    config = config_file(tmp_path, server, sink)

    def messages(numbers: range) -> list[Any]:
        if mode == "log":
            return [{"n": n} for n in numbers]
        return [change("t", str(n % 4), n, "insert" if n < 4 else "update") for n in numbers]

    async with Client(server) as client:
        await client.stream(sink.stream).create(content_type="application/json")
        await append(client, sink.stream, messages(range(10)))
        await trio.to_thread.run_sync(run_sync_until_killed, config, crash_at)
        first = stored_offset(database, sink.name)
        if crash_at == "sink.before_commit":
            assert first == "-1"  # rolled back: nothing stored, nothing written
        else:
            assert first == (await client.stream(sink.stream).head()).next_offset
        await append(client, sink.stream, messages(range(10, 15)))
        await trio.to_thread.run_sync(run_sync_until_killed, config, crash_at)
        await append(client, sink.stream, messages(range(15, 20)))
        await run_until_caught_up(server, sink)
        if mode == "log":
            await assert_log_is_stream(client, sink)
        else:
            await assert_state_is_fold(client, sink)
            assert state_table(database, sink.table)[("t", "3")] == 19


async def test_postgres_crashed_and_started_again(
    server: str, database: str, postgres: pgserver.PostgresServer
) -> None:
    sink = mapping(database, "pgcrash")
    async with Client(server) as client:
        await client.stream(sink.stream).create(content_type="application/json")
        stats = MappingStats(sink.name, "stream_to_pg")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(process.keep_running, sink, run, client, stats)
            for n in range(20):
                await append(client, sink.stream, [change("t", str((n * 7 + i) % 50), n) for i in range(20)])
                if n == 8:
                    await trio.to_thread.run_sync(postgres.stop, "immediate")
                if n == 12:
                    await trio.to_thread.run_sync(postgres.start)
                await trio.sleep(0.02)
            await wait_for(lambda: caught_up(client, sink), 30)
            nursery.cancel_scope.cancel()
        assert stats.retries >= 1
        await assert_state_is_fold(client, sink)


async def test_streamkeep_killed_and_started_again(database: str, tmp_path: Path) -> None:
    port = pgserver.free_port()
    args = ("--storage", "disk", "--data-dir", str(tmp_path / "data"), "--port", str(port))
    streamkeep = serverproc.start(*args)
    sink = mapping(database, "skcrash", "log")
    try:
        async with Client(streamkeep.url) as client:
            await client.stream(sink.stream).create(content_type="application/json")
            stats = MappingStats(sink.name, "stream_to_pg")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(process.keep_running, sink, run, client, stats)
                for n in range(10):
                    await append(client, sink.stream, [{"n": n, "i": i} for i in range(10)])
                await wait_for(lambda: caught_up(client, sink))
                streamkeep.stop(signal.SIGKILL)
                await trio.sleep(0.5)
                streamkeep = await trio.to_thread.run_sync(lambda: serverproc.start(*args))
                for n in range(10, 20):
                    await append(client, sink.stream, [{"n": n, "i": i} for i in range(10)])
                await wait_for(lambda: caught_up(client, sink), 30)
                nursery.cancel_scope.cancel()
            await assert_log_is_stream(client, sink)
    finally:
        streamkeep.stop()


async def test_retention_passing_the_stored_offset_stops_or_resyncs(database: str, tmp_path: Path) -> None:
    streamkeep = serverproc.start(
        "--storage", "disk", "--data-dir", str(tmp_path / "data"),
        "--segment-max-messages", "2", "--retention-max-bytes", "300", "--retention-interval", "0.1",
    )  # fmt: skip
    stopping = mapping(database, "kept")
    resyncing = StreamToPg(
        **{**stopping.__dict__, "name": "kept_resync", "table": "public.kept_resync", "on_gone": "resync"}
    )
    try:
        async with Client(streamkeep.url) as client:
            stream = client.stream(stopping.stream)
            await stream.create(content_type="application/json")
            await append(client, stopping.stream, [change("t", "first", 0)])
            await run_until_caught_up(streamkeep.url, stopping)
            await run_until_caught_up(streamkeep.url, resyncing)
            held = stored_offset(database, "kept")
            for n in range(40):
                await append(client, stopping.stream, [change("t", str(n % 5), n)])

            async def dropped() -> bool:
                return ((await stream.head()).earliest_offset or "") > (held or "")

            await wait_for(dropped)
            with trio.fail_after(10), pytest.raises(MappingStopped) as stopped:
                await run(stopping, client, MappingStats("kept", "stream_to_pg"))
            assert "410" in str(stopped.value) and "streamkeep sync reset kept" in str(stopped.value)
            assert stored_offset(database, "kept") == held
            await run_until_caught_up(streamkeep.url, resyncing)
            # the table was rebuilt from the earliest retained offset: "first" (dropped) is gone
            await assert_state_is_fold(client, resyncing)
            assert ("t", "first") not in state_table(database, "kept_resync")
    finally:
        streamkeep.stop()


async def test_a_paused_sync_process_woken_after_another_took_over_applies_nothing_twice(
    server: str, database: str, tmp_path: Path
) -> None:
    """SIGSTOP one sync process, let a second one take over the mapping, SIGCONT the first: it
    holds batches read from its old offset, and its compare-and-set refuses them."""
    sink = mapping(database, "paused", "log")
    config = config_file(tmp_path, server, sink)
    command = [sys.executable, "-m", "streamkeep", "sync", "--config", str(config), "--log-level", "warning"]
    async with Client(server) as client:
        await client.stream(sink.stream).create(content_type="application/json")
        await append(client, sink.stream, [{"n": n} for n in range(10)])
        first = spawn(command, tmp_path / "first.log")
        second: subprocess.Popen[bytes] | None = None
        try:
            await wait_for(lambda: caught_up(client, sink))
            first.send_signal(signal.SIGSTOP)
            await append(client, sink.stream, [{"n": n} for n in range(10, 20)])
            second = spawn(command, tmp_path / "second.log")
            await wait_for(lambda: caught_up(client, sink))
            first.send_signal(signal.SIGCONT)  # it had (or now reads) the same batch, from the old offset
            for n in range(20, 30):
                await append(client, sink.stream, [{"n": n}])
                await trio.sleep(0.05)
            await wait_for(lambda: caught_up(client, sink))
            await trio.sleep(0.5)  # time for a late, refused commit of either
        finally:
            for child in (first, second):
                if child is not None:
                    child.send_signal(signal.SIGCONT)
                    child.terminate()
                    child.wait(10)
        await assert_log_is_stream(client, sink)
        # the woken one was refused by the compare-and-set (or found the origin busy), then went on
        said = (tmp_path / "first.log").read_text()
        assert "changed under this sink" in said or "uses replication origin" in said, said
