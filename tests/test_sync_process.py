"""The sync process around its mappings: a failing mapping is retried with backoff and never ends
the process, a stopped one shows in /healthz while the others go on, /metrics counts rows and
retries, and sync.toml is checked whole before anything connects."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ops.pgserver import free_port
from streamkeep.client import Client
from streamkeep.config.values import ConfigError
from streamkeep.sync import config as sync_config
from streamkeep.sync import process
from streamkeep.sync.stats import MappingStats, MappingStopped

CONFIG = """
[streamkeep]
url = "http://127.0.0.1:9"
[sync]
port = {port}
[[pg_to_stream]]
name = "items"
dsn = "postgresql://postgres@127.0.0.1:1/db"
tables = ["items"]
stream = "pg-items"
[[stream_to_pg]]
name = "sessions"
stream = "session-events"
dsn = "postgresql://postgres@127.0.0.1:1/db"
table = "public.session_events"
mode = "log"
"""


def parse(text: str, **environ: str) -> sync_config.SyncConfig:
    return sync_config.parse(tomllib.loads(text), environ)


def test_the_issues_example_config_is_read_with_its_defaults() -> None:
    loaded = parse(CONFIG.format(port=0), STREAMKEEP_TOKEN="from-env")
    source, sink = loaded.pg_to_stream[0], loaded.stream_to_pg[0]
    assert (source.slot, source.publication, source.tables) == (
        "streamkeep_items",
        "streamkeep_items",
        ("public.items",),
    )
    assert (sink.mode, sink.live, sink.on_gone, sink.dead_letter) == ("log", "sse", "stop", None)
    assert loaded.server.token == "from-env"  # no token in the file: the environment's
    assert loaded.mapping("sessions") is sink


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('mode = "log"', 'mode = "table"'), "`mode` = 'table' is not one of 'log', 'state'"),
        (('tables = ["items"]', "tables = []"), "`tables` = [] is not a non-empty list"),
        (('name = "items"', 'name = "Items!"'), "is not a mapping name"),
        (('name = "sessions"', 'name = "items"'), "two mappings are named 'items'"),
        (('stream = "pg-items"', 'stream = "pg-items"\nbatch_wait = "soon"'), "`batch_wait` = 'soon'"),
        (('stream = "pg-items"', 'stream = "pg-items"\nslots = "x"'), "unknown key(s) slots"),
        (('table = "public.session_events"', ""), "[[stream_to_pg]] sessions: `table` is required"),
    ],
)
def test_a_bad_config_names_the_key_and_what_is_accepted(change: tuple[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse(CONFIG.format(port=0).replace(*change))
    assert message in str(raised.value)


def test_the_command_refuses_a_bad_config_before_connecting(tmp_path: Path) -> None:
    path = tmp_path / "sync.toml"
    path.write_text(CONFIG.format(port=0).replace('mode = "log"', 'mode = "table"'))
    done = subprocess.run(
        [sys.executable, "-m", "streamkeep", "sync", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "configuration error: [[stream_to_pg]] sessions: `mode`" in done.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "streamkeep", "sync", "--config", str(path.with_name("none.toml"))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "cannot read" in missing.stderr


async def test_a_failing_mapping_is_retried_and_a_stopped_one_shows_in_healthz(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(process, "FIRST_BACKOFF", 0.01)
    failures = {"items": 0}

    async def flaky_source(mapping: Any, client: Client, stats: MappingStats) -> None:
        if failures["items"] < 3:
            failures["items"] += 1
            raise OSError(f"connection refused #{failures['items']}")
        stats.progressed(5, "0/16B3748")
        await trio.sleep_forever()

    async def stopping_sink(mapping: Any, client: Client, stats: MappingStats) -> None:
        raise MappingStopped("stream session-events was re-created; run `streamkeep sync reset sessions`")

    port = free_port()
    loaded = parse(CONFIG.format(port=port))
    async with trio.open_nursery() as nursery:
        runners = {"pg_to_stream": flaky_source, "stream_to_pg": stopping_sink}
        stats = await nursery.start(
            lambda task_status: process.run(loaded, runners=runners, task_status=task_status)
        )
        with trio.fail_after(10):
            while stats[0].state != "streaming" or stats[1].state != "stopped":
                await trio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            health = await http.get("/healthz")
            metrics = (await http.get("/metrics")).text
            missing = await http.get("/nothing")
        nursery.cancel_scope.cancel()
    assert stats[0].retries == 3 and stats[0].rows == 5 and stats[0].last_error is None
    assert health.status_code == 503
    body = health.json()
    assert body["mappings"]["items"]["state"] == "streaming"
    assert "streamkeep sync reset sessions" in body["mappings"]["sessions"]["stopped"]
    assert 'streamkeep_sync_rows_total{direction="pg_to_stream",mapping="items"} 5.0' in metrics
    assert 'streamkeep_sync_retries_total{direction="pg_to_stream",mapping="items"} 3.0' in metrics
    assert 'streamkeep_sync_state{direction="stream_to_pg",mapping="sessions",state="stopped"} 1.0' in metrics
    assert missing.status_code == 404 and "/healthz" in missing.json()["error"]
