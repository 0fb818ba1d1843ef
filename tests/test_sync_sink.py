"""The sink (stream -> Postgres) against a real Postgres and a real streamkeep: log and state modes
end to end, snapshots and resets, misfits, fencing, 404/410, no echo. Each ends with the table equal
to the fold of the stream (state) or the stream's messages in order (log), exactly once."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
import trio

from streamkeep.client import Batch, Client
from streamkeep.sync import process
from streamkeep.sync.config import StreamToPg
from streamkeep.sync.sink import commit, offsets, reset, run
from streamkeep.sync.sink.batch import Outcome
from streamkeep.sync.sink.bridge import Sink
from streamkeep.sync.sink.names import Names
from streamkeep.sync.stats import MappingStats, MappingStopped
from tests import postgres as pg_fixtures
from tests import sync_sink_helpers
from tests.sync_sink_helpers import (
    append,
    assert_log_is_stream,
    assert_state_is_fold,
    caught_up,
    change,
    control,
    create,
    mapping,
    query,
    query_commit,
    run_until_caught_up,
    state_table,
    stored_offset,
    wait_for,
)

postgres, database = pg_fixtures.postgres, pg_fixtures.database  # the fixtures, under their names
server = sync_sink_helpers.server  # a streamkeep for the module, a fixture too


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
        assert stats.position == (await client.stream(s).head()).next_offset
        assert (stats.lag_bytes, stats.lag_seconds) == (0, 0.0)  # caught up
        # more after a restart: applied from the stored offset, exactly once
        await append(client, s, [change("item", "1", {"v": "again"}, "update")])
        await run_until_caught_up(server, sink)
        await assert_state_is_fold(client, sink)
        assert state_table(database, "items")[("item", "1")] == {"v": "again"}


async def test_snapshot_is_swapped_in_whole_at_its_end_and_reset_clears(server: str, database: str) -> None:
    sink = mapping(database, "snap")
    async with Client(server) as client:
        await create(client, sink.stream)
        s = sink.stream
        await append(client, s, [change("t", "a", 1), change("t", "b", 2)])
        await append(client, s, [control("snapshot-start"), change("t", "c", 3)])
        stats = await run_until_caught_up(server, sink)
        # the snapshot is staged, across transactions and restarts: the table is still the old one
        assert state_table(database, "snap") == {("t", "a"): 1, ("t", "b"): 2}
        assert stats.state == "snapshot"
        await append(client, s, [change("t", "d", 4), change("t", "c", 5, "update")])
        await append(
            client, s, [change("t", "d", operation="delete"), change("t", "e", 6), control("snapshot-end")]
        )
        await run_until_caught_up(server, sink)
        assert state_table(database, "snap") == {("t", "c"): 5, ("t", "e"): 6}
        await assert_state_is_fold(client, sink)
        # reset in the middle of one answer: what came before it is gone, what follows stays
        await append(client, s, [change("t", "f", 7), control("reset"), change("t", "g", 8)])
        await run_until_caught_up(server, sink)
        assert state_table(database, "snap") == {("t", "g"): 8}
        await assert_state_is_fold(client, sink)
        assert query(database, "SELECT count(*) FROM streamkeep_sync.snap_snapshot") == [(0,)]


async def test_a_message_that_does_not_fit_stops_without_moving_the_offset(
    server: str, database: str
) -> None:
    sink = mapping(database, "misfit")
    async with Client(server) as client:
        await create(client, sink.stream)
        await append(client, sink.stream, [change("t", "a", 1)])
        await run_until_caught_up(server, sink)
        before = stored_offset(database, "misfit")
        await append(
            client, sink.stream, [change("t", "b", 2), {"type": "t", "headers": {"operation": "insert"}}]
        )
        stats = MappingStats(sink.name, "stream_to_pg")
        with trio.fail_after(10), pytest.raises(MappingStopped) as stopped:
            await run(sink, client, stats)
        assert "`key` is missing" in str(stopped.value) and "dead_letter" in str(stopped.value)
        assert stored_offset(database, "misfit") == before
        assert state_table(database, "misfit") == {("t", "a"): 1}  # nothing of that batch


async def test_with_a_dead_letter_table_misfits_are_set_aside_and_the_rest_applied(
    server: str, database: str
) -> None:
    sink = mapping(database, "dead", dead_letter="public.dead_letters")
    logged = mapping(database, "deadlog", "log", columns={"n": "n"}, dead_letter="public.dead_letters")
    bad = [{"headers": {"operation": "upsert"}, "type": "t", "key": "x"}, "text", {"type": "t", "key": "y"}]
    async with Client(server) as client:
        await create(client, sink.stream)
        await create(client, logged.stream)
        await append(client, sink.stream, [change("t", "a", 1), *bad, change("t", "b", 2)])
        await run_until_caught_up(server, sink)
        # with a control message the answer takes the other path (state.py): misfits the same
        await append(
            client, sink.stream, [change("t", "c", 3), {"headers": {"control": "pause"}}, control("reset")]
        )
        await append(client, sink.stream, [change("t", "d", 4), ["not", "an", "object"]])
        await append(client, logged.stream, [{"n": 1}, {"m": 2}, {"n": {"deep": True}}, {"n": None}])
        await run_until_caught_up(server, sink)
        await run_until_caught_up(server, logged)
        assert state_table(database, "dead") == {("t", "d"): 4}
        rows = query(database, "SELECT mapping, message_index, message, error FROM dead_letters ORDER BY id")
        assert [(m, i, msg) for m, i, msg, _ in rows] == [
            ("dead", 1, bad[0]),
            ("dead", 2, "text"),
            ("dead", 3, bad[2]),
            ("dead", 1, {"headers": {"control": "pause"}}),
            ("dead", 4, ["not", "an", "object"]),
            ("deadlog", 1, {"m": 2}),
        ]
        assert [r[3] for r in rows[:5]] == [
            'headers.operation "upsert" is not insert, update or delete',
            "not a JSON object",
            "`headers` is missing or not an object",
            'headers.control "pause" is not one of snapshot-start, snapshot-end, reset',
            "not a JSON object",
        ]
        assert "no field 'n'" in rows[5][3]
        # a text column takes any JSON (as its text), null is NULL
        assert query(database, "SELECT n FROM deadlog ORDER BY message_index") == [
            ("1",),
            ('{"deep":true}',),
            (None,),
        ]


async def test_a_log_table_shared_by_two_mappings_stops_the_second_while_a_users_unique_key_dead_letters(
    server: str, database: str
) -> None:
    """A row already at a message's place (stream_offset, message_index) is no message's fault:
    another mapping writes the table, or this one was renamed. It stops the mapping rather than
    dead-lettering the whole stream; a duplicate under a unique key of the user's is the message's."""
    query_commit(
        database,
        # the place's index first, as in a table the sink made and the user indexed later: a row
        # breaking both is reported against the first index Postgres checks
        "CREATE TABLE shared (stream text, stream_offset text, message_index int, message jsonb, "
        "n bigint, UNIQUE (stream_offset, message_index), UNIQUE (n))",
    )
    first = mapping(database, "shared", "log", columns={"n": "n"}, dead_letter="public.shared_dead")
    second = StreamToPg(**{**first.__dict__, "name": "shared_again"})
    async with Client(server) as client:
        await create(client, first.stream)
        await append(client, first.stream, [{"n": 1}, {"n": 1}, {"n": 2}])
        await run_until_caught_up(server, first)
        assert query(database, "SELECT n FROM shared ORDER BY message_index") == [(1,), (2,)]
        dead = query(database, "SELECT message_index, error FROM shared_dead")
        assert [(i, e.split(":")[0]) for i, e in dead] == [(1, "Postgres refused it, SQLSTATE 23505")]
        with trio.fail_after(10), pytest.raises(MappingStopped) as stopped:
            await run(second, client, MappingStats(second.name, "stream_to_pg"))
        assert "already holds rows at the places" in str(stopped.value)
        assert stored_offset(database, "shared_again") == "-1"
        assert len(query(database, "SELECT 1 FROM shared_dead")) == 1  # nothing more set aside


async def test_a_reset_sets_aside_again_only_what_the_replay_refuses(server: str, database: str) -> None:
    """`streamkeep sync reset` applies the stream again from the start, so the mapping's old
    dead-letter rows go in the same transaction as the table's contents (another mapping's stay)."""
    sink = mapping(database, "replayed", dead_letter="public.replay_dead")
    other = mapping(database, "bystander", dead_letter="public.replay_dead")
    nul = change("t", "b", "nul \u0000 inside")
    async with Client(server) as client:
        for each in (sink, other):
            await create(client, each.stream)
            await append(client, each.stream, [change("t", "a", 1), nul])
            await run_until_caught_up(server, each)
        await trio.to_thread.run_sync(reset, sink)
        await run_until_caught_up(server, sink)
        rows = query(database, "SELECT mapping, count(*) FROM replay_dead GROUP BY mapping ORDER BY mapping")
        assert rows == [("bystander", 1), ("replayed", 1)]
        assert state_table(database, "replayed") == {("t", "a"): 1}


async def test_typed_columns_of_a_table_made_by_hand_are_checked(server: str, database: str) -> None:
    query_commit(
        database,
        "CREATE TABLE typed (stream text, stream_offset text, message_index int, message jsonb, n bigint, ok boolean)",
    )
    sink = mapping(database, "typed", "log", columns={"n": "n", "ok": "ok"}, dead_letter="public.typed_dead")
    async with Client(server) as client:
        await create(client, sink.stream)
        await append(
            client,
            sink.stream,
            [{"n": 1, "ok": True}, {"n": "2", "ok": True}, {"n": 3, "ok": 1}, {"n": 4, "ok": False}],
        )
        await run_until_caught_up(server, sink)
        assert query(database, "SELECT n, ok FROM typed ORDER BY message_index") == [(1, True), (4, False)]
        errors = [r[0] for r in query(database, "SELECT error FROM typed_dead ORDER BY id")]
        assert "bigint" in errors[0] and "boolean" in errors[1]


async def test_a_paused_old_sink_moves_nothing(server: str, database: str) -> None:
    """Fencing: a sink that read the stored offset before another one moved it (a paused process,
    a second process) writes nothing: the compare-and-set on the offset's version fails first."""
    sink = mapping(database, "fenced", "log")
    async with Client(server) as client:
        await create(client, sink.stream)
        await append(client, sink.stream, [{"n": 1}])
        await run_until_caught_up(server, sink)
        names = Names.of(sink)
        with psycopg.connect(database) as conn:
            now = offsets.load(conn, names, sink.stream)
            stale = offsets.Stored(offsets.BEGINNING, now.version - 1)

            def write(cur: psycopg.Cursor[Any]) -> Outcome:
                cur.execute("INSERT INTO fenced (stream, stream_offset, message_index) VALUES ('x', 'x', 0)")
                return Outcome(1, False, [])

            with pytest.raises(offsets.Fenced):
                commit.apply(conn, names, sink.stream, stale, "elsewhere", write)
            assert offsets.load(conn, names, sink.stream) == now
        await assert_log_is_stream(client, sink)


