"""Log mode: one row per message (the seed's `session_events`), with mapped columns taken from the
message by a field path ("value.user_id": message["value"]["user_id"]; a digit segment indexes an
array).

A mapped value is checked against its column's type here, so a message that does not fit is found
(and dead-lettered, or stops the mapping) before anything is sent: a string or any JSON (as its
text) for text, an integer for the integer types, a number for numeric/real/double, true/false for
boolean, anything for json/jsonb; JSON null is SQL NULL; for any other type a string, which
Postgres parses. A missing path does not fit."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from streamkeep.sync.sink.batch import Misfit, Outcome, Part, dumps
from streamkeep.sync.sink.names import Names
from streamkeep.sync.sink.tables import LogColumns

INTEGERS = ("smallint", "integer", "bigint")
compact = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode  # JSON in a text column
NUMBERS = ("real", "double precision")
_MISSING = object()


@dataclass
class Plan:
    rows: list[tuple[Any, ...]]
    misfits: list[Misfit]
    applied: int
    clear_first: bool


def field(message: Any, path: str) -> Any:
    """The value at `path`, or _MISSING."""
    value = message
    for segment in path.split("."):
        if isinstance(value, dict) and segment in value:
            value = value[segment]
        elif isinstance(value, list) and segment.isdigit() and int(segment) < len(value):
            value = value[int(segment)]
        else:
            return _MISSING
    return value


def convert(value: Any, column_type: str) -> str | None:
    """`value` as COPY text for a column of `column_type`; ValueError when it does not fit."""
    if value is None:
        return None
    if column_type in ("json", "jsonb"):
        return dumps(value)
    if column_type == "text" or column_type.startswith(("character", "varchar")):
        return value if isinstance(value, str) else compact(value)
    if column_type in INTEGERS:
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
    elif column_type in NUMBERS or column_type.startswith("numeric"):
        if isinstance(value, int | float) and not isinstance(value, bool):
            return dumps(value)
    elif column_type == "boolean":
        if isinstance(value, bool):
            return "true" if value else "false"
    elif isinstance(value, str):
        return value
    raise ValueError(f"a JSON {type(value).__name__} does not fit a {column_type} column")


def plan(
    parts: list[Part], stream: str, columns: dict[str, str], types: LogColumns, clear_first: bool
) -> Plan:
    rows: list[tuple[Any, ...]] = []
    misfits: list[Misfit] = []
    for part in parts:
        if part.messages is None:  # a byte stream: no message boundaries, one row per answer
            if part.data:
                rows.append((stream, part.offset, 0, part.data))
            continue
        for index, message in enumerate(part.messages):
            try:
                mapped = []
                for column, path in columns.items():
                    value = field(message, path)
                    if value is _MISSING:
                        raise ValueError(f"no field {path!r} (column {column})")
                    try:
                        mapped.append(convert(value, types.types[column]))
                    except ValueError as error:
                        raise ValueError(f"field {path!r} (column {column}): {error}") from None
            except ValueError as error:
                misfits.append(Misfit(part.offset, part.first_index + index, message, str(error)))
                continue
            rows.append((stream, part.offset, part.first_index + index, dumps(message), *mapped))
    return Plan(rows, misfits, len(rows), clear_first)


def write(cur: psycopg.Cursor[Any], names: Names, columns: dict[str, str], plan: Plan) -> Outcome:
    if plan.clear_first:  # `streamkeep sync reset`: the log is applied again from the beginning
        cur.execute(sql.SQL("DELETE FROM {}").format(names.table))
    if not plan.rows:
        return Outcome(0, False, plan.misfits)
    listed = [sql.Identifier(c) for c in ("stream", "stream_offset", "message_index", "message", *columns)]
    with cur.copy(sql.SQL("COPY {} ({}) FROM STDIN").format(names.table, sql.SQL(", ").join(listed))) as copy:
        for row in plan.rows:
            copy.write_row(row)
    return Outcome(plan.applied, False, plan.misfits)
