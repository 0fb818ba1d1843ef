"""Postgres -> stream (streamkeep/sync/source): a real Postgres (tests/postgres.py) and a real
streamkeep server; the bridge runs in this process under trio (the crash tests, which kill it, are
in test_sync_source_crash.py). Each test ends with the stream holding every committed transaction
exactly once, in commit order."""

from __future__ import annotations

import itertools
import os
import struct
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest
import trio

from ops import serverproc
from ops.torture.stateproto import fold
from streamkeep.client import Client, StaleEpoch
from streamkeep.client.sync import Client as BlockingClient
from streamkeep.sync import source
from streamkeep.sync.config import PgToStream
from streamkeep.sync.source import checkpoint, encode, pgoutput
from streamkeep.sync.source.bridge import BridgeBusy
from streamkeep.sync.stats import MappingStats, MappingStopped
from tests import postgres as pg_fixtures

# The fixtures (a real Postgres per worker, a fresh database per test), under the names tests use.
postgres = pg_fixtures.postgres
database = pg_fixtures.database
_names = itertools.count()
ITEMS = (
    "CREATE TABLE items (id int PRIMARY KEY, name text, qty int, price numeric, ok bool, doc jsonb)",
    "ALTER TABLE items REPLICA IDENTITY FULL",
)


@pytest.fixture(scope="module")
def server() -> Iterator[serverproc.ServerProcess]:
    process = serverproc.start("--storage", "memory")
    yield process
    process.stop()


def unique(prefix: str = "m") -> str:
    """Slots are cluster-wide: every test's mapping gets a name no other test (or worker) has."""
    return f"{prefix}_{os.getpid()}_{next(_names)}"


def mapping_for(dsn: str, name: str | None = None, **options: Any) -> PgToStream:
    name = name or unique()
    defaults: dict[str, Any] = {
        "tables": ("public.items",),
        "stream": f"pg-{name}",
        "slot": f"sk_{name}",
        "publication": f"sk_{name}",
        "batch_rows": 50,
        "batch_wait": 0.02,
    }
    return PgToStream(name=name, dsn=dsn, **{**defaults, **options})


def execute(dsn: str, *statements: str, origin: str | None = None) -> None:
    """Runs `statements` as one transaction (with `origin`: as the sink's sessions do)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if origin:
            conn.execute(
                "SELECT pg_replication_origin_create(%s) WHERE NOT EXISTS"
                " (SELECT FROM pg_replication_origin WHERE roname = %s)",
                (origin, origin),
            )
            conn.execute("SELECT pg_replication_origin_session_setup(%s)", (origin,))
        with conn.transaction():
            for statement in statements:
                conn.execute(statement)


def stream_messages(url: str, stream: str) -> list[dict[str, Any]]:
    with BlockingClient(url) as client:
        handle = client.stream(stream)
        if not handle.exists():
            return []
        return [m for batch in handle.read_all() for m in batch.messages or []]


def changes(messages: list[dict[str, Any]]) -> list[tuple[str, str, Any]]:
    """(operation, key, value) of each change message, controls as ("control", name, None)."""
    out: list[tuple[str, str, Any]] = []
    for m in messages:
        headers = m["headers"]
        if "control" in headers:
            out.append(("control", headers["control"], None))
        else:
            out.append((headers["operation"], m["key"], m.get("value")))
    return out


def live(messages: list[dict[str, Any]]) -> list[tuple[str, str, Any]]:
    """The change messages after the (last) snapshot."""
    listed = changes(messages)
    ends = [i for i, c in enumerate(listed) if c == ("control", "snapshot-end", None)]
    return listed[ends[-1] + 1 :] if ends else listed


def table_state(dsn: str) -> dict[tuple[str, str], Any]:
    """The items table as the fold of its stream should be (numeric as its text, as sent)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT id::text, to_jsonb(t) || jsonb_build_object('price', price::text) FROM items t"
        ).fetchall()
    return {("public.items", str(key)): value for key, value in rows}


async def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


async def wait_until(
    url: str, stream: str, done: Callable[[list[dict[str, Any]]], bool], timeout: float = 15
) -> list[dict[str, Any]]:
    async with Client(url) as client:
        handle = client.stream(stream)
        with trio.fail_after(timeout):
            while True:
                messages: list[dict[str, Any]] = []
                if await handle.exists():
                    messages = [m for batch in await handle.read_all() for m in batch.messages or []]
                if done(messages):
                    return messages
                await trio.sleep(0.05)


