"""State mode: State Protocol messages (seed 001) folded into a `(type, key) -> value` table.

A transaction's messages are first planned in Python (`plan`): checked, and folded so each key is
written once per run of changes (the last change wins, as applying them one by one would), with
control messages cutting the runs. The plan is then written (`write`) with one COPY into a
temporary table and one INSERT ... ON CONFLICT and one DELETE per run.

Snapshots: between `snapshot-start` and `snapshot-end` changes go to a staging table (it may take
many transactions, and a crash in between resumes it: `in_snapshot` is stored with the offset);
`snapshot-end` replaces the table's contents with the staging table's in the transaction that
applies it, so a reader of the table never sees half a snapshot and the table follows compaction.
`reset` empties the table (and any snapshot being staged); its `offset` header is not used, the
stream goes on after it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg
from psycopg import sql

from streamkeep.sync.sink.batch import Misfit, Part, dumps
from streamkeep.sync.sink.names import Names
from streamkeep.sync.sink.tables import ROWS

Target = Literal["table", "staging"]
OPERATIONS = ("insert", "update", "delete")
CONTROLS = ("snapshot-start", "snapshot-end", "reset")


@dataclass
class Write:
    target: Target
    rows: dict[tuple[str, str], str | None] = field(default_factory=dict)  # None: deleted


@dataclass(frozen=True)
class Clear:
    target: Target


@dataclass(frozen=True)
class Swap:
    """snapshot-end: the table becomes the staging table's contents."""


Step = Write | Clear | Swap


@dataclass
class Plan:
    steps: list[Step]
    in_snapshot: bool
    misfits: list[Misfit]
    applied: int  # messages applied (misfits excluded)


def _check_change(message: dict[str, Any], operation: Any) -> tuple[str, str, str | None]:
    """(type, key, value as JSON text or None for a delete); ValueError says what is wrong."""
    if operation not in OPERATIONS:
        raise ValueError(f"headers.operation {operation!r} is not insert, update or delete")
    kind = message.get("type")
    key = message.get("key")
    if not isinstance(kind, str) or not kind:
        raise ValueError("`type` is missing or not a non-empty string")
    if not isinstance(key, str) or not key:
        raise ValueError("`key` is missing or not a non-empty string")
    if operation == "delete":
        return kind, key, None
    if "value" not in message:
        raise ValueError(f"an {operation} without `value`")
    return kind, key, dumps(message["value"])


def plan(parts: list[Part], in_snapshot: bool, clear_first: bool) -> Plan:
    steps: list[Step] = []
    misfits: list[Misfit] = []
    applied = 0
    if clear_first:  # after reset or a resync: the table starts over in this transaction
        steps += [Clear("table"), Clear("staging")]
        in_snapshot = False
    current = Write("staging" if in_snapshot else "table")
    for part in parts:
        for index, message in enumerate(part.messages or ()):
            try:
                if not isinstance(message, dict):
                    raise ValueError("not a JSON object")
                headers = message.get("headers")
                if not isinstance(headers, dict):
                    raise ValueError("`headers` is missing or not an object")
                operation = headers.get("operation")
                if operation is None and "control" in headers:
                    control = headers["control"]
                    if control not in CONTROLS:
                        raise ValueError(f"headers.control {control!r} is not one of {', '.join(CONTROLS)}")
                else:
                    kind, key, value = _check_change(message, operation)
                    current.rows[(kind, key)] = value
                    applied += 1
                    continue
            except ValueError as error:
                misfits.append(Misfit(part.offset, index, message, str(error)))
                continue
            applied += 1
            if current.rows:
                steps.append(current)
            if control == "reset":
                steps += [Clear("table"), Clear("staging")]
                in_snapshot = False
            elif control == "snapshot-start":
                # A second start without an end (the writer began its snapshot again): start over.
                steps.append(Clear("staging"))
                in_snapshot = True
            elif in_snapshot:  # snapshot-end; one without a start changes nothing
                steps += [Swap(), Clear("staging")]
                in_snapshot = False
            current = Write("staging" if in_snapshot else "table")
    if current.rows:
        steps.append(current)
    return Plan(steps, in_snapshot, misfits, applied)


def write(cur: psycopg.Cursor[Any], names: Names, plan: Plan) -> None:
    tables = {"table": names.table, "staging": names.staging}
    for number, step in enumerate(plan.steps):
        if isinstance(step, Clear):
            cur.execute(sql.SQL("DELETE FROM {}").format(tables[step.target]))
        elif isinstance(step, Swap):
            cur.execute(sql.SQL("DELETE FROM {}").format(names.table))
            cur.execute(
                sql.SQL("INSERT INTO {} (type, key, value) SELECT type, key, value FROM {}").format(
                    names.table, names.staging
                )
            )
        else:
            _write_rows(cur, tables[step.target], step, more=number + 1 < len(plan.steps))


def _write_rows(cur: psycopg.Cursor[Any], table: sql.Identifier, step: Write, *, more: bool) -> None:
    deletes = False
    with cur.copy(sql.SQL("COPY {} (type, key, value, deleted) FROM STDIN").format(ROWS)) as copy:
        for (kind, key), value in step.rows.items():
            copy.write_row((kind, key, value, value is None))
            deletes = deletes or value is None
    cur.execute(
        sql.SQL(
            """INSERT INTO {} (type, key, value) SELECT type, key, value FROM {} WHERE NOT deleted
               ON CONFLICT (type, key) DO UPDATE SET value = EXCLUDED.value"""
        ).format(table, ROWS)
    )
    if deletes:
        cur.execute(
            sql.SQL(
                "DELETE FROM {} t USING {} r WHERE r.deleted AND t.type = r.type AND t.key = r.key"
            ).format(table, ROWS)
        )
    if more:  # the temporary table empties itself at commit; within the transaction, by hand
        cur.execute(sql.SQL("DELETE FROM {}").format(ROWS))
