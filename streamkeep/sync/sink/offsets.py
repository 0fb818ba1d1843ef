"""Where a sink mapping is in its stream, stored in Postgres (`streamkeep_sync.offsets`), so the
offset and the rows it covers commit together and a restart, a crash or another process starts
exactly where the last commit ended.

One row per mapping. Every change bumps `version`, and every change is a compare-and-set on it:
a paused old sink (or a second one) that wakes up with an older version moves nothing, and since
`reset` keeps the row and bumps the version too, a version is never seen twice (no ABA).

`in_snapshot`: a state-mode snapshot is being staged (snapshot-start seen, snapshot-end not yet).
`clear_pending`: the next commit first empties the table (after `reset`, or a resync in state
mode), so the table flips from the old contents to the new in one transaction."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from streamkeep.sync.sink.names import Names

BEGINNING = "-1"


@dataclass(frozen=True)
class Stored:
    next_offset: str
    version: int
    in_snapshot: bool = False
    clear_pending: bool = False


def create(conn: psycopg.Connection, names: Names, stream: str) -> None:
    """The schema, the table and this mapping's row (from the beginning), if missing; committed."""
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(names.offsets_schema))
    conn.execute(
        sql.SQL(
            """CREATE TABLE IF NOT EXISTS {} (
                mapping text PRIMARY KEY,
                stream text NOT NULL,
                next_offset text NOT NULL,
                version bigint NOT NULL DEFAULT 0,
                in_snapshot boolean NOT NULL DEFAULT false,
                clear_pending boolean NOT NULL DEFAULT false,
                updated_at timestamptz NOT NULL DEFAULT now()
            )"""
        ).format(names.offsets)
    )
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (mapping, stream, next_offset) VALUES (%s, %s, %s) ON CONFLICT (mapping) DO NOTHING"
        ).format(names.offsets),
        (names.mapping, stream, BEGINNING),
    )
    conn.commit()


class OtherStream(Exception):
    """The stored offset is one of another stream: the mapping was pointed at a new stream."""


def load(conn: psycopg.Connection, names: Names, stream: str) -> Stored:
    row = conn.execute(
        sql.SQL(
            "SELECT next_offset, version, in_snapshot, clear_pending, stream FROM {} WHERE mapping = %s"
        ).format(names.offsets),
        (names.mapping,),
    ).fetchone()
    conn.commit()
    if row is None:
        raise LookupError(f"no stored offset for mapping {names.mapping!r}")  # deleted by hand: start over
    if row[4] != stream:
        raise OtherStream(str(row[4]))
    return Stored(row[0], row[1], row[2], row[3])


class Fenced(Exception):
    """Another sink (or `reset`) changed the stored offset since this one read it: nothing was
    written; the mapping starts again from what is stored now."""


def advance(cur: psycopg.Cursor[tuple[object, ...]], names: Names, before: Stored, after: Stored) -> None:
    """The compare-and-set, first in a batch's transaction: it also takes the row's lock, so a
    second sink on the same mapping waits here until the first commits, then finds a newer
    version and writes nothing."""
    cur.execute(
        sql.SQL(
            """UPDATE {} SET next_offset = %s, version = version + 1, in_snapshot = %s,
               clear_pending = %s, updated_at = now()
               WHERE mapping = %s AND version = %s"""
        ).format(names.offsets),
        (after.next_offset, after.in_snapshot, after.clear_pending, names.mapping, before.version),
    )
    if cur.rowcount != 1:
        raise Fenced(
            f"the stored offset of mapping {names.mapping!r} changed under this sink "
            "(another sink process on the same mapping, or `streamkeep sync reset`): starting again from it"
        )


def mark_snapshot(cur: psycopg.Cursor[tuple[object, ...]], names: Names, in_snapshot: bool) -> None:
    """In the transaction that `advance` began (the row is locked): a snapshot began or ended."""
    cur.execute(
        sql.SQL("UPDATE {} SET in_snapshot = %s WHERE mapping = %s").format(names.offsets),
        (in_snapshot, names.mapping),
    )


def restart_from(
    conn: psycopg.Connection,
    names: Names,
    offset: str,
    *,
    clear: bool,
    before: Stored | None = None,
    stream: str | None = None,
) -> str | None:
    """Points the mapping at `offset` (the beginning for `reset`, the earliest offset for a
    resync), the table to be cleared at the next commit when `clear`, of `stream` when given (reset:
    the mapping may name another stream now). With `before` it is a
    compare-and-set like `advance` (raises Fenced). Returns the offset it had, None when the
    mapping had no row (nothing to do)."""
    row = conn.execute(
        sql.SQL("SELECT next_offset, version FROM {} WHERE mapping = %s FOR UPDATE").format(names.offsets),
        (names.mapping,),
    ).fetchone()
    if row is None or (before is not None and row[1] != before.version):
        conn.rollback()
        if before is not None:
            raise Fenced(f"the stored offset of mapping {names.mapping!r} changed under this sink")
        return None
    conn.execute(
        sql.SQL(
            """UPDATE {} SET next_offset = %s, version = version + 1, in_snapshot = false,
               clear_pending = %s, stream = coalesce(%s, stream), updated_at = now() WHERE mapping = %s"""
        ).format(names.offsets),
        (offset, clear, stream, names.mapping),
    )
    conn.commit()
    return str(row[0])
