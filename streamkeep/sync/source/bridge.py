"""One Postgres -> stream mapping, run until cancelled: take the mapping over (advisory lock, then
the checkpoint's generation), snapshot if there is no finished checkpoint, then stream the slot.

Batches hold whole transactions. One closes at a transaction's end when the appender is free (so
a quiet mapping appends each commit at once, and a busy one's batches grow while the previous
append is under way, like a group commit), else when it holds `batch_rows` rows or its first row
has waited `batch_wait`.

Exactly once, per batch:
  1. the checkpoint records the batch as pending (its seq and its last transaction's commit end),
  2. the batch is appended with Producer-Id/Epoch/Seq (a retry is a duplicate the server drops),
  3. the checkpoint moves `appended_lsn` to the batch's end and the seq on,
  4. the slot's flush position is confirmed to that end.
A crash anywhere restarts from the checkpoint: transactions ending at or before `appended_lsn` are
skipped (the slot may replay them: its position is persisted only at Postgres checkpoints), and a
pending batch is rebuilt from the same transactions with the same encoding and re-sent under its
seq. Then the epoch is bumped, so the server refuses (403) any append of a paused older bridge.

Two tasks: a reader that decodes the slot into batches, and an appender that does steps 1-4 for one
batch at a time, in order; the reader goes on reading while a batch waits on its fsyncs. When no
transaction is open, no batch is being built and none is with the appender, a keepalive's WAL end
is confirmed as is: an idle publication lets Postgres recycle its WAL."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import psycopg
import trio

from streamkeep.client import (
    BadRequest,
    Client,
    PayloadTooLarge,
    SequenceConflict,
    Stream,
    StreamExists,
    StreamNotFound,
)
from streamkeep.sync.config import PgToStream
from streamkeep.sync.crashpoints import crash_point
from streamkeep.sync.source import catalog, encode
from streamkeep.sync.source.changes import Changes, Transaction, reset_hint
from streamkeep.sync.source.checkpoint import Checkpoint, CheckpointStore, new_producer_id
from streamkeep.sync.source.pgoutput import (
    XLOG_DATA,
    XLOG_PAYLOAD,
    Begin,
    Commit,
    Delete,
    Insert,
    Keepalive,
    Origin,
    Relation,
    Truncate,
    Update,
    decode,
    decode_copy,
    lsn_text,
    unix_time,
    wal_end,
)
from streamkeep.sync.source.replication import ReplicationConnection, ReplicationError
from streamkeep.sync.source.snapshot import SnapshotReader
from streamkeep.sync.stats import MappingStats, MappingStopped

log = logging.getLogger("streamkeep.sync.source")
# The sink's replication origins: `streamkeep_sync`, or `streamkeep_sync_<mapping>` (one per sink
# mapping: Postgres 15 lets one session at a time set up an origin). Their transactions never echo.
SINK_ORIGIN = "streamkeep_sync"


def is_sink_origin(name: str) -> bool:
    return name == SINK_ORIGIN or name.startswith(SINK_ORIGIN + "_")


STATUS_EVERY = 10.0  # seconds between standby status updates when nothing else sends one
TABLE_CHECK_EVERY = 5.0  # seconds between checks that the tables still exist, while idle
T = TypeVar("T")


class BridgeBusy(Exception):
    """Another bridge holds this mapping (transient: the process retries, and takes over when
    the other one goes)."""


async def blocking(fn: Callable[..., T], *args: Any) -> T:
    """A blocking Postgres call in a worker thread. Not abandoned on cancel: closing a psycopg
    connection while its thread still uses it is not safe, and these calls are short."""
    return await trio.to_thread.run_sync(lambda: fn(*args))


@dataclass
class Batch:
    messages: list[dict[str, Any]] = field(default_factory=list)
    rows: int = 0
    end_lsn: int = 0
    commit_time: int = 0
    opened_at: float = 0.0


class Bridge:
    def __init__(self, mapping: PgToStream, client: Client, stats: MappingStats) -> None:
        self.mapping = mapping
        self.stats = stats
        self.stream: Stream = client.stream(mapping.stream, content_type=encode.JSON_TYPE)
        self.control: psycopg.Connection[tuple[object, ...]] | None = None
        self.replication: ReplicationConnection | None = None
        self.checkpoint: Checkpoint | None = None
        self.confirmed = 0  # the slot's flush position we have confirmed (or will, at the next status)
        self.sent_status = 0
        self.in_flight = 0  # batches handed to the appender and not yet confirmed
        self.idle: trio.Event | None = None  # set when in_flight reaches 0, for a reader that waits
        self.waiting: trio.CancelScope | None = None  # the reader's wait on the socket, holding a batch
        self.server_wal_end = 0

    def close(self) -> None:
        if self.replication is not None:
            self.replication.close()
        if self.control is not None:
            self.control.close()

    @property
    def store(self) -> CheckpointStore:
        assert self.control is not None
        return CheckpointStore(self.control, self.mapping.checkpoint_table, self.mapping.name)

    async def run(self) -> None:
        m = self.mapping
        self.control = control = await trio.to_thread.run_sync(
            lambda: psycopg.connect(m.dsn, autocommit=True), abandon_on_cancel=True
        )
        # The checkpoint must be durable before the append it describes (a database whose
        # default is synchronous_commit = off could lose it in a crash, and the restart would
        # then send already-appended rows under a new epoch).
        await blocking(control.execute, "SET synchronous_commit = on")
        store = self.store
        if not await blocking(store.try_lock, m.slot):
            raise BridgeBusy(f"mapping {m.name}: another bridge holds slot {m.slot} (advisory lock); waiting")
        await blocking(store.ensure_table)
        tables = await blocking(catalog.check_tables, self.control, m.name, m.tables)
        await blocking(catalog.ensure_publication, self.control, m.name, m.publication, m.tables)
        try:
            created = (await self.stream.create(content_type=encode.JSON_TYPE)).created
        except StreamExists as error:
            raise MappingStopped(
                f"mapping {m.name}: stream {m.stream} exists with another configuration (not application/json?)"
            ) from error
        previous = await blocking(store.load)
        slot = await blocking(catalog.slot_state, self.control, m.slot)
        if slot is not None and slot.database != control.info.dbname:
            # Slot names are cluster-wide: another database's mapping of the same name owns it.
            raise MappingStopped(
                f"mapping {m.name}: replication slot {m.slot} belongs to database {slot.database}; "
                f"give this mapping another `slot` (and `publication`)"
            )
        if previous is None or previous.appended_lsn is None:
            start = await self._snapshot(previous, slot, tables, stream_was_new=created)
            rebuilding = False
        else:
            start, rebuilding = await self._resume(previous, slot, tables, stream_was_new=created)
        self.confirmed = start
        self.stats.position = lsn_text(start)
        assert self.replication is not None
        try:
            await self.replication.start(m.slot, start, m.publication)
        except ReplicationError as error:
            raise self._slot_error(error) from error
        log.info("mapping %s: streaming slot %s from %s", m.name, m.slot, lsn_text(start))
        self.stats.state = "streaming"
        await self._stream(Changes(m.name, tables), rebuilding)

    def _slot_error(self, error: ReplicationError) -> Exception:
        if error.sqlstate == "55000" and "can no longer" in str(error):
            return MappingStopped(
                f"mapping {self.mapping.name}: slot {self.mapping.slot} was invalidated: {error}; {reset_hint(self.mapping.name)}"
            )
        return error

    async def _resume(
        self,
        previous: Checkpoint,
        slot: catalog.SlotState | None,
        tables: dict[str, catalog.TableInfo],
        stream_was_new: bool,
    ) -> tuple[int, bool]:
        """Takes over a mapping whose snapshot is done: the checkpoint's generation bumped (a
        paused older bridge can no longer write it), then either its pending batch is to be
        rebuilt and re-sent under the old epoch (returns True), or the epoch is bumped now."""
        m = self.mapping
        if slot is None:
            raise MappingStopped(f"mapping {m.name}: replication slot {m.slot} is gone; {reset_hint(m.name)}")
        if slot.wal_status == "lost":
            raise MappingStopped(
                f"mapping {m.name}: replication slot {m.slot} was invalidated (WAL removed past "
                f"max_slot_wal_keep_size); {reset_hint(m.name)}"
            )
        if slot.active_pid is not None:
            raise BridgeBusy(f"mapping {m.name}: slot {m.slot} is in use by backend {slot.active_pid}")
        if stream_was_new:
            raise MappingStopped(
                f"mapping {m.name}: stream {m.stream} was deleted since the checkpoint (created again "
                f"now, empty); {reset_hint(m.name)}"
            )
        keys = {name: list(table.primary_key) for name, table in tables.items()}
        if previous.keys and previous.keys != keys:
            raise MappingStopped(
                f"mapping {m.name}: primary keys changed since the snapshot (were {previous.keys}, now "
                f"{keys}); {reset_hint(m.name)}"
            )
        self.checkpoint = await blocking(self.store.claim, previous, previous)
        assert previous.appended_lsn is not None
        if previous.pending is None:
            await self._next_epoch()
        self.replication = await ReplicationConnection.open(m.dsn)
        return previous.appended_lsn, previous.pending is not None

    async def _next_epoch(self) -> None:
        assert self.checkpoint is not None
        self.checkpoint = self.checkpoint.next_epoch()
        await blocking(self.store.save, self.checkpoint)

    # The snapshot.

    async def _snapshot(
        self,
        previous: Checkpoint | None,
        slot: catalog.SlotState | None,
        tables: dict[str, catalog.TableInfo],
        stream_was_new: bool,
    ) -> int:
        """Creates the slot, copies its exported snapshot onto the stream, and returns the slot's
        consistent point. A snapshot cut short (no finished checkpoint) is started over from a new
        slot behind a `reset` control message, under a new epoch (the old epoch's seqs may hold
        batches of the abandoned copy)."""
        m = self.mapping
        assert self.control is not None
        if slot is not None:
            if slot.active_pid is not None:
                raise BridgeBusy(f"mapping {m.name}: slot {m.slot} is in use by backend {slot.active_pid}")
            await blocking(catalog.drop_slot, self.control, m.slot)
        keys = {name: list(table.primary_key) for name, table in tables.items()}
        if previous is None:
            fresh = Checkpoint(new_producer_id(m.name), 0, 0, None, None, 0, keys)
        else:
            fresh = Checkpoint(previous.producer_id, previous.epoch + 1, 0, None, None, 0, keys)
        self.checkpoint = await blocking(self.store.claim, previous, fresh)
        self.stats.state = "snapshot"
        self.replication = await ReplicationConnection.open(m.dsn)
        made = await self.replication.create_slot(m.slot, export_snapshot=m.snapshot)
        point = lsn_text(made.consistent_point)
        log.info("mapping %s: created slot %s at %s", m.name, m.slot, point)
        head: list[dict[str, Any]] = [] if stream_was_new else [encode.control("reset")]
        if m.snapshot:
            assert made.snapshot_name is not None
            reader = await blocking(SnapshotReader, m.dsn, made.snapshot_name)
            try:
                pending: list[dict[str, Any]] = [*head, encode.control("snapshot-start")]
                for table in tables.values():
                    chunks = reader.rows(table, m.batch_rows, point)
                    while (chunk := await blocking(next, chunks, None)) is not None:
                        pending.extend(chunk)
                        if len(pending) >= m.batch_rows:
                            await self._append_unrecorded(pending)
                            pending = []
                pending.append(encode.control("snapshot-end"))
                await self._append_unrecorded(pending)
            finally:
                await blocking(reader.close)
        elif head:
            await self._append_unrecorded(head)
        self.checkpoint = replace(self.checkpoint, appended_lsn=made.consistent_point)
        await blocking(self.store.save, self.checkpoint)
        return made.consistent_point

    async def _append_unrecorded(self, messages: list[dict[str, Any]]) -> None:
        """A snapshot batch: not recorded as pending (a crash restarts the whole snapshot under a
        new epoch), only the seq moves on."""
        assert self.checkpoint is not None
        await self._append(messages, self.checkpoint.next_seq)
        crash_point("source.snapshot_append")
        self.checkpoint = replace(self.checkpoint, next_seq=self.checkpoint.next_seq + 1)
        self.stats.progressed(sum(1 for m in messages if "type" in m), self.stats.position)
        self.stats.state = "snapshot"

    async def _append(self, messages: list[dict[str, Any]], seq: int) -> None:
        assert self.checkpoint is not None
        headers = {
            "Content-Type": encode.JSON_TYPE,
            "Producer-Id": self.checkpoint.producer_id,
            "Producer-Epoch": str(self.checkpoint.epoch),
            "Producer-Seq": str(seq),
        }
        try:
            await self.stream.post(encode.payload(messages), headers)
        except PayloadTooLarge as error:
            raise MappingStopped(
                f"mapping {self.mapping.name}: a batch of {len(messages)} messages is over the server's body "
                f"limit, and a batch never splits a transaction: raise the server's --max-body-bytes above "
                f"the largest transaction's size (the pending batch is re-sent whole), then start the sync"
            ) from error
        except BadRequest as error:
            # The server refuses these bytes and always will (a value it cannot store): retrying
            # would hold the slot, and with it Postgres' WAL, for ever.
            raise MappingStopped(
                f"mapping {self.mapping.name}: the server refused a batch of {len(messages)} messages: "
                f"{error.message}; fix or remove the row (tables {', '.join(self.mapping.tables)}), then "
                f"{reset_hint(self.mapping.name)}"
            ) from error
        except (SequenceConflict, StreamNotFound) as error:
            # The server no longer has this producer's history (the stream was deleted or
            # re-created): what the stream holds is unknown, a fresh snapshot is the way back.
            raise MappingStopped(
                f"mapping {self.mapping.name}: stream {self.mapping.stream} lost its history ({error}); "
                f"{reset_hint(self.mapping.name)}"
            ) from error

    # Streaming.

    async def _stream(self, changes: Changes, rebuilding: bool) -> None:
        """Reads the slot and appends its batches until cancelled: two tasks, so the slot is read
        and decoded while the previous batch is checkpointed and appended (each of those waits
        on an fsync, here and on the server). The appender takes batches in order, one at a time:
        the checkpoint's single pending batch and the seq order need nothing more."""
        send, receive = trio.open_memory_channel[tuple[Batch, bool]](1)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._appender, receive)
                await self._read(changes, rebuilding, send)
        except BaseExceptionGroup as group:
            # One task failed and the other was cancelled: raise the failure as itself, so the
            # caller sees a MappingStopped (or a transient error) rather than a group.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise

    async def _appender(self, batches: trio.MemoryReceiveChannel[tuple[Batch, bool]]) -> None:
        async for batch, resend in batches:
            await self._flush(batch, resend)
            if resend:
                await self._next_epoch()  # the old epoch's last batch is settled: fence it
            self.in_flight -= 1
            if not self.in_flight and self.waiting is not None:
                self.waiting.cancel()  # the reader holds a batch: hand it over now
            if not self.in_flight and self.idle is not None:
                self.idle.set()  # the reader waits to stop (_settle)

    async def _hand_over(
        self, send: trio.MemorySendChannel[tuple[Batch, bool]], batch: Batch, resend: bool = False
    ) -> None:
        self.in_flight += 1
        await send.send((batch, resend))

    async def _read(
        self, changes: Changes, rebuilding: bool, send: trio.MemorySendChannel[tuple[Batch, bool]]
    ) -> None:
        """Reads the slot into batches of whole transactions. While `rebuilding`, the
        checkpoint's pending batch is re-collected and re-sent whole, whatever batch_rows and
        batch_wait say now.

        Messages libpq has already buffered are handled without any await; only when none is left
        does the loop wait on the socket, under one cancel scope (the batch's deadline, or the
        status interval)."""
        m = self.mapping
        replication = self.replication
        assert replication is not None and self.checkpoint is not None
        # Transactions ending at or before this are on the stream already: the slot may replay
        # them (its position is persisted only at Postgres checkpoints). Everything read later
        # ends after it, so the appender moving the checkpoint on changes nothing here.
        skip_through = self.checkpoint.appended_lsn
        assert skip_through is not None
        batch = Batch()
        transaction: Transaction | None = None
        last_status = time.monotonic()
        last_table_check = last_status
        while True:
            received = replication.receive_nowait()
            if received is None:
                now = time.monotonic()
                if (
                    batch.rows
                    and not rebuilding
                    and (not self.in_flight or now - batch.opened_at >= m.batch_wait)
                ):
                    await self._hand_over(send, batch)
                    batch = Batch()
                    last_status = time.monotonic()
                    continue
                if now - last_status >= STATUS_EVERY:
                    await self._send_status()
                    last_status = now
                if not batch.rows and transaction is None and now - last_table_check >= TABLE_CHECK_EVERY:
                    # DDL is not streamed: a dropped or renamed table is seen here (a quiet slot's
                    # keepalives may be minutes apart).
                    await blocking(catalog.check_tables, self.control, m.name, m.tables)
                    last_table_check = time.monotonic()
                if batch.rows and not rebuilding:
                    timeout = batch.opened_at + m.batch_wait - now
                else:
                    timeout = last_status + STATUS_EVERY - now
                with trio.move_on_after(max(0.0, timeout)) as scope:
                    # A batch waiting here is closed as soon as the appender is free: it cancels this.
                    self.waiting = scope if batch.rows else None
                    await replication.wait()
                self.waiting = None
                continue
            if received[0] != XLOG_DATA:
                keepalive = decode_copy(received)
                assert isinstance(keepalive, Keepalive)
                self.server_wal_end = max(self.server_wal_end, keepalive.wal_end)
                if transaction is None and not batch.rows and not rebuilding and not self.in_flight:
                    # Nothing of ours is open: everything the server has sent is settled, so its
                    # WAL may be recycled (an idle publication must not hold WAL forever).
                    self.confirmed = max(self.confirmed, keepalive.wal_end)
                    if time.monotonic() - last_table_check >= TABLE_CHECK_EVERY:
                        await blocking(catalog.check_tables, self.control, m.name, m.tables)
                        last_table_check = time.monotonic()
                if keepalive.reply_requested or self.confirmed > self.sent_status:
                    await self._send_status()
                    last_status = time.monotonic()
                self._lag()
                continue
            end = wal_end(received)
            if end > self.server_wal_end:
                self.server_wal_end = end
            message = decode(received, XLOG_PAYLOAD)
            if isinstance(message, Insert | Update | Delete | Truncate):
                if transaction is not None and not transaction.skip:
                    try:
                        changes.add(message, transaction)
                    except MappingStopped:
                        await self._settle(send, batch, rebuilding)
                        raise
            elif isinstance(message, Begin):
                transaction = Transaction(message.xid, message.commit_time)
            elif isinstance(message, Commit):
                done, transaction = transaction, None
                if done is None or message.end_lsn <= skip_through or not done.messages:
                    continue  # already on the stream (a replay), or nothing of ours
                done.committed(lsn_text(message.end_lsn))
                if not batch.rows:
                    batch.opened_at = time.monotonic()
                batch.messages.extend(done.messages)
                batch.rows += len(done.messages)
                batch.end_lsn = message.end_lsn
                batch.commit_time = message.commit_time
                if rebuilding:
                    pending = self.checkpoint.pending
                    assert pending is not None
                    if message.end_lsn < pending.end_lsn:
                        continue
                    if message.end_lsn > pending.end_lsn:
                        raise RuntimeError(
                            f"mapping {m.name}: the pending batch ends at {lsn_text(pending.end_lsn)} but no "
                            f"transaction of the slot ends there (next: {lsn_text(message.end_lsn)})"
                        )
                    await self._hand_over(send, batch, resend=True)
                    batch = Batch()
                    rebuilding = False
                elif (
                    not self.in_flight
                    or batch.rows >= m.batch_rows
                    or time.monotonic() - batch.opened_at >= m.batch_wait
                ):
                    await self._hand_over(send, batch)
                    batch = Batch()
                    last_status = time.monotonic()
            elif isinstance(message, Origin):
                if transaction is not None and is_sink_origin(message.name):
                    transaction.skip = True
            elif isinstance(message, Relation):
                key = None
                if changes.relation_needs_catalog(message):
                    key = await blocking(catalog.primary_key, self.control, message.qualified)
                changes.add_relation(message, key)

    async def _settle(
        self, send: trio.MemorySendChannel[tuple[Batch, bool]], batch: Batch, rebuilding: bool
    ) -> None:
        """Before a stop: the whole transactions read before the change that stops the mapping
        go onto the stream (and into the checkpoint), so the stream ends where the trouble
        starts, not at the last batch handed over. A pending batch being rebuilt must go whole
        (same seq, same contents), so it stays pending."""
        if batch.rows and not rebuilding:
            await self._hand_over(send, batch)
        if self.in_flight:
            self.idle = trio.Event()
            await self.idle.wait()

    async def _flush(self, batch: Batch, resend: bool = False) -> None:
        assert self.checkpoint is not None and self.replication is not None
        if not resend:
            self.checkpoint = self.checkpoint.with_pending(batch.end_lsn)
            await blocking(self.store.save, self.checkpoint)
        pending = self.checkpoint.pending
        assert pending is not None and pending.end_lsn == batch.end_lsn
        crash_point("source.before_append")
        await self._append(batch.messages, pending.seq)
        crash_point("source.after_append")
        self.checkpoint = self.checkpoint.appended()
        await blocking(self.store.save, self.checkpoint)
        crash_point("source.after_checkpoint")
        self.confirmed = max(self.confirmed, batch.end_lsn)
        await self._send_status()
        self.stats.progressed(batch.rows, lsn_text(self.confirmed))
        self.stats.lag_seconds = max(0.0, time.time() - unix_time(batch.commit_time))
        self._lag()

    async def _send_status(self) -> None:
        assert self.replication is not None
        await self.replication.send_status(self.confirmed, self.confirmed)
        self.sent_status = self.confirmed

    def _lag(self) -> None:
        self.stats.lag_bytes = max(0, self.server_wal_end - self.confirmed)
        self.stats.position = lsn_text(self.confirmed)