async def test_two_sinks_on_one_mapping_apply_each_message_once(server: str, database: str) -> None:
    sink = mapping(database, "twice", "log")
    async with Client(server) as client:
        await create(client, sink.stream)
        one, two = MappingStats("twice", "stream_to_pg"), MappingStats("twice", "stream_to_pg")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(process.keep_running, sink, run, client, one)
            nursery.start_soon(process.keep_running, sink, run, client, two)
            for n in range(30):
                await append(client, sink.stream, [{"n": n, "i": i} for i in range(20)])
                await trio.sleep(0.01)
            await wait_for(lambda: caught_up(client, sink))
            nursery.cancel_scope.cancel()
        await assert_log_is_stream(client, sink)
        assert one.rows + two.rows == 600


async def test_a_recreated_stream_stops_the_mapping_until_reset(server: str, database: str) -> None:
    sink = mapping(database, "again")
    async with Client(server) as client:
        await create(client, sink.stream)
        await append(client, sink.stream, [change("t", "old", 1)])
        await run_until_caught_up(server, sink)
        await client.stream(sink.stream).delete()
        await create(client, sink.stream)
        await append(client, sink.stream, [change("t", "new", 2)])
        with trio.fail_after(10), pytest.raises(MappingStopped) as stopped:
            await run(sink, client, MappingStats(sink.name, "stream_to_pg"))
        assert "410" in str(stopped.value) and "streamkeep sync reset again" in str(stopped.value)
        assert state_table(database, "again") == {("t", "old"): 1}
        said = await trio.to_thread.run_sync(reset, sink)
        assert "again from its beginning" in said
        await run_until_caught_up(server, sink)
        assert state_table(database, "again") == {("t", "new"): 2}


