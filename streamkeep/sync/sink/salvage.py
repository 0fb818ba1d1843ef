"""A batch Postgres refused, applied again one message at a time, each in a savepoint.

The sink's own checks (log.convert, state.CLASSIFY) catch most messages that do not fit before
anything is sent; some only Postgres can judge: a string jsonb cannot hold ("\\u0000"), a number
past a column's range, a date it cannot parse (SQLSTATE class 22), a constraint of the user's own
table (class 23). One such message fails the statement that carries a whole answer, so the
transaction is tried again message by message: the messages Postgres refuses become misfits
(dead-lettered by commit.apply, in the same transaction as the others and the stored offset), the
others are applied as the batch would have applied them. A statement per message is slow, which is
why this runs only after a refusal and the usual path stays one statement per answer."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

from streamkeep.sync.sink.batch import Misfit, Outcome, Part

# What makes a message, not the batch or the connection, the cause: the data and integrity classes,
# and bytes that are not UTF-8 (a JSON stream's are, so this is a byte stream's text column).
REFUSED = (psycopg.errors.DataError, psycopg.errors.IntegrityError, UnicodeDecodeError)
# The log table's own key: a row already there at a message's place says the table is shared (two
# mappings, or one renamed), which no message can be blamed for.
PLACE_COLUMNS = frozenset(("stream", "stream_offset", "message_index"))


class PlaceTaken(Exception):
    """The log table already holds a row at a message's (stream_offset, message_index)."""


# A batch's write: (cursor, parts, in_snapshot, clear_first) -> what it did.
PartsWriter = Callable[[psycopg.Cursor[Any], list[Part], bool, bool], Outcome]

SAVEPOINT = "streamkeep_sink_message"


def write_each(
    cur: psycopg.Cursor[Any],
    parts: list[Part],
    write: PartsWriter,
    in_snapshot: bool,
    clear_first: bool,
    raw_json: bool,
) -> Outcome:
    """Writes `parts` as `write` would, a message per savepoint; what Postgres refuses is a misfit.
    `raw_json`: the parts are a JSON stream's answers left unparsed (state mode reads them so)."""
    # A pending clear first, outside the savepoints: a refused first message must not undo it.
    in_snapshot = write(cur, [], in_snapshot, clear_first).in_snapshot
    applied = 0
    misfits: list[Misfit] = []
    for part in singles(parts, raw_json):
        cur.execute(f"SAVEPOINT {SAVEPOINT}")
        try:
            done = write(cur, [part], in_snapshot, False)
        except REFUSED as error:
            cur.execute(f"ROLLBACK TO SAVEPOINT {SAVEPOINT}")
            if _place_taken(cur, error):
                raise PlaceTaken(describe(error)) from error
            message = part.messages[0] if part.messages else part.data
            misfits.append(Misfit(part.offset, part.first_index, message, describe(error)))
            continue
        cur.execute(f"RELEASE SAVEPOINT {SAVEPOINT}")
        applied += done.applied
        misfits += done.misfits
        in_snapshot = done.in_snapshot
    return Outcome(applied, in_snapshot, misfits)


def singles(parts: list[Part], raw_json: bool) -> Iterator[Part]:
    """Each message of a JSON stream's answers as a part of its own, keeping its place in its
    answer; a byte stream's answer is one message already."""
    for part in parts:
        messages = part.messages
        if messages is None and raw_json and part.data.strip():
            parsed = json.loads(part.data)  # a JSON stream's answer is an array of its messages
            messages = parsed if isinstance(parsed, list) else [parsed]
        if messages is None:
            yield part
            continue
        for index, message in enumerate(messages):
            data = json.dumps([message]).encode()
            yield Part(part.offset, part.next_offset, [message], data, part.first_index + index)


def _place_taken(cur: psycopg.Cursor[Any], error: BaseException) -> bool:
    """Whether `error` is a unique violation of an index on the log's place columns only (its
    UNIQUE (stream_offset, message_index), whatever it is named), not of a key of the user's."""
    if not isinstance(error, psycopg.errors.UniqueViolation):
        return False
    diag = error.diag
    if not (diag.constraint_name and diag.schema_name):
        return False
    row = cur.execute(
        """SELECT array_agg(a.attname::text) FROM pg_index i
           JOIN pg_class ic ON ic.oid = i.indexrelid
           JOIN pg_namespace n ON n.oid = ic.relnamespace
           JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
           WHERE ic.relname = %s AND n.nspname = %s""",
        (diag.constraint_name, diag.schema_name),
    ).fetchone()
    columns: list[str] = (row[0] if row is not None else None) or []
    return bool(columns) and set(columns) <= PLACE_COLUMNS


def describe(error: BaseException) -> str:
    """Why a message was refused, as a dead-letter row or a log line says it."""
    if isinstance(error, psycopg.Error) and error.diag.message_primary:
        detail = f" ({error.diag.message_detail})" if error.diag.message_detail else ""
        return f"Postgres refused it, SQLSTATE {error.diag.sqlstate}: {error.diag.message_primary}{detail}"
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 text, which its column needs: {error}"
    return f"refused: {error}"
