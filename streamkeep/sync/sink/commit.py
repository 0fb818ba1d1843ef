"""One sink transaction: the replication origin set, the stored offset moved by compare-and-set,
the rows written, the misfits dead-lettered, committed; all or nothing. Blocking (psycopg's sync
connection): the bridge runs it in a worker thread.

Crash points (STREAMKEEP_SYNC_CRASH_AT): `sink.before_commit` (everything sent, not committed:
Postgres rolls it back, the batch is read and applied again) and `sink.after_commit` (committed,
the process not yet told: the next start reads from the stored offset, after that batch)."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import errors, sql
from psycopg.types.json import Json

from streamkeep.sync.crashpoints import crash_point
from streamkeep.sync.sink import offsets
from streamkeep.sync.sink.batch import Misfit, Outcome
from streamkeep.sync.sink.names import Names
from streamkeep.sync.sink.offsets import Stored


def ensure_origin(conn: psycopg.Connection, names: Names) -> None:
    """Creates the mapping's replication origin if missing (two sinks racing: one wins)."""
    try:
        conn.execute(
            """SELECT pg_replication_origin_create(%s)
               WHERE NOT EXISTS (SELECT 1 FROM pg_replication_origin WHERE roname = %s)""",
            (names.origin, names.origin),
        )
        conn.commit()
    except errors.UniqueViolation:
        conn.rollback()


def check_origin(conn: psycopg.Connection, names: Names) -> None:
    """Sets the origin up and resets it once, so a role without the right to use it fails at start
    (InsufficientPrivilege) rather than at every batch. Another session using it is fine here."""
    try:
        conn.execute("SELECT pg_replication_origin_session_setup(%s)", (names.origin,))
    except errors.ObjectInUse:
        conn.rollback()
        return
    except errors.ConfigurationLimitExceeded as error:
        conn.rollback()
        raise RuntimeError(
            f"Postgres has no free replication state for origin {names.origin}: every stream_to_pg "
            "mapping uses one, from the pool that max_replication_slots sizes (pg_to_stream slots use "
            "that setting too). Raise max_replication_slots in postgresql.conf and restart Postgres, "
            "or drop the origins of mappings no longer run (SELECT pg_replication_origin_drop(name) "
            f"FROM pg_replication_origin WHERE roname LIKE 'streamkeep_sync_%'; after checking). ({error})"
        ) from error
    conn.execute("SELECT pg_replication_origin_session_reset()")
    conn.commit()


def apply(
    conn: psycopg.Connection,
    names: Names,
    mapping_stream: str,
    before: Stored,
    next_offset: str,
    write: Callable[[psycopg.Cursor[Any]], Outcome],
) -> Outcome:
    """Applies one batch and moves the stored offset from `before` to `next_offset`; what the
    write returned (misfits are dead-lettered here: `write` raises when there is no table)."""
    set_up = False
    try:
        with conn.cursor() as cur:
            # Marks the transaction as the sink's, so the source direction skips it (no echo).
            # Session state in Postgres, so it is reset below whatever happens.
            try:
                cur.execute("SELECT pg_replication_origin_session_setup(%s)", (names.origin,))
            except errors.ObjectInUse as error:  # Postgres 15: one session per origin
                raise offsets.Fenced(
                    f"another session uses replication origin {names.origin} (a second sink process on "
                    f"mapping {names.mapping}?): {error}"
                ) from error
            set_up = True
            offsets.advance(cur, names, before, Stored(next_offset, before.version + 1, before.in_snapshot))
            if before.clear_pending and names.dead_letter is not None:
                # Applied again from the beginning (reset, a state-mode resync): what it sets aside
                # is set aside again, so the old rows would be twice.
                cur.execute(
                    sql.SQL("DELETE FROM {} WHERE mapping = %s").format(names.dead_letter), (names.mapping,)
                )
            outcome = write(cur)
            if outcome.in_snapshot != before.in_snapshot:
                offsets.mark_snapshot(cur, names, outcome.in_snapshot)
            if outcome.misfits:
                _dead_letter(cur, names, mapping_stream, outcome.misfits)
            crash_point("sink.before_commit")
        conn.commit()
    except BaseException:
        if not conn.closed:
            conn.rollback()
        raise
    finally:
        if set_up and not conn.closed and not conn.broken:
            conn.execute("SELECT pg_replication_origin_session_reset()")
            conn.commit()
    crash_point("sink.after_commit")
    return outcome


def _dead_letter(cur: psycopg.Cursor[Any], names: Names, stream: str, misfits: list[Misfit]) -> None:
    assert names.dead_letter is not None  # the bridge stops on a misfit without one
    cur.executemany(
        sql.SQL(
            "INSERT INTO {} (mapping, stream, stream_offset, message_index, message, error) VALUES (%s, %s, %s, %s, %s, %s)"
        ).format(names.dead_letter),
        [(names.mapping, stream, m.offset, m.index, Json(_as_json(m.message)), m.error) for m in misfits],
    )


def _as_json(message: Any) -> Any:
    """A message as the dead-letter table's json column holds it: a byte stream's as base64."""
    if isinstance(message, bytes):
        return {"base64": base64.b64encode(message).decode()}
    return message