async def test_resync_follows_a_stream_deleted_and_created_again_while_it_runs(
    server: str, database: str
) -> None:
    """404 while following: the sink waits for the stream; the new one answers 410 to the old
    offset, and on_gone = "resync" rebuilds the table from it (cleared in the first batch's
    transaction)."""
    sink = mapping(database, "resync", on_gone="resync")
    async with Client(server) as client:
        await create(client, sink.stream)
        await append(client, sink.stream, [change("t", "old", 1), change("t", "both", 1)])
        stats = MappingStats(sink.name, "stream_to_pg")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(process.keep_running, sink, run, client, stats)
            await wait_for(lambda: caught_up(client, sink))
            await client.stream(sink.stream).delete()
            await trio.sleep(0.3)
            await create(client, sink.stream)
            await append(client, sink.stream, [change("t", "new", 2), change("t", "both", 2)])
            await wait_for(lambda: caught_up(client, sink))
            nursery.cancel_scope.cancel()
        assert state_table(database, "resync") == {("t", "new"): 2, ("t", "both"): 2}
        await assert_state_is_fold(client, sink)


async def test_a_stream_not_created_yet_is_waited_for(server: str, database: str) -> None:
    sink = mapping(database, "later", "log")
    async with Client(server) as client:
        stats = MappingStats(sink.name, "stream_to_pg")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(process.keep_running, sink, run, client, stats)

            async def waiting() -> bool:
                return "waiting for it to be created" in (stats.last_error or "")

            await wait_for(waiting)
            await create(client, sink.stream)
            await append(client, sink.stream, [{"n": 1}])
            await wait_for(lambda: caught_up(client, sink))
            nursery.cancel_scope.cancel()
        await assert_log_is_stream(client, sink)


