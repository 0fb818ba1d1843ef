"""The tables a sink writes, created when missing, and what an existing table's columns are.

state: `(type text, key text, value jsonb, primary key (type, key))` (issue 25 item 5), plus a
staging table of the same shape in schema streamkeep_sync for a snapshot in progress.
log: one row per message: `stream`, `stream_offset` (the offset of the read answer, or SSE
event, that held it), `message_index` (its place in that answer), `message` (jsonb for a JSON
stream; bytea for any other, one row per answer since such a stream has no message boundaries),
one `text` column per mapped field, `applied_at`; unique on (stream_offset, message_index).
dead letter: what did not fit, with its place and the reason; `message` is json, not jsonb,
which cannot hold every JSON string ("\\u0000": one reason a message lands there)."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from streamkeep.sync.config import StreamToPg
from streamkeep.sync.sink.names import Names


@dataclass(frozen=True)
class LogColumns:
    """The mapped columns of a log table and their Postgres types (as `format_type` spells them):
    a table a person made may type them (bigint, boolean, jsonb ...); ours are text."""

    types: dict[str, str]


def _state_table(name: sql.Identifier, fillfactor: int = 100) -> sql.Composed:
    return sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} (type text NOT NULL, key text NOT NULL, value jsonb, PRIMARY KEY (type, key))"
        " WITH (fillfactor = {})"
    ).format(name, sql.Literal(fillfactor))


def create_state(conn: psycopg.Connection, names: Names) -> None:
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(names.table_schema))
    # Room left in each page so an update can stay on its page without a new index entry (a HOT
    # update): ~10% more upserts per second measured here, on a table that is mostly updated.
    conn.execute(_state_table(names.table, fillfactor=80))
    conn.execute(_state_table(names.staging))
    conn.commit()


def create_log(conn: psycopg.Connection, names: Names, mapping: StreamToPg, json_stream: bool) -> LogColumns:
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(names.table_schema))
    mapped = [sql.SQL("{} text").format(sql.Identifier(column)) for column in mapping.columns]
    conn.execute(
        sql.SQL(
            """CREATE TABLE IF NOT EXISTS {} (
                stream text NOT NULL,
                stream_offset text NOT NULL,
                message_index integer NOT NULL,
                message {},
                {}
                applied_at timestamptz NOT NULL DEFAULT now(),
                UNIQUE (stream_offset, message_index)
            )"""
        ).format(
            names.table,
            sql.SQL("jsonb" if json_stream else "bytea"),
            sql.SQL("").join(sql.Composed([m, sql.SQL(",\n")]) for m in mapped),
        )
    )
    types = column_types(conn, mapping.table)
    conn.commit()
    missing = [
        c for c in [*mapping.columns, "stream", "stream_offset", "message_index", "message"] if c not in types
    ]
    if missing:
        raise LookupError(f"table {mapping.table} has no column(s) {', '.join(missing)}")
    return LogColumns({column: types[column] for column in mapping.columns} | {"message": types["message"]})


def column_types(conn: psycopg.Connection, table: str) -> dict[str, str]:
    schema, _, name = table.partition(".")
    rows = conn.execute(
        """SELECT a.attname, format_type(a.atttypid, a.atttypmod)
           FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped""",
        (schema, name),
    ).fetchall()
    return {str(row[0]): str(row[1]) for row in rows}


def create_dead_letter(conn: psycopg.Connection, names: Names) -> None:
    if names.dead_letter is None or names.dead_letter_schema is None:
        return
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(names.dead_letter_schema))
    conn.execute(
        sql.SQL(
            """CREATE TABLE IF NOT EXISTS {} (
                id bigserial PRIMARY KEY,
                mapping text NOT NULL,
                stream text NOT NULL,
                stream_offset text NOT NULL,
                message_index integer NOT NULL,
                message json,
                error text NOT NULL,
                at timestamptz NOT NULL DEFAULT now()
            )"""
        ).format(names.dead_letter)
    )
    conn.commit()
