"""Helpers for the sink's tests: a streamkeep server (the `server` fixture), a mapping, the sink
run in-process (restarted after failures as the sync process does), the fold of a stream as the
state-mode sink applies it (ops/torture/stateproto.py), and what a table holds."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import trio

from ops import serverproc
from ops.torture.stateproto import fold
from streamkeep.client import Client
from streamkeep.sync import process
from streamkeep.sync.config import StreamToPg
from streamkeep.sync.sink import run
from streamkeep.sync.stats import MappingStats


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """A streamkeep server in memory for a test module (import it into the module to use it)."""
    process = serverproc.start("--storage", "memory")
    yield process.url
    process.stop()


async def create(client: Client, name: str) -> None:
    await client.stream(name).create(content_type="application/json")


def mapping(dsn: str, name: str, mode: str = "state", **options: Any) -> StreamToPg:
    return StreamToPg(
        name=name, stream=f"{name}-stream", dsn=dsn, table=f"public.{name}", mode=mode, **options
    )


def change(kind: str, key: str, value: Any = None, operation: str = "insert") -> dict[str, Any]:
    message: dict[str, Any] = {"type": kind, "key": key, "headers": {"operation": operation}}
    if operation != "delete":
        message["value"] = value
    return message


def control(name: str) -> dict[str, Any]:
    return {"headers": {"control": name}}


async def stream_messages(client: Client, name: str) -> list[Any]:
    return [m for batch in await client.stream(name).read_all() for m in batch.messages or []]


def query(dsn: str, text: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(text, args).fetchall()  # type: ignore[arg-type]


def query_commit(dsn: str, text: str, *args: Any) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(text, args)  # type: ignore[arg-type]


def state_table(dsn: str, table: str) -> dict[tuple[str, str], Any]:
    return {(t, k): v for t, k, v in query(dsn, f"SELECT type, key, value FROM {table}")}


def log_table(dsn: str, table: str) -> list[Any]:
    return [r[0] for r in query(dsn, f"SELECT message FROM {table} ORDER BY stream_offset, message_index")]


def stored_offset(dsn: str, name: str) -> str | None:
    try:
        rows = query(dsn, "SELECT next_offset FROM streamkeep_sync.offsets WHERE mapping = %s", name)
    except psycopg.errors.UndefinedTable:
        return None
    return str(rows[0][0]) if rows else None


async def caught_up(client: Client, sink: StreamToPg) -> bool:
    """The stored offset is the stream's tail."""
    tail = (await client.stream(sink.stream).head()).next_offset
    return await trio.to_thread.run_sync(stored_offset, sink.dsn, sink.name) == tail


async def wait_for(check: Callable[[], Any], timeout: float = 30.0) -> None:
    with trio.fail_after(timeout):
        while not await check():
            await trio.sleep(0.05)


async def append(client: Client, name: str, messages: list[Any]) -> None:
    """One append of several messages (a JSON array body is flattened into its elements)."""
    await client.stream(name).append(json.dumps(messages).encode(), content_type="application/json")


async def run_until_caught_up(url: str, sink: StreamToPg, timeout: float = 30.0) -> MappingStats:
    """Runs the sink as the sync process does (restarted after failures) until it stored the tail."""
    stats = MappingStats(sink.name, "stream_to_pg")

    async def done() -> bool:
        assert stats.state != "stopped", stats.stopped
        return await caught_up(client, sink)

    async with Client(url) as client, trio.open_nursery() as nursery:
        nursery.start_soon(process.keep_running, sink, run, client, stats)
        await wait_for(done, timeout)
        nursery.cancel_scope.cancel()
    return stats


async def assert_state_is_fold(client: Client, sink: StreamToPg) -> None:
    expected = fold(await stream_messages(client, sink.stream))
    assert await trio.to_thread.run_sync(state_table, sink.dsn, sink.table) == expected


async def assert_log_is_stream(client: Client, sink: StreamToPg) -> None:
    expected = await stream_messages(client, sink.stream)
    got = await trio.to_thread.run_sync(log_table, sink.dsn, sink.table)
    assert got == expected  # jsonb orders keys its own way: compared as values