async def keep_running(mapping: PgToStream, url: str, stats: MappingStats, retry: bool = True) -> None:
    """What the sync process does: `run` again after any failure but MappingStopped."""
    async with Client(url, retries=2) as client:
        while True:
            try:
                await source.run(mapping, client, stats)
            except MappingStopped:
                raise
            except Exception as error:  # transient: Postgres down, slot busy ...
                if not retry:
                    raise
                stats.last_error = repr(error)
                stats.retries += 1
                await trio.sleep(0.2)


def with_bridge(
    mapping: PgToStream, url: str, body: Callable[[MappingStats], Awaitable[Any]], retry: bool = True
) -> MappingStats:
    """Runs `body` beside the bridge (restarted after transient failures unless not `retry`)."""
    stats = MappingStats(mapping.name, "pg_to_stream")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_running, mapping, url, stats, retry)
            await body(stats)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    except BaseExceptionGroup as group:  # the nursery's: one failure, raised as itself
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    return stats


def snapshot_done(messages: list[dict[str, Any]]) -> bool:
    return ("control", "snapshot-end", None) in changes(messages)


def test_pgoutput_and_encoding_are_deterministic() -> None:
    assert pgoutput.lsn_text(pgoutput.lsn_parse("1/16B3748")) == "1/16B3748"
    assert encode.to_json(16, "t") is True and encode.to_json(20, "9007199254740993") == 9007199254740993
    assert encode.to_json(1700, "1.10") == "1.10" and encode.to_json(701, "NaN") == "NaN"
    assert encode.key_text(["a"]) == "a" and encode.key_text(["a", "b"]) == '["a","b"]'
    one = encode.payload([encode.change("public.t", "1", "insert", {"b": 1, "a": "é"}, 7, "0/1")])
    assert one == encode.payload([encode.change("public.t", "1", "insert", {"b": 1, "a": "é"}, 7, "0/1")])
    assert (
        one
        == '[{"type":"public.t","key":"1","value":{"b":1,"a":"é"},"headers":{"operation":"insert","txid":"7","lsn":"0/1"}}]'.encode()
    )


def test_snapshot_then_live_changes_in_commit_order(database: str, server: serverproc.ServerProcess) -> None:
    execute(database, *ITEMS)
    execute(
        database,
        "INSERT INTO items VALUES (1, 'a', 1, 1.50, true, '{\"x\": [1]}'), (2, 'b', 2, NULL, false, NULL)",
    )
    mapping = mapping_for(database)

    async def body(stats: MappingStats) -> None:
        await wait_until(server.url, mapping.stream, snapshot_done)
        await in_thread(execute, database, "INSERT INTO items VALUES (3, 'c', 3, 3, true, '[]')")
        await in_thread(
            execute,
            database,
            "UPDATE items SET name = 'A' WHERE id = 1",
            "DELETE FROM items WHERE id = 2",
            "UPDATE items SET id = 30 WHERE id = 3",  # a key change: delete + insert
        )
        for i in range(100, 160):  # more rows than a batch: batches close on batch_rows too
            await in_thread(execute, database, f"INSERT INTO items (id, name) VALUES ({i}, 'n{i}')")
        await wait_until(server.url, mapping.stream, lambda ms: len(live(ms)) >= 65)

    stats = with_bridge(mapping, server.url, body)
    messages = stream_messages(server.url, mapping.stream)
    listed = changes(messages)
    assert listed[:4] == [
        ("control", "snapshot-start", None),
        ("insert", "1", {"id": 1, "name": "a", "qty": 1, "price": "1.50", "ok": True, "doc": {"x": [1]}}),
        ("insert", "2", {"id": 2, "name": "b", "qty": 2, "price": None, "ok": False, "doc": None}),
        ("control", "snapshot-end", None),
    ]
    assert listed[4:9] == [
        ("insert", "3", {"id": 3, "name": "c", "qty": 3, "price": "3", "ok": True, "doc": []}),
        ("update", "1", {"id": 1, "name": "A", "qty": 1, "price": "1.50", "ok": True, "doc": {"x": [1]}}),
        ("delete", "2", None),
        ("delete", "3", None),
        ("insert", "30", {"id": 30, "name": "c", "qty": 3, "price": "3", "ok": True, "doc": []}),
    ]
    assert [key for _, key, _ in listed[9:]] == [str(i) for i in range(100, 160)]
    # One transaction's messages carry one txid and one commit LSN; LSNs grow in commit order.
    multi = messages[5:9]
    assert len({m["headers"]["txid"] for m in multi}) == 1 and len({m["headers"]["lsn"] for m in multi}) == 1
    lsns = [pgoutput.lsn_parse(m["headers"]["lsn"]) for m in messages[4:] if "lsn" in m["headers"]]
    assert lsns == sorted(lsns)
    assert fold(messages) == table_state(database)
    # (stats move after the confirm, a moment after the rows are readable)
    assert stats.rows >= 2 and stats.state == "streaming" and stats.position


