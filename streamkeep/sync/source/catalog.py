"""What the source checks in Postgres' catalog before streaming: each table exists and has a
primary key, its TOASTable columns cannot arrive as "unchanged" (else REPLICA IDENTITY FULL is
required), the publication lists exactly the mapping's tables, and the slot's health. Blocking:
call from a worker thread."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from streamkeep.sync.stats import MappingStopped

Conn = psycopg.Connection[tuple[object, ...]]


@dataclass(frozen=True)
class TableInfo:
    name: str  # schema.table, as configured
    primary_key: tuple[str, ...]
    replica_identity: str  # 'd', 'f', 'i', 'n'


def _reset_hint(mapping: str) -> str:
    return (
        f"run `streamkeep sync reset {mapping}` (drops the slot and checkpoint; the next start re-snapshots)"
    )


def primary_key(conn: Conn, table: str) -> tuple[str, ...] | None:
    """The table's primary key columns in key order, () when it has none, None when it is gone."""
    schema, _, name = table.partition(".")
    row = conn.execute(
        """SELECT c.oid,
               (SELECT array_agg(a.attname::text ORDER BY array_position(i.indkey::int2[], a.attnum))
                  FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
                 WHERE i.indrelid = c.oid AND i.indisprimary)
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')""",
        (schema, name),
    ).fetchone()
    if row is None:
        return None
    columns: list[str] = row[1] or []  # type: ignore[assignment]
    return tuple(columns)


def check_tables(conn: Conn, mapping: str, tables: tuple[str, ...]) -> dict[str, TableInfo]:
    found: dict[str, TableInfo] = {}
    for table in tables:
        key = primary_key(conn, table)
        if key is None:
            raise MappingStopped(
                f"mapping {mapping}: table {table} does not exist (dropped or renamed?): create it, or "
                f"fix `tables` and {_reset_hint(mapping)}"
            )
        if not key:
            raise MappingStopped(
                f"mapping {mapping}: table {table} has no primary key: a change message needs a key; "
                f"add one (ALTER TABLE {table} ADD PRIMARY KEY (...)) or leave the table out"
            )
        schema, _, name = table.partition(".")
        row = conn.execute(
            """SELECT c.relreplident::text,
                      array_agg(a.attname::text ORDER BY a.attnum) FILTER (WHERE a.attstorage <> 'p')
                 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                 JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
                WHERE n.nspname = %s AND c.relname = %s GROUP BY c.relreplident""",
            (schema, name),
        ).fetchone()
        assert row is not None
        identity = str(row[0])
        toastable = [column for column in (row[1] or ()) if column not in key]  # type: ignore[attr-defined]
        # An UPDATE that leaves a TOASTed value alone logs it as "unchanged" (not its value) unless
        # the old row is logged whole: the message would lack the column, and no later read of the
        # table can rebuild it deterministically. So such tables need REPLICA IDENTITY FULL, with
        # which the old row fills the gaps.
        if toastable and identity != "f":
            raise MappingStopped(
                f"mapping {mapping}: table {table} has TOASTable columns ({', '.join(toastable)}) that an "
                f"UPDATE would send as 'unchanged'; run `ALTER TABLE {table} REPLICA IDENTITY FULL`"
            )
        found[table] = TableInfo(table, key, identity)
    return found


def ensure_publication(conn: Conn, mapping: str, publication: str, tables: tuple[str, ...]) -> None:
    rows = conn.execute(
        "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = %s", (publication,)
    ).fetchall()
    exists = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (publication,)).fetchone()
    if exists is None:
        conn.execute(
            sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                sql.Identifier(publication),
                sql.SQL(", ").join(sql.Identifier(*t.split(".")) for t in tables),
            )
        )
        return
    listed = {str(r[0]) for r in rows}
    if listed != set(tables):
        raise MappingStopped(
            f"mapping {mapping}: publication {publication} lists {sorted(listed)}, the config {sorted(tables)}; "
            f"{_reset_hint(mapping)}"
        )


@dataclass(frozen=True)
class SlotState:
    active_pid: int | None
    wal_status: str | None  # 'lost': invalidated (max_slot_wal_keep_size passed)
    database: str | None


def slot_state(conn: Conn, slot: str) -> SlotState | None:
    row = conn.execute(
        "SELECT active_pid, wal_status, database FROM pg_replication_slots WHERE slot_name = %s", (slot,)
    ).fetchone()
    if row is None:
        return None
    pid, status, database = row
    return SlotState(
        None if pid is None else int(str(pid)),
        None if status is None else str(status),
        None if database is None else str(database),
    )


def drop_slot(conn: Conn, slot: str) -> bool:
    row = conn.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s", (slot,)
    ).fetchone()
    return row is not None


def drop_publication(conn: Conn, publication: str) -> bool:
    if conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (publication,)).fetchone() is None:
        return False
    conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(publication)))
    return True


def column_types(conn: Conn, table: str) -> list[tuple[str, int]]:
    """The table's columns and type OIDs, in order (what pgoutput's Relation message lists)."""
    rows = conn.execute(
        """SELECT attname::text, atttypid::int FROM pg_attribute
            WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum""",
        (table,),
    ).fetchall()
    return [(str(name), int(str(oid))) for name, oid in rows]
