"""A `[[stream_to_pg]]` mapping's task: wait for the stream, prepare the tables, then read from
the offset stored in Postgres and apply what comes in transactions that also move that offset.

Consecutive answers already read are applied together (up to MAX_MESSAGES), still in one
transaction with the last one's next offset, so a sink that is behind writes few, large
transactions. Everything a restart needs is in Postgres (offset, snapshot in progress, a pending
clear), so any process can take over at any commit boundary, and `run` can be called again after
any exception."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, NoReturn

import psycopg
import trio

from streamkeep.client import Batch, Client, LiveMode, Stream, StreamGone, StreamInfo, StreamNotFound
from streamkeep.client.reader import is_json_type
from streamkeep.sync.config import StreamToPg
from streamkeep.sync.sink import commit, log, offsets, reading, salvage, state, tables
from streamkeep.sync.sink.batch import Misfit, Outcome, Part
from streamkeep.sync.sink.names import Names
from streamkeep.sync.sink.offsets import Stored
from streamkeep.sync.stats import MappingStats, MappingStopped

MAX_MESSAGES = 50_000  # per transaction, when answers queue up ...
MAX_BYTES = 16 << 20  # ... or this many bytes of them
DDL_ATTEMPTS = 5  # tries at creating the tables when other mappings create theirs at the same moment
WAIT_FOR_STREAM = 1.0  # seconds between HEADs while the stream does not exist
LAG_CHECK = 1.0  # seconds between HEADs for lag_bytes while behind
# work_mem: a batch's fold sorts up to MAX_MESSAGES rows, in memory rather than temporary files.
# idle_in_transaction_session_timeout: a sink paused in the middle of a transaction (SIGSTOP, a
# frozen VM) is cut off by Postgres, so its row lock and replication origin go to the next sink
# (which it fences: its own commit then fails). lock_timeout: a sink waiting on such a lock says so
# in its stats and retries, rather than hanging without a word.
SESSION_OPTIONS = "-c work_mem=64MB -c idle_in_transaction_session_timeout=30s -c lock_timeout=60s"
_OFFSET = re.compile(r"([0-9]{16})_([0-9]{16})")


@dataclass
class Sink:
    mapping: StreamToPg
    names: Names
    stream: Stream
    conn: psycopg.Connection
    stats: MappingStats
    log_columns: tables.LogColumns | None = None
    caught_up_at: float = 0.0
    lag_checked_at: float = 0.0

    # -- preparing ------------------------------------------------------------------------

    async def wait_for_stream(self) -> StreamInfo:
        """The stream's metadata; while it does not exist (not created yet, or deleted), waits for
        it: a re-created stream then answers 410 to our old offset and on_gone decides."""
        while True:
            try:
                return await self.stream.head()
            except (StreamNotFound, StreamGone):
                self.stats.state = "starting"
                self.stats.last_error = (
                    f"stream {self.mapping.stream} does not exist: waiting for it to be created"
                )
                await trio.sleep(WAIT_FOR_STREAM)

    def prepare(self, json_stream: bool) -> None:
        """Blocking: origin, offsets row, tables (created if missing), checked against the stream.
        Mappings starting together race to create the shared schema and tables: Postgres answers
        the loser of a concurrent `CREATE ... IF NOT EXISTS` with a unique violation, so it looks
        again once the winner committed."""
        for attempt in range(DDL_ATTEMPTS):
            try:
                self._prepare(json_stream)
                return
            except (
                psycopg.errors.UniqueViolation,
                psycopg.errors.DuplicateObject,
                psycopg.errors.DuplicateSchema,
                psycopg.errors.DuplicateTable,
            ) as error:
                self.conn.rollback()
                if attempt + 1 == DDL_ATTEMPTS:
                    raise error
                time.sleep(0.05 * (attempt + 1))

    def _prepare(self, json_stream: bool) -> None:
        mapping, names = self.mapping, self.names
        if mapping.mode == "state" and not json_stream:
            raise MappingStopped(
                f'sync {mapping.name}: mode = "state" needs an application/json stream (State Protocol '
                f'messages); {mapping.stream} is not one. Use mode = "log" or another stream.'
            )
        if mapping.columns and not json_stream:
            raise MappingStopped(
                f"sync {mapping.name}: `columns` need JSON messages; {mapping.stream} is not an "
                "application/json stream. Remove `columns` (each answer becomes one bytea row)."
            )
        try:
            commit.ensure_origin(self.conn, names)
            commit.check_origin(self.conn, names)
        except psycopg.errors.InsufficientPrivilege as error:
            raise MappingStopped(
                f"sync {mapping.name}: the Postgres role cannot create or use replication origin "
                f"{names.origin} (marks the sink's transactions so the source skips them): make it a "
                f"superuser or GRANT EXECUTE on pg_replication_origin_create/_session_setup/_session_reset: {error}"
            ) from error
        offsets.create(self.conn, names, mapping.stream)
        tables.create_dead_letter(self.conn, names)
        if mapping.mode == "state":
            tables.create_state(self.conn, names)
            state.create_session_table(self.conn)
            shape = tables.column_types(self.conn, mapping.table)
            if (shape.get("type"), shape.get("key"), shape.get("value")) != ("text", "text", "jsonb"):
                raise MappingStopped(
                    f'sync {mapping.name}: table {mapping.table} is not a state table: mode = "state" needs '
                    "(type text, key text, value jsonb, PRIMARY KEY (type, key)); name a new table and it is created"
                )
            return
        try:
            self.log_columns = tables.create_log(self.conn, names, mapping, json_stream)
        except LookupError as error:
            raise MappingStopped(f"sync {mapping.name}: {error}; add them or map to another table") from error
        wanted = ("jsonb", "json") if json_stream else ("bytea",)
        if self.log_columns.types["message"] not in wanted:
            raise MappingStopped(
                f"sync {mapping.name}: column message of {mapping.table} is "
                f"{self.log_columns.types['message']}, but stream {mapping.stream} needs {wanted[0]}"
            )

    # -- following ------------------------------------------------------------------------

    async def follow(self, stored: Stored, info: StreamInfo) -> None:
        """Reads and applies until the stream is gone (410, handled here) or deleted (returns)."""
        # "-1" is resolved to the concrete earliest offset so every stored row names a real
        # offset (a log row at "-1" would collide with the next incarnation's first one).
        start = stored.next_offset
        if start == offsets.BEGINNING and info.earliest_offset:
            start = info.earliest_offset
        send, receive = trio.open_memory_channel[reading.Item](4)
        failure: Exception | None = None
        ended: reading.Item = reading.Closed()
        async with trio.open_nursery() as nursery:
            # "sse" reads as the client's "auto": plain GETs while catching up (about three times
            # the messages per second of SSE's line-by-line parsing, measured), SSE once caught up.
            live: LiveMode = "auto" if self.mapping.live == "sse" else "long-poll"
            # state mode reads the bodies raw: Postgres parses them (state.py)
            raw = self.mapping.mode == "state"
            nursery.start_soon(reading.read_into, self.stream, start, live, raw, send)
            try:
                ended, stored = await self.apply_all(receive, stored)
            except Exception as error:  # raised below, outside the nursery: not in an ExceptionGroup
                failure = error
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
        if isinstance(ended, reading.Gone):
            await self.gone(ended.error, stored)
        elif isinstance(ended, reading.Failed):
            raise ended.error
        elif isinstance(ended, reading.Closed):
            self.stats.last_error = None
            await trio.sleep_forever()  # a closed stream gets nothing more

    async def apply_all(
        self, receive: trio.MemoryReceiveChannel[reading.Item], stored: Stored
    ) -> tuple[reading.Item, Stored]:
        """Applies batches until the reader says how it ended; returns that, and what is stored."""
        async with receive:
            while True:
                item = await receive.receive()
                if not isinstance(item, Batch):
                    return item, stored
                parts = [Part.of(item)]
                last = item
                ended: reading.Item | None = None
                count = parts[0].count
                size = len(item.data)
                while count < MAX_MESSAGES and size < MAX_BYTES:
                    try:
                        more = receive.receive_nowait()
                    except trio.WouldBlock:
                        break
                    if not isinstance(more, Batch):
                        ended = more
                        break
                    parts.append(Part.of(more))
                    count += parts[-1].count
                    size += len(more.data)
                    last = more
                stored = await self.apply(parts, stored)
                await self.note_lag(last)
                if ended is not None:
                    return ended, stored

    async def apply(self, parts: list[Part], stored: Stored) -> Stored:
        next_offset = parts[-1].next_offset
        if not any(p.count for p in parts) and next_offset == stored.next_offset and not stored.clear_pending:
            return stored  # an empty "up to date" answer: nothing to store
        after, applied = await trio.to_thread.run_sync(self._apply_blocking, parts, stored)
        self.stats.progressed(applied, after.next_offset)
        if after.in_snapshot:
            self.stats.state = "snapshot"
        return after

    def _apply_blocking(self, parts: list[Part], stored: Stored) -> tuple[Stored, int]:
        mapping = self.mapping

        def checked(cur: psycopg.Cursor[Any], some: list[Part], in_snapshot: bool, clear: bool) -> Outcome:
            outcome = self.write(cur, some, in_snapshot, clear)
            if outcome.misfits and mapping.dead_letter is None:
                self.stop_on_misfit(outcome.misfits[0], stored)  # raises: the transaction rolls back
            return outcome

        def whole(cur: psycopg.Cursor[Any]) -> Outcome:
            return checked(cur, parts, stored.in_snapshot, stored.clear_pending)

        def each(cur: psycopg.Cursor[Any]) -> Outcome:
            return salvage.write_each(
                cur,
                parts,
                checked,
                stored.in_snapshot,
                stored.clear_pending,
                raw_json=mapping.mode == "state",
            )

        next_offset = parts[-1].next_offset
        try:
            outcome = commit.apply(self.conn, self.names, mapping.stream, stored, next_offset, whole)
        except salvage.REFUSED as error:  # a value only Postgres could judge
            if mapping.dead_letter is None:
                raise MappingStopped(
                    f"sync {mapping.name}: Postgres refused the batch at offset {parts[0].offset}: "
                    f"{salvage.describe(error)}. Nothing of it was applied and the stored offset stays at "
                    f'{stored.next_offset}. Set dead_letter = "TABLE" in this mapping to set such messages '
                    "aside and go on, or fix the stream (and `streamkeep sync reset "
                    f"{mapping.name}` to apply it again from the beginning)."
                ) from error
            try:
                outcome = commit.apply(self.conn, self.names, mapping.stream, stored, next_offset, each)
            except salvage.PlaceTaken as taken:
                raise MappingStopped(
                    f"sync {mapping.name}: table {mapping.table} already holds rows at the places of the "
                    f"batch at offset {parts[0].offset} ({taken}): another mapping writes this stream to "
                    "it, or this mapping was renamed. Give each mapping a table of its own (or run the "
                    f"old name), or empty it and `streamkeep sync reset {mapping.name}`."
                ) from taken
            except salvage.REFUSED as again:
                raise MappingStopped(
                    f"sync {mapping.name}: the batch at offset {parts[0].offset} has a message Postgres "
                    f"refuses ({salvage.describe(error)}), and the dead-letter table {mapping.dead_letter} "
                    f"refused it too: {salvage.describe(again)}. Its message column must be json (not jsonb, "
                    f"which cannot hold every JSON string): ALTER TABLE {mapping.dead_letter} ALTER COLUMN "
                    "message TYPE json."
                ) from again
        return Stored(next_offset, stored.version + 1, outcome.in_snapshot), outcome.applied

    def write(self, cur: psycopg.Cursor[Any], parts: list[Part], in_snapshot: bool, clear: bool) -> Outcome:
        """Writes `parts` as this mapping's mode does (salvage.PartsWriter); misfits are returned."""
        if self.mapping.mode == "state":
            return state.write(cur, self.names, parts, in_snapshot, clear)
        assert self.log_columns is not None
        plan = log.plan(parts, self.mapping.stream, self.mapping.columns, self.log_columns, clear)
        return log.write(cur, self.names, self.mapping.columns, plan)

    def stop_on_misfit(self, misfit: Misfit, stored: Stored) -> NoReturn:
        mapping = self.mapping
        raise MappingStopped(
            f"sync {mapping.name}: {misfit.describe()}. Nothing of that batch was applied and the "
            f'stored offset stays at {stored.next_offset}. Set dead_letter = "TABLE" in this mapping to '
            "set such messages aside and go on, or fix the stream (and `streamkeep sync reset "
            f"{mapping.name}` to apply it again from the beginning)."
        )

    async def gone(self, error: StreamGone, stored: Stored) -> None:
        mapping = self.mapping
        if mapping.on_gone != "resync":
            raise MappingStopped(
                f"sync {mapping.name}: stream {mapping.stream} answered 410 Gone at the stored offset "
                f"{stored.next_offset} (it was deleted and created again, or retention dropped data this "
                f"sink had not applied): {error}. Run `streamkeep sync reset {mapping.name}` to apply it "
                'again from its earliest offset, or set on_gone = "resync".'
            )
        earliest = error.earliest_offset or offsets.BEGINNING
        if earliest == stored.next_offset:
            raise RuntimeError(f"410 at {earliest}, the stream's own earliest offset: trying again later")
        # state: the table is rebuilt from the earliest offset, emptied in the first batch's
        # transaction; log: the rows already there stay (history), new ones follow.
        await trio.to_thread.run_sync(
            lambda: offsets.restart_from(
                self.conn, self.names, earliest, clear=mapping.mode == "state", before=stored
            )
        )
        self.stats.last_error = f"410 at {stored.next_offset}: resynced from {earliest}"

    async def note_lag(self, last: Batch) -> None:
        """lag_seconds: how long since the sink was last caught up, or started (0 while caught up):
        the stream carries no append times, so this is how long it has been behind, an upper bound
        of any message's wait. lag_bytes: the tail's position minus ours (offsets are byte
        positions), from a HEAD at most once a LAG_CHECK while behind."""
        now = time.monotonic()
        if last.up_to_date:
            self.caught_up_at = now
            self.stats.lag_seconds = 0.0
            self.stats.lag_bytes = 0
            return
        self.stats.lag_seconds = now - self.caught_up_at
        if now - self.lag_checked_at < LAG_CHECK:
            return
        self.lag_checked_at = now
        try:
            tail = (await self.stream.head()).next_offset or ""
        except Exception:  # lag is a figure, not worth failing over
            return
        ours, theirs = _OFFSET.fullmatch(last.next_offset), _OFFSET.fullmatch(tail)
        if ours and theirs and ours[1] == theirs[1]:
            self.stats.lag_bytes = max(0, int(theirs[2]) - int(ours[2]))