async def test_the_sinks_transactions_carry_its_replication_origin(server: str, database: str) -> None:
    """No echo: a logical decoder that keeps only local changes (test_decoding's only-local, as
    the source keeps only transactions without the sink's origin) sees none of the sink's."""
    slot = "sink_echo_" + database.rsplit("/", 1)[1][-30:]
    sink = mapping(database, "echo")
    query_commit(database, "SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", slot)
    try:
        async with Client(server) as client:
            await create(client, sink.stream)
            await append(client, sink.stream, [change("t", "a", 1)])
            await run_until_caught_up(server, sink)
            query_commit(database, "INSERT INTO echo VALUES ('local', 'b', '2')")
        changes = [
            r[0]
            for r in query(database, "SELECT data FROM pg_logical_slot_peek_changes(%s, NULL, NULL)", slot)
        ]
        local = [
            r[0]
            for r in query(
                database,
                "SELECT data FROM pg_logical_slot_peek_changes(%s, NULL, NULL, 'only-local', '1')",
                slot,
            )
        ]
        assert any("public.echo: INSERT" in c and "'a'" in c for c in changes)  # the sink's insert
        assert not any("'a'" in c for c in local) and any("'local'" in c for c in local)
        assert query(
            database, "SELECT count(*) FROM pg_replication_origin WHERE roname = 'streamkeep_sync_echo'"
        ) == [(1,)]
    finally:
        query_commit(database, "SELECT pg_drop_replication_slot(%s)", slot)


async def test_reset_in_log_mode_applies_the_stream_again_into_an_emptied_table(
    server: str, database: str
) -> None:
    sink = mapping(database, "relog", "log")
    async with Client(server) as client:
        await create(client, sink.stream)
        await append(client, sink.stream, [{"n": n} for n in range(5)])
        await run_until_caught_up(server, sink)
        said = await trio.to_thread.run_sync(reset, sink)
        assert "emptied in the same transaction as the first batch" in said
        assert stored_offset(database, "relog") == "-1"
        await append(client, sink.stream, [{"n": 5}])
        await run_until_caught_up(server, sink)
        await assert_log_is_stream(client, sink)  # each message once: the old rows went with the reset