def test_exactly_once_across_restarts(database: str, server: serverproc.ServerProcess) -> None:
    execute(database, *ITEMS)
    mapping = mapping_for(database, batch_rows=7)
    ids = iter(range(1, 10_000))

    def write(count: int) -> None:
        for _ in range(count):
            execute(database, *(f"INSERT INTO items (id, name) VALUES ({next(ids)}, 'x')" for _ in range(3)))

    async def first(stats: MappingStats) -> None:
        await wait_until(server.url, mapping.stream, snapshot_done)
        await in_thread(write, 10)
        await wait_until(server.url, mapping.stream, lambda ms: len(live(ms)) >= 30)

    async def second(stats: MappingStats) -> None:
        await in_thread(write, 10)
        await wait_until(server.url, mapping.stream, lambda ms: len(live(ms)) >= 90)

    with_bridge(mapping, server.url, first)
    write(10)  # committed while no bridge runs: the slot keeps them
    with_bridge(mapping, server.url, second)
    keys = [key for _, key, _ in live(stream_messages(server.url, mapping.stream))]
    assert keys == [str(i) for i in range(1, 91)]
    with psycopg.connect(database) as conn:
        row = conn.execute(
            "SELECT epoch, pending_seq, producer_id FROM streamkeep_sync.checkpoints WHERE name = %s",
            (mapping.name,),
        ).fetchone()
    assert row is not None and row[:2] == (1, None)  # epoch 0 from the snapshot, 1 after the takeover
    # The takeover fenced the old epoch on the server too: a paused first bridge's append is refused.
    with BlockingClient(server.url) as client, pytest.raises(StaleEpoch):
        client.stream(mapping.stream).append(
            b"[]", headers={"Producer-Id": str(row[2]), "Producer-Epoch": "0", "Producer-Seq": "99"}
        )


def test_second_bridge_on_the_slot_is_refused(database: str, server: serverproc.ServerProcess) -> None:
    execute(database, *ITEMS)
    mapping = mapping_for(database)

    async def body(stats: MappingStats) -> None:
        await wait_until(server.url, mapping.stream, snapshot_done)
        async with Client(server.url) as client:
            with pytest.raises(BridgeBusy):
                await source.run(mapping, client, MappingStats("second", "pg_to_stream"))
        with pytest.raises(BridgeBusy):
            await in_thread(source.reset, mapping)
        await in_thread(execute, database, "INSERT INTO items (id) VALUES (1)")
        await wait_until(server.url, mapping.stream, lambda ms: len(live(ms)) == 1)

    with_bridge(mapping, server.url, body)
    assert [key for _, key, _ in live(stream_messages(server.url, mapping.stream))] == ["1"]


