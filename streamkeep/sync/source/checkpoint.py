"""The source's checkpoint: one row per mapping in `streamkeep_sync.checkpoints` (outside every
publication), the only memory the bridge has across crashes.

It holds the idempotent producer's identity (id, epoch, next seq), how far the stream holds the
slot's transactions (`appended_lsn`: every transaction whose commit ends at or before it is on the
stream), and the batch being appended (`pending_*`: its seq and the commit end of its last
transaction; it starts right after `appended_lsn`). The pending batch is written BEFORE its append,
so a restart can rebuild exactly that batch and re-send it under the same seq.

Fencing: a session advisory lock keyed by the slot keeps a second bridge out while the first one's
Postgres session lives, and every write is a compare-and-set on `generation`, which each bridge
bumps when it takes the mapping over: a bridge that was paused past its lock (its session died, a
new bridge took over) can no longer move the checkpoint, backwards or forwards."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace

import psycopg
from psycopg import sql

from streamkeep.sync.source.pgoutput import lsn_parse, lsn_text


class Fenced(Exception):
    """Another bridge took this mapping over (the checkpoint's generation moved)."""


@dataclass(frozen=True)
class Pending:
    seq: int
    end_lsn: int  # the commit end of the batch's last transaction


@dataclass(frozen=True)
class Checkpoint:
    producer_id: str
    epoch: int
    next_seq: int
    appended_lsn: int | None  # None: the snapshot is not finished (a restart starts it over)
    pending: Pending | None
    generation: int
    # Each table's primary key columns when the snapshot was taken: a key changed since (even
    # while no bridge ran) changes what `key` means on the stream, so it stops the mapping.
    keys: dict[str, list[str]] = field(default_factory=dict)

    def with_pending(self, end_lsn: int) -> Checkpoint:
        return replace(self, pending=Pending(self.next_seq, end_lsn))

    def appended(self) -> Checkpoint:
        """The pending batch is on the stream."""
        assert self.pending is not None
        return replace(self, appended_lsn=self.pending.end_lsn, next_seq=self.pending.seq + 1, pending=None)

    def next_epoch(self) -> Checkpoint:
        # A new epoch starts at seq 0 (PROTOCOL.md 5.2.1); the server then refuses the old one (403).
        assert self.pending is None
        return replace(self, epoch=self.epoch + 1, next_seq=0)


def new_producer_id(name: str) -> str:
    """Unique per checkpoint: after a reset the server's state for the old id (its epoch) is
    irrelevant, so a new id starts at epoch 0 without a 403."""
    return f"streamkeep-sync-{name}-{uuid.uuid4().hex[:12]}"


def lock_key(slot: str) -> str:
    return f"streamkeep_sync.source:{slot}"


class CheckpointStore:
    """The checkpoint row of mapping `name`, read and written on `conn` (autocommit; blocking:
    call from a worker thread)."""

    def __init__(self, conn: psycopg.Connection[tuple[object, ...]], table: str, name: str) -> None:
        schema, _, relation = table.partition(".")
        self.conn = conn
        self.schema = sql.Identifier(schema)
        self.table = sql.Identifier(schema, relation)
        self.name = name

    def try_lock(self, slot: str) -> bool:
        row = self.conn.execute(
            "SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", (lock_key(slot),)
        ).fetchone()
        return bool(row and row[0])

    def ensure_table(self) -> None:
        for statement in (
            sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(self.schema),
            sql.SQL(
                """CREATE TABLE IF NOT EXISTS {} (
                    name text PRIMARY KEY,
                    producer_id text NOT NULL,
                    epoch bigint NOT NULL,
                    next_seq bigint NOT NULL,
                    appended_lsn pg_lsn,
                    pending_seq bigint,
                    pending_end_lsn pg_lsn,
                    generation bigint NOT NULL,
                    keys jsonb NOT NULL DEFAULT '{{}}',
                    updated_at timestamptz NOT NULL DEFAULT now()
                )"""
            ).format(self.table),
        ):
            try:
                self.conn.execute(statement)
            except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateSchema):
                pass  # another mapping (or the sink) created it at the same moment

    def load(self) -> Checkpoint | None:
        row = self.conn.execute(
            sql.SQL(
                "SELECT producer_id, epoch, next_seq, appended_lsn::text, pending_seq,"
                " pending_end_lsn::text, generation, keys::text FROM {} WHERE name = %s"
            ).format(self.table),
            (self.name,),
        ).fetchone()
        if row is None:
            return None
        producer_id, epoch, next_seq, appended, pending_seq, pending_end, generation, keys = row
        pending = None
        if pending_seq is not None and pending_end is not None:
            pending = Pending(int(str(pending_seq)), lsn_parse(str(pending_end)))
        return Checkpoint(
            producer_id=str(producer_id),
            epoch=int(str(epoch)),
            next_seq=int(str(next_seq)),
            appended_lsn=None if appended is None else lsn_parse(str(appended)),
            pending=pending,
            generation=int(str(generation)),
            keys=json.loads(str(keys)),
        )

    def claim(self, previous: Checkpoint | None, fresh: Checkpoint) -> Checkpoint:
        """Takes the mapping over: `fresh` stored with the generation after `previous`'s (or a new
        row when there was none). Raises `Fenced` when someone else got there first."""
        claimed = replace(fresh, generation=(previous.generation + 1) if previous else 1)
        if previous is None:
            cursor = self.conn.execute(
                sql.SQL(
                    "INSERT INTO {} (name, producer_id, epoch, next_seq, appended_lsn, pending_seq,"
                    " pending_end_lsn, keys, generation)"
                    " VALUES (%s, %s, %s, %s, %s::pg_lsn, %s, %s::pg_lsn, %s::jsonb, %s)"
                    " ON CONFLICT (name) DO NOTHING"
                ).format(self.table),
                (self.name, *self._fields(claimed), claimed.generation),
            )
            if cursor.rowcount != 1:
                raise Fenced(f"another bridge created mapping {self.name}'s checkpoint")
            return claimed
        self._update(claimed, expect=previous.generation)
        return claimed

    def save(self, checkpoint: Checkpoint) -> None:
        self._update(checkpoint, expect=checkpoint.generation)

    def delete(self) -> bool:
        try:
            cursor = self.conn.execute(
                sql.SQL("DELETE FROM {} WHERE name = %s").format(self.table), (self.name,)
            )
        except psycopg.errors.UndefinedTable:
            return False
        return cursor.rowcount > 0

    @staticmethod
    def _fields(c: Checkpoint) -> tuple[object, ...]:
        return (
            c.producer_id,
            c.epoch,
            c.next_seq,
            None if c.appended_lsn is None else lsn_text(c.appended_lsn),
            None if c.pending is None else c.pending.seq,
            None if c.pending is None else lsn_text(c.pending.end_lsn),
            json.dumps(c.keys),
        )

    def _update(self, c: Checkpoint, expect: int) -> None:
        cursor = self.conn.execute(
            sql.SQL(
                "UPDATE {} SET producer_id = %s, epoch = %s, next_seq = %s, appended_lsn = %s::pg_lsn,"
                " pending_seq = %s, pending_end_lsn = %s::pg_lsn, keys = %s::jsonb, generation = %s,"
                " updated_at = now()"
                " WHERE name = %s AND generation = %s"
            ).format(self.table),
            (*self._fields(c), c.generation, self.name, expect),
        )
        if cursor.rowcount != 1:
            raise Fenced(f"mapping {self.name}'s checkpoint was taken over by another bridge")