async def test_what_a_person_must_fix_stops_the_mapping_at_start(server: str, database: str) -> None:
    query_commit(database, "CREATE TABLE notstate (id int PRIMARY KEY)")
    role = "sink_" + database.rsplit("/", 1)[1][-40:]
    query_commit(database, f"CREATE ROLE {role} LOGIN")
    try:
        async with Client(server) as client:
            for name, content_type in (
                ("notstate", "application/json"),
                ("bytes", "application/octet-stream"),
            ):
                await client.stream(f"{name}-stream").create(content_type=content_type)
            cases = [
                (mapping(database, "notstate"), "is not a state table"),
                (mapping(database, "bytes"), "needs an application/json stream"),
                (mapping(database.replace("postgres@", f"{role}@"), "norights"), "GRANT EXECUTE"),
            ]
            await create(client, "norights-stream")
            for sink, said in cases:
                with trio.fail_after(10), pytest.raises(MappingStopped) as stopped:
                    await run(sink, client, MappingStats(sink.name, "stream_to_pg"))
                assert said in str(stopped.value)
    finally:
        query_commit(database, f"DROP ROLE {role}")


async def test_a_byte_stream_in_log_mode_is_one_bytea_row_per_answer(server: str, database: str) -> None:
    sink = mapping(database, "raw", "log")
    async with Client(server) as client:
        await client.stream(sink.stream).create(content_type="application/octet-stream")
        await client.stream(sink.stream).append(b"\x00\x01binary")
        await run_until_caught_up(server, sink)
        await client.stream(sink.stream).append(b"more")
        await run_until_caught_up(server, sink)
        rows = query(database, "SELECT message FROM raw ORDER BY stream_offset")
        assert b"".join(bytes(r[0]) for r in rows) == b"\x00\x01binarymore"


async def test_long_poll_follows_the_tail_and_lag_is_measured(server: str, database: str) -> None:
    sink = mapping(database, "polled", "log", live="long-poll")
    async with Client(server) as client:
        await create(client, sink.stream)
        stats = MappingStats(sink.name, "stream_to_pg")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(process.keep_running, sink, run, client, stats)
            for n in range(5):
                await append(client, sink.stream, [{"n": n}])
                await trio.sleep(0.05)
            await wait_for(lambda: caught_up(client, sink))
            nursery.cancel_scope.cancel()
        await assert_log_is_stream(client, sink)
        # lag while behind: the tail's byte position minus the applied one's (same incarnation)
        first = (await client.stream(sink.stream).read_all())[0]
        behind = Sink(sink, Names.of(sink), client.stream(sink.stream), None, stats)  # type: ignore[arg-type]
        await behind.note_lag(Batch(b"x", None, "-1", first.next_offset, False, False, None))
        tail = (await client.stream(sink.stream).head()).next_offset or ""
        assert stats.lag_bytes == int(tail[-16:]) - int(first.next_offset[-16:]) == 0
        await append(client, sink.stream, [{"n": 5}])
        behind.lag_checked_at = 0.0
        await behind.note_lag(Batch(b"x", None, "-1", first.next_offset, False, False, None))
        assert stats.lag_bytes == len(b'{"n":5}') and stats.lag_seconds >= 0


async def test_resync_in_log_mode_keeps_the_old_rows_and_adds_the_new_streams(
    server: str, database: str
) -> None:
    sink = mapping(database, "relogged", "log", on_gone="resync")
    async with Client(server) as client:
        await create(client, sink.stream)
        await append(client, sink.stream, [{"old": 1}])
        await run_until_caught_up(server, sink)
        await client.stream(sink.stream).delete()
        await create(client, sink.stream)
        await append(client, sink.stream, [{"new": 1}, {"new": 2}])
        await run_until_caught_up(server, sink)
        rows = query(
            database, "SELECT stream_offset, message FROM relogged ORDER BY applied_at, message_index"
        )
        assert [r[1] for r in rows] == [{"old": 1}, {"new": 1}, {"new": 2}]
        assert rows[0][0][:16] != rows[1][0][:16]  # the two incarnations' offsets differ


async def test_a_mapping_pointed_at_another_stream_stops_until_reset(server: str, database: str) -> None:
    first = mapping(database, "moved")
    moved = StreamToPg(**{**first.__dict__, "stream": "moved-elsewhere"})
    async with Client(server) as client:
        for sink, key in ((first, "a"), (moved, "b")):
            await create(client, sink.stream)
            await append(client, sink.stream, [change("t", key, 1)])
        await run_until_caught_up(server, first)
        with trio.fail_after(10), pytest.raises(MappingStopped) as stopped:
            await run(moved, client, MappingStats(moved.name, "stream_to_pg"))
        assert "now names stream moved-elsewhere" in str(stopped.value)
        await trio.to_thread.run_sync(reset, moved)
        await run_until_caught_up(server, moved)
        assert state_table(database, "moved") == {("t", "b"): 1}


