"""The sink (stream -> Postgres) against a real Postgres and a real streamkeep: log and state modes
end to end, snapshots and resets, misfits, fencing, 404/410, no echo. Each ends with the table equal
to the fold of the stream (state) or the stream's messages in order (log), exactly once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ops import serverproc
from streamkeep.client import Client
from tests import postgres as pg_fixtures
from tests.sync_sink_helpers import (
    append,
    assert_log_is_stream,
    assert_state_is_fold,
    change,
    mapping,
    query,
    run_until_caught_up,
    state_table,
)

postgres, database = pg_fixtures.postgres, pg_fixtures.database  # the fixtures, under their names


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    process = serverproc.start("--storage", "memory")
    yield process.url
    process.stop()


async def create(client: Client, name: str) -> None:
    await client.stream(name).create(content_type="application/json")


async def test_log_mode_writes_one_row_per_message_with_mapped_columns(server: str, database: str) -> None:
    sink = mapping(database, "events", "log", columns={"user_id": "value.user", "n": "n"})
    async with Client(server) as client:
        await create(client, sink.stream)
        for n in range(5):
            await append(
                client, sink.stream, [{"n": n * 10 + i, "value": {"user": f"u{i}"}} for i in range(10)]
            )
        await run_until_caught_up(server, sink)
        await assert_log_is_stream(client, sink)
        rows = query(database, "SELECT user_id, n FROM events ORDER BY stream_offset, message_index")
        assert rows[:2] == [("u0", "0"), ("u1", "1")] and len(rows) == 50


async def test_state_mode_table_is_the_fold_of_the_stream(server: str, database: str) -> None:
    sink = mapping(database, "items")
    async with Client(server) as client:
        await create(client, sink.stream)
        s = sink.stream
        await append(client, s, [change("item", str(k), {"v": k}) for k in range(100)])
        await append(client, s, [change("item", str(k), {"v": -k}, "update") for k in range(0, 100, 2)])
        await append(client, s, [change("item", str(k), operation="delete") for k in range(0, 100, 3)])
        await append(client, s, [change("user", "1", "x"), change("user", "1", "y", "update")])
        stats = await run_until_caught_up(server, sink)
        await assert_state_is_fold(client, sink)
        assert stats.rows == 100 + 50 + 34 + 2 and stats.state == "streaming"
        # more after a restart: applied from the stored offset, exactly once
        await append(client, s, [change("item", "1", {"v": "again"}, "update")])
        await run_until_caught_up(server, sink)
        await assert_state_is_fold(client, sink)
        assert state_table(database, "items")[("item", "1")] == {"v": "again"}