async def run(mapping: StreamToPg, client: Client, stats: MappingStats) -> None:
    stats.state = "starting"
    names = Names.of(mapping)
    conn = await trio.to_thread.run_sync(
        lambda: psycopg.connect(
            mapping.dsn,
            connect_timeout=10,
            application_name=f"streamkeep-sync-{mapping.name}",
            options=SESSION_OPTIONS,
        )
    )
    sink = Sink(mapping, names, client.stream(mapping.stream), conn, stats, caught_up_at=time.monotonic())
    try:
        while True:
            info = await sink.wait_for_stream()
            await trio.to_thread.run_sync(sink.prepare, is_json_type(info.content_type))
            try:
                stored = await trio.to_thread.run_sync(offsets.load, conn, names, mapping.stream)
            except offsets.OtherStream as other:
                raise MappingStopped(
                    f"sync {mapping.name}: the stored offset is one of stream {other}, but the mapping now "
                    f"names stream {mapping.stream}: run `streamkeep sync reset {mapping.name}` to apply "
                    f"{mapping.stream} from its beginning ({mapping.table} is emptied as it starts)"
                ) from None
            stats.position = stored.next_offset
            stats.last_error = None
            if stats.state == "starting":
                stats.state = "snapshot" if stored.in_snapshot else "streaming"
            await sink.follow(stored, info)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(conn.close)


def reset(mapping: StreamToPg) -> str:
    names = Names.of(mapping)
    with psycopg.connect(mapping.dsn, connect_timeout=10) as conn:
        exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (mapping.offsets_table,)).fetchone()
        conn.commit()
        before = (
            offsets.restart_from(conn, names, offsets.BEGINNING, clear=True, stream=mapping.stream)
            if exists and exists[0]
            else None
        )
    if before is None:
        return (
            f"nothing stored for {mapping.name} yet: it starts from the beginning of {mapping.stream} anyway"
        )
    return (
        f"{mapping.name} will apply {mapping.stream} again from its beginning (it was at {before}); "
        f"{mapping.table} is emptied in the same transaction as the first batch"
    )


__all__ = ["reset", "run"]