async def test_a_value_postgres_refuses_stops_the_mapping(server: str, database: str) -> None:
    sink = mapping(database, "refused")
    async with Client(server) as client:
        await create(client, sink.stream)
        await append(client, sink.stream, [change("t", "a", "nul \u0000 inside")])  # jsonb has no \u0000
        with trio.fail_after(10), pytest.raises(MappingStopped) as stopped:
            await run(sink, client, MappingStats(sink.name, "stream_to_pg"))
        assert "Postgres refused the batch" in str(stopped.value) and "22P05" in str(stopped.value)
        assert 'dead_letter = "TABLE"' in str(stopped.value)  # what to do next
        assert stored_offset(database, "refused") == "-1"


async def test_values_only_postgres_refuses_are_dead_lettered_and_the_rest_applied(
    server: str, database: str
) -> None:
    """A string jsonb cannot hold, a number past bigint, a date Postgres cannot parse, a CHECK of
    the user's table: found by Postgres, not the sink's checks, so the answer's one statement
    fails; the batch is applied again message by message and only those are set aside, in the same
    transaction as the others and the offset (salvage.py)."""
    query_commit(
        database,
        "CREATE TABLE dated (stream text, stream_offset text, message_index int, message json, "
        "n bigint CHECK (n <> 13), day date)",
    )
    state_sink = mapping(database, "nul", dead_letter="public.refused_dead")
    log_sink = mapping(
        database, "dated", "log", columns={"n": "n", "day": "day"}, dead_letter="public.refused_dead"
    )
    nul = change("t", "b", {"s": "a\u0000b"})
    async with Client(server) as client:
        await create(client, state_sink.stream)
        await create(client, log_sink.stream)
        await append(client, state_sink.stream, [change("t", "a", 1), nul, change("t", "c", 3)])
        await append(client, state_sink.stream, [change("t", "a", 10), control("reset"), change("t", "d", 4)])
        await append(client, state_sink.stream, [nul, change("t", "e", 5)])
        rows = [
            {"n": 1, "day": "2026-11-26"},
            {"n": 2**70, "day": "2026-11-26"},
            {"n": 3, "day": "the 40th of Nevember"},
            {"n": 13, "day": "2026-11-27"},
            {"n": 5, "day": None},
        ]
        await append(client, log_sink.stream, rows)
        await run_until_caught_up(server, state_sink)
        await run_until_caught_up(server, log_sink)
        # the reset in the second answer emptied the table: a, c went, d and e stay
        assert state_table(database, "nul") == {("t", "d"): 4, ("t", "e"): 5}
        assert query(database, "SELECT message_index, n, day::text FROM dated ORDER BY message_index") == [
            (0, 1, "2026-11-26"),
            (4, 5, None),
        ]
        dead = query(
            database,
            "SELECT mapping, stream_offset, message_index, message::text, error FROM refused_dead ORDER BY id",
        )
        # each row names its message: the answer read from stream_offset holds it at message_index
        for name, offset, index, text, _ in dead:
            answer = (await client.stream(f"{name}-stream").read_all(offset=offset))[0]
            assert answer.messages is not None and answer.messages[index] == json.loads(text)
        assert [(row[0], json.loads(row[3])) for row in dead] == [
            ("nul", nul),
            ("nul", nul),
            *[("dated", row) for row in rows[1:4]],
        ]
        assert "\\u0000" in dead[0][3]  # the message as sent, in a json column (jsonb has no \u0000)
        assert [e.split(":")[0] for *_, e in dead] == [
            "Postgres refused it, SQLSTATE 22P05",  # untranslatable character
            "Postgres refused it, SQLSTATE 22P05",
            "Postgres refused it, SQLSTATE 22003",  # out of range for bigint
            "Postgres refused it, SQLSTATE 22007",  # not a date
            "Postgres refused it, SQLSTATE 23514",  # the CHECK
        ]
        for sink in (state_sink, log_sink):
            assert stored_offset(database, sink.name) == (await client.stream(sink.stream).head()).next_offset