def test_a_paused_old_bridge_cannot_move_the_checkpoint(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        store = checkpoint.CheckpointStore(conn, "streamkeep_sync.checkpoints", "fenced")
        store.ensure_table()
        mine = store.claim(None, checkpoint.Checkpoint("p", 0, 0, 100, None, 0))
        theirs = store.claim(mine, mine)  # a new bridge took over
        with pytest.raises(checkpoint.Fenced):
            store.save(mine.with_pending(200))
        store.save(theirs.with_pending(300))
        loaded = store.load()
        assert loaded is not None and loaded.pending == checkpoint.Pending(0, 300)


def test_added_column_flows_through(database: str, server: serverproc.ServerProcess) -> None:
    execute(database, *ITEMS)
    mapping = mapping_for(database)

    async def body(stats: MappingStats) -> None:
        await wait_until(server.url, mapping.stream, snapshot_done)
        await in_thread(execute, database, "INSERT INTO items (id, name) VALUES (1, 'a')")
        await in_thread(execute, database, "ALTER TABLE items ADD COLUMN color text DEFAULT 'red'")
        await in_thread(execute, database, "INSERT INTO items (id, name, color) VALUES (2, 'b', 'blue')")
        await in_thread(execute, database, "UPDATE items SET qty = 5 WHERE id = 1")
        await wait_until(server.url, mapping.stream, lambda ms: len(live(ms)) >= 3)

    with_bridge(mapping, server.url, body)
    listed = live(stream_messages(server.url, mapping.stream))
    assert "color" not in listed[0][2]
    assert listed[1][2]["color"] == "blue" and listed[2][2]["color"] == "red" and listed[2][2]["qty"] == 5


def test_toast_table_needs_replica_identity_full(database: str, server: serverproc.ServerProcess) -> None:
    execute(database, "CREATE TABLE docs (id int PRIMARY KEY, body text, n int)")
    mapping = mapping_for(database, tables=("public.docs",))

    async def refused() -> None:
        async with Client(server.url) as client:
            await source.run(mapping, client, MappingStats(mapping.name, "pg_to_stream"))

    with pytest.raises(MappingStopped, match="REPLICA IDENTITY FULL"):
        trio.run(refused)
    big = "x" * 100_000  # TOASTed (out of line): an UPDATE of `n` alone logs it as unchanged
    execute(
        database, "ALTER TABLE docs REPLICA IDENTITY FULL", "ALTER TABLE docs ALTER body SET STORAGE EXTERNAL"
    )

    async def body(stats: MappingStats) -> None:
        await wait_until(server.url, mapping.stream, snapshot_done)
        await in_thread(execute, database, f"INSERT INTO docs VALUES (1, '{big}', 0)")
        await in_thread(execute, database, "UPDATE docs SET n = 1 WHERE id = 1")
        await wait_until(server.url, mapping.stream, lambda ms: len(live(ms)) >= 2)

    with_bridge(mapping, server.url, body)
    listed = live(stream_messages(server.url, mapping.stream))
    assert listed[1] == ("update", "1", {"id": 1, "body": big, "n": 1})


def test_table_without_primary_key_is_refused(database: str, server: serverproc.ServerProcess) -> None:
    execute(database, "CREATE TABLE nokey (a int)")
    mapping = mapping_for(database, tables=("public.nokey",))

    async def main() -> None:
        async with Client(server.url) as client:
            await source.run(mapping, client, MappingStats(mapping.name, "pg_to_stream"))

    with pytest.raises(MappingStopped, match="no primary key"):
        trio.run(main)


def test_sink_origin_transactions_are_skipped(database: str, server: serverproc.ServerProcess) -> None:
    execute(database, *ITEMS)
    mapping = mapping_for(database)

    async def body(stats: MappingStats) -> None:
        await wait_until(server.url, mapping.stream, snapshot_done)
        await in_thread(execute, database, "INSERT INTO items (id) VALUES (1)")
        await in_thread(execute, database, "INSERT INTO items (id) VALUES (2)", origin="streamkeep_sync")
        await in_thread(execute, database, "INSERT INTO items (id) VALUES (3)")
        await in_thread(
            execute, database, "INSERT INTO items (id) VALUES (4)", origin="streamkeep_sync_sessions"
        )
        await in_thread(execute, database, "INSERT INTO items (id) VALUES (5)", origin="elsewhere")
        await wait_until(server.url, mapping.stream, lambda ms: len(live(ms)) >= 3)
        await trio.sleep(0.2)

    with_bridge(mapping, server.url, body)
    # The sink's origins (the shared name, or one per sink mapping) are skipped; others are not.
    assert [key for _, key, _ in live(stream_messages(server.url, mapping.stream))] == ["1", "3", "5"]


def slot_confirmed(dsn: str, slot: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    assert row is not None
    return pgoutput.lsn_parse(str(row[0]))


def test_idle_publication_still_confirms(database: str, server: serverproc.ServerProcess) -> None:
    execute(database, *ITEMS, "CREATE TABLE other (id int PRIMARY KEY)")
    mapping = mapping_for(database)

    async def body(stats: MappingStats) -> None:
        await wait_until(server.url, mapping.stream, snapshot_done)
        before = await in_thread(slot_confirmed, database, mapping.slot)
        for i in range(20):  # WAL, none of it published
            await in_thread(execute, database, f"INSERT INTO other VALUES ({i})")
        with psycopg.connect(database) as conn:
            wal_end = pgoutput.lsn_parse(str(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]))  # type: ignore[index]
        assert wal_end > before
        with trio.fail_after(20):  # the walsender's keepalives carry its WAL end; we confirm it
            while await in_thread(slot_confirmed, database, mapping.slot) < wal_end:
                await in_thread(execute, database, "SELECT pg_switch_wal()")  # nudges a keepalive
                await trio.sleep(0.2)

    with_bridge(mapping, server.url, body)
    assert live(stream_messages(server.url, mapping.stream)) == []


def test_reset_starts_a_new_snapshot_behind_a_reset_control(
    database: str, server: serverproc.ServerProcess
) -> None:
    execute(database, *ITEMS, "INSERT INTO items (id) VALUES (1), (2)")
    mapping = mapping_for(database)

    async def first(stats: MappingStats) -> None:
        await wait_until(server.url, mapping.stream, snapshot_done)
        await in_thread(execute, database, "DELETE FROM items WHERE id = 2")
        await wait_until(server.url, mapping.stream, lambda ms: len(live(ms)) >= 1)

    with_bridge(mapping, server.url, first)
    assert "dropped" in source.reset(mapping)
    execute(database, "INSERT INTO items (id) VALUES (3)")

    async def second(stats: MappingStats) -> None:
        await wait_until(
            server.url, mapping.stream, lambda ms: changes(ms).count(("control", "snapshot-end", None)) == 2
        )

    with_bridge(mapping, server.url, second)
    messages = stream_messages(server.url, mapping.stream)
    listed = changes(messages)
    assert listed[5:] == [
        ("control", "reset", None),
        ("control", "snapshot-start", None),
        ("insert", "1", {"id": 1, "name": None, "qty": None, "price": None, "ok": None, "doc": None}),
        ("insert", "3", {"id": 3, "name": None, "qty": None, "price": None, "ok": None, "doc": None}),
        ("control", "snapshot-end", None),
    ]
    assert fold(messages) == table_state(database)


def test_dropped_table_stops_the_mapping(database: str, server: serverproc.ServerProcess) -> None:
    execute(database, *ITEMS)
    mapping = mapping_for(database)

    async def body(stats: MappingStats) -> None:
        await wait_until(server.url, mapping.stream, snapshot_done)

    with_bridge(mapping, server.url, body)
    execute(database, "DROP TABLE items")

    async def main() -> None:
        async with Client(server.url) as client:
            await source.run(mapping, client, MappingStats(mapping.name, "pg_to_stream"))

    with pytest.raises(MappingStopped, match=f"streamkeep sync reset {mapping.name}"):
        trio.run(main)


def test_changed_primary_key_stops_the_mapping(database: str, server: serverproc.ServerProcess) -> None:
    execute(database, *ITEMS)
    mapping = mapping_for(database)
    change_key = (
        "ALTER TABLE items DROP CONSTRAINT items_pkey",
        "ALTER TABLE items ADD PRIMARY KEY (id, qty)",
    )

    async def running(stats: MappingStats) -> None:
        await wait_until(server.url, mapping.stream, snapshot_done)
        await in_thread(execute, database, *change_key)
        await in_thread(execute, database, "INSERT INTO items (id, qty) VALUES (1, 1)")
        await trio.sleep(10)  # the bridge stops first

    with pytest.raises(MappingStopped, match=r"the primary key of public\.items changed"):
        with_bridge(mapping, server.url, running, retry=False)  # stopped by the running bridge
    assert live(stream_messages(server.url, mapping.stream)) == []

    # Changed while no bridge ran: the checkpoint remembers the key the stream was made with.
    other = mapping_for(database, name=unique("k"))
    execute(
        database, "ALTER TABLE items DROP CONSTRAINT items_pkey", "ALTER TABLE items ADD PRIMARY KEY (id)"
    )
    with_bridge(other, server.url, lambda stats: wait_until(server.url, other.stream, snapshot_done))
    execute(database, *change_key)

    async def restarted() -> None:
        async with Client(server.url) as client:
            await source.run(other, client, MappingStats(other.name, "pg_to_stream"))

    with pytest.raises(MappingStopped, match="primary keys changed"):
        trio.run(restarted)


def test_deleted_stream_stops_the_mapping(database: str, server: serverproc.ServerProcess) -> None:
    execute(database, *ITEMS)
    mapping = mapping_for(database)
    with_bridge(mapping, server.url, lambda stats: wait_until(server.url, mapping.stream, snapshot_done))
    with BlockingClient(server.url) as client:
        client.stream(mapping.stream).delete()

    async def restarted() -> None:
        async with Client(server.url) as client:
            await source.run(mapping, client, MappingStats(mapping.name, "pg_to_stream"))

    with pytest.raises(MappingStopped, match="was deleted"):
        trio.run(restarted)
    source.reset(mapping)
    execute(database, "INSERT INTO items (id) VALUES (1)")
    with_bridge(mapping, server.url, lambda stats: wait_until(server.url, mapping.stream, snapshot_done))
    messages = stream_messages(server.url, mapping.stream)
    assert fold(messages) == table_state(database)


def test_invalidated_slot_stops_the_mapping(database: str, server: serverproc.ServerProcess) -> None:
    execute(database, *ITEMS, "CREATE TABLE other (id int)")
    mapping = mapping_for(database)
    with_bridge(mapping, server.url, lambda stats: wait_until(server.url, mapping.stream, snapshot_done))
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
        conn.execute("SELECT pg_reload_conf()")
        try:
            for _ in range(40):  # WAL past the slot's allowance, recycled at a checkpoint
                conn.execute("INSERT INTO other SELECT generate_series(1, 2000)")
                conn.execute("SELECT pg_switch_wal()")
                conn.execute("CHECKPOINT")
                row = conn.execute(
                    "SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (mapping.slot,)
                ).fetchone()
                if row and row[0] == "lost":
                    break
            assert row and row[0] == "lost"
        finally:
            conn.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
            conn.execute("SELECT pg_reload_conf()")

    async def restarted() -> None:
        async with Client(server.url) as client:
            await source.run(mapping, client, MappingStats(mapping.name, "pg_to_stream"))

    with pytest.raises(MappingStopped, match="invalidated"):
        trio.run(restarted)


def test_truncate_of_the_mapping_is_a_reset(database: str, server: serverproc.ServerProcess) -> None:
    execute(database, *ITEMS, "INSERT INTO items (id) VALUES (1), (2)")
    mapping = mapping_for(database)

    async def body(stats: MappingStats) -> None:
        await wait_until(server.url, mapping.stream, snapshot_done)
        await in_thread(execute, database, "TRUNCATE items", "INSERT INTO items (id) VALUES (3)")
        await wait_until(server.url, mapping.stream, lambda ms: len(live(ms)) >= 2)

    with_bridge(mapping, server.url, body)
    messages = stream_messages(server.url, mapping.stream)
    assert [(op, key) for op, key, _ in live(messages)] == [("control", "reset"), ("insert", "3")]
    assert fold(messages) == table_state(database)


def test_a_truncate_of_some_tables_stops_after_the_transactions_before_it(
    database: str, server: serverproc.ServerProcess
) -> None:
    """TRUNCATE of one of a mapping's two tables has no State Protocol form: the mapping stops at
    it, and the transactions read before it, even those still gathering into a batch, are on the
    stream first (the bridge reads them in one go on its next start)."""
    execute(database, *ITEMS, "CREATE TABLE other (id int PRIMARY KEY)")
    mapping = mapping_for(database, tables=("public.items", "public.other"), batch_wait=5.0)

    async def snapshot(stats: MappingStats) -> None:
        await wait_until(server.url, mapping.stream, snapshot_done)

    with_bridge(mapping, server.url, snapshot)
    for n in range(1, 6):  # a transaction each
        execute(database, f"INSERT INTO items (id) VALUES ({n})")
    execute(database, "INSERT INTO items (id) VALUES (6)", "TRUNCATE other")  # not on the stream

    async def stopped() -> None:
        async with Client(server.url) as client:
            await source.run(mapping, client, MappingStats(mapping.name, "pg_to_stream"))

    with pytest.raises(MappingStopped, match=r"TRUNCATE of public\.other"):
        trio.run(stopped)
    listed = live(stream_messages(server.url, mapping.stream))
    assert [(op, key) for op, key, _ in listed] == [("insert", str(n)) for n in range(1, 6)]


def test_several_tables_and_a_composite_key(database: str, server: serverproc.ServerProcess) -> None:
    execute(
        database,
        *ITEMS,
        "CREATE TABLE pairs (a int, b text, v int, PRIMARY KEY (a, b))",
        "ALTER TABLE pairs REPLICA IDENTITY FULL",
        "INSERT INTO pairs VALUES (1, 'x', 0)",
    )
    mapping = mapping_for(database, tables=("public.items", "public.pairs"))

    async def body(stats: MappingStats) -> None:
        await wait_until(server.url, mapping.stream, snapshot_done)
        await in_thread(
            execute,
            database,
            "INSERT INTO items (id) VALUES (7)",
            "UPDATE pairs SET v = 1 WHERE a = 1",
            "DELETE FROM pairs WHERE a = 1",
        )
        await wait_until(server.url, mapping.stream, lambda ms: len(live(ms)) >= 3)

    with_bridge(mapping, server.url, body)
    messages = stream_messages(server.url, mapping.stream)
    assert [(m.get("type"), m.get("key")) for m in messages] == [
        (None, None),
        ("public.pairs", '["1","x"]'),
        (None, None),
        ("public.items", "7"),
        ("public.pairs", '["1","x"]'),
        ("public.pairs", '["1","x"]'),
    ]
    assert [m["headers"]["operation"] for m in messages[3:]] == ["insert", "update", "delete"]
    assert messages[4]["value"] == {"a": 1, "b": "x", "v": 1}


def test_without_snapshot_only_changes_flow(database: str, server: serverproc.ServerProcess) -> None:
    execute(database, *ITEMS, "INSERT INTO items (id) VALUES (1)")
    mapping = mapping_for(database, snapshot=False)

    async def body(stats: MappingStats) -> None:
        with trio.fail_after(10):
            while stats.state != "streaming":
                await trio.sleep(0.05)
        await in_thread(execute, database, "INSERT INTO items (id) VALUES (2)")
        await wait_until(server.url, mapping.stream, lambda ms: len(ms) >= 1)

    with_bridge(mapping, server.url, body)
    assert changes(stream_messages(server.url, mapping.stream)) == [
        ("insert", "2", {"id": 2, "name": None, "qty": None, "price": None, "ok": None, "doc": None})
    ]


def _tuple(*values: str | None) -> bytes:
    out = struct.pack("!h", len(values))
    for value in values:
        if value is None:
            out += b"n"
        elif value == "<unchanged>":
            out += b"u"
        else:
            out += b"t" + struct.pack("!I", len(value.encode())) + value.encode()
    return out


def test_pgoutput_decodes_every_message_kind() -> None:
    relation = (
        b"R" + struct.pack("!I", 7) + b"public\0items\0f" + struct.pack("!h", 2)
        + b"\x01id\0" + struct.pack("!Ii", 23, -1) + b"\x00body\0" + struct.pack("!Ii", 25, -1)
    )  # fmt: skip
    decoded = pgoutput.decode(relation)
    assert isinstance(decoded, pgoutput.Relation) and decoded.qualified == "public.items"
    assert [(c.name, c.type_oid, c.key) for c in decoded.columns] == [("id", 23, True), ("body", 25, False)]
    update = b"U" + struct.pack("!I", 7) + b"O" + _tuple("1", "long") + b"N" + _tuple("1", "<unchanged>")
    assert pgoutput.decode(b"xx" + update, 2) == pgoutput.Update(7, ("1", "long"), ("1", pgoutput.UNCHANGED))
    assert pgoutput.decode(b"D" + struct.pack("!I", 7) + b"K" + _tuple("1", None)) == pgoutput.Delete(
        7, ("1", None)
    )
    assert pgoutput.decode(b"T" + struct.pack("!IBII", 2, 1, 7, 8)) == pgoutput.Truncate((7, 8), True, False)
    assert pgoutput.decode(b"O" + struct.pack("!Q", 5) + b"streamkeep_sync_x\0") == pgoutput.Origin(
        5, "streamkeep_sync_x"
    )
    assert pgoutput.decode(b"Y" + struct.pack("!I", 99) + b"public\0mood\0") == pgoutput.TypeInfo(
        99, "public", "mood"
    )
    assert pgoutput.decode(b"B" + struct.pack("!QqI", 10, 20, 30)) == pgoutput.Begin(10, 20, 30)
    assert pgoutput.decode(b"C" + struct.pack("!BQQq", 0, 1, 2, 3)) == pgoutput.Commit(1, 2, 3)
    with pytest.raises(pgoutput.DecodeError):
        pgoutput.decode(b"I" + struct.pack("!I", 7) + b"N" + _tuple("1")[:-1])
    with pytest.raises(pgoutput.DecodeError):
        pgoutput.decode(b"Z")
    keepalive = b"k" + struct.pack("!QqB", 77, 0, 1)
    assert pgoutput.decode_copy(keepalive) == pgoutput.Keepalive(77, True)
    xlog = b"w" + struct.pack("!QQq", 1, 88, 0) + b"B" + struct.pack("!QqI", 10, 20, 30)
    assert pgoutput.wal_end(xlog) == 88 and pgoutput.decode(xlog, pgoutput.XLOG_PAYLOAD) == pgoutput.Begin(
        10, 20, 30
    )


def test_writes_during_the_snapshot_arrive_once(database: str, server: serverproc.ServerProcess) -> None:
    execute(database, *ITEMS, "INSERT INTO items (id, qty) SELECT i, 0 FROM generate_series(1, 3000) i")
    mapping = mapping_for(database, batch_rows=100)

    def write_during() -> None:
        for i in range(40):
            execute(
                database,
                f"INSERT INTO items (id, qty) VALUES ({10_000 + i}, 1)",
                f"UPDATE items SET qty = qty + 1 WHERE id = {1 + i * 70}",
            )

    async def body(stats: MappingStats) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(in_thread, write_during)  # while the copy runs
        expected = await in_thread(table_state, database)
        await wait_until(server.url, mapping.stream, lambda ms: snapshot_done(ms) and fold(ms) == expected)

    with_bridge(mapping, server.url, body)
    messages = stream_messages(server.url, mapping.stream)
    assert fold(messages) == table_state(database)
    inserted = [m["key"] for m in messages if m.get("headers", {}).get("operation") == "insert"]
    assert len(inserted) == len(set(inserted)) == 3040  # each row inserted once: in the copy or after it


def test_table_dropped_under_a_running_bridge_stops_it(
    database: str, server: serverproc.ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamkeep.sync.source import bridge

    monkeypatch.setattr(bridge, "STATUS_EVERY", 0.1)  # the idle loop's period, and so its table check
    monkeypatch.setattr(bridge, "TABLE_CHECK_EVERY", 0.1)
    execute(database, *ITEMS)
    mapping = mapping_for(database)

    async def body(stats: MappingStats) -> None:
        await wait_until(server.url, mapping.stream, snapshot_done)
        await in_thread(execute, database, "DROP TABLE items")
        await trio.sleep(10)  # the bridge stops first

    with pytest.raises(MappingStopped, match="does not exist"):
        with_bridge(mapping, server.url, body, retry=False)


def test_json_numbers_past_a_floats_range_keep_their_text() -> None:
    """Postgres' json takes 1e400; a float has no JSON form for it and the server refuses what it
    cannot store, which held the slot (and Postgres' WAL) for ever. Its text goes instead, as a
    float column's Infinity does, and the batch is valid JSON."""
    value = encode.to_json(114, '{"big": 1e400, "small": -1e999, "ok": 0.5, "n": [2e308]}')
    assert value == {"big": "1e400", "small": "-1e999", "ok": 0.5, "n": ["2e308"]}
    assert encode.to_json(701, "Infinity") == "Infinity" and encode.to_json(701, "1.5") == 1.5
    body = encode.payload([encode.change("public.t", "1", "insert", {"j": value}, 7, "0/1")])
    assert b"Infinity" not in body and b'"big":"1e400"' in body
