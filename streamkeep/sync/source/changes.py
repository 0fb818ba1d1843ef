"""pgoutput row changes as State Protocol change messages (pure: the Relation messages seen so far
and the tables' primary keys in, message dicts out).

A Relation message precedes the first change of a table on each connection and again after its
definition changed (ALTER TABLE ... ADD COLUMN): the new columns simply flow into `value`. A primary
key that no longer matches the one checked at start stops the mapping (its keys would change
meaning); so does a renamed table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamkeep.sync.source import encode
from streamkeep.sync.source.catalog import TableInfo
from streamkeep.sync.source.pgoutput import UNCHANGED, Delete, Insert, Relation, Truncate, Update, Value
from streamkeep.sync.stats import MappingStopped


def reset_hint(mapping: str) -> str:
    return (
        f"run `streamkeep sync reset {mapping}` (drops the slot and checkpoint; the next start re-snapshots)"
    )


@dataclass(frozen=True)
class _Shape:
    """What encoding a row of one relation needs, worked out once per Relation message."""

    relation: Relation
    table: str
    names: tuple[str, ...]
    converters: tuple[Callable[[str], Any], ...]
    key_at: tuple[int, ...]


class Transaction:
    """The messages of one transaction, built as its changes arrive: messages of one operation
    share one headers dict, whose `lsn` is filled in at Commit."""

    __slots__ = ("commit_time", "headers", "messages", "skip", "xid")

    def __init__(self, xid: int, commit_time: int) -> None:
        self.xid = xid
        self.commit_time = commit_time
        self.skip = False  # the sink's own write (its replication origin): never echoed
        self.messages: list[dict[str, Any]] = []
        self.headers: dict[str, dict[str, str]] = {}

    def headers_for(self, operation: str) -> dict[str, str]:
        found = self.headers.get(operation)
        if found is None:
            found = self.headers[operation] = encode.headers(operation, self.xid)
        return found

    def committed(self, lsn: str) -> None:
        for headers in self.headers.values():
            headers["lsn"] = lsn


class Changes:
    def __init__(self, mapping: str, tables: dict[str, TableInfo]) -> None:
        self.mapping = mapping
        self.tables = tables
        self.shapes: dict[int, _Shape] = {}

    def relation_needs_catalog(self, relation: Relation) -> bool:
        """Whether the key must be checked against the catalog: with REPLICA IDENTITY FULL (or an
        index) the Relation message's key flags are not the primary key."""
        return relation.replica_identity != "d"

    def add_relation(self, relation: Relation, catalog_key: tuple[str, ...] | None = None) -> None:
        """Records a Relation message; `catalog_key` is the table's primary key now (when
        `relation_needs_catalog`)."""
        table = self.tables.get(relation.qualified)
        if table is None:
            raise MappingStopped(
                f"mapping {self.mapping}: a change arrived for table {relation.qualified}, which is not in "
                f"`tables` (renamed?); {reset_hint(self.mapping)}"
            )
        names = tuple(c.name for c in relation.columns)
        if relation.replica_identity == "d":
            changed = {c.name for c in relation.columns if c.key} != set(table.primary_key)
        else:
            changed = catalog_key != table.primary_key
        if changed or not all(k in names for k in table.primary_key):
            raise MappingStopped(
                f"mapping {self.mapping}: the primary key of {table.name} changed (was "
                f"{', '.join(table.primary_key)}); {reset_hint(self.mapping)}"
            )
        self.shapes[relation.relation_id] = _Shape(
            relation,
            table.name,
            names,
            tuple(encode.converter(c.type_oid) for c in relation.columns),
            tuple(names.index(k) for k in table.primary_key),
        )

    def _shape(self, relation_id: int) -> _Shape:
        shape = self.shapes.get(relation_id)
        if shape is None:
            raise ValueError(f"a change for relation {relation_id} before its Relation message")
        return shape

    def _row(
        self, shape: _Shape, values: tuple[Value, ...], old: tuple[Value, ...] | None, update: bool = False
    ) -> dict[str, Any]:
        # Only an UPDATE's new row can hold unchanged TOASTed values (an identity test: `in` would
        # compare every value with ==, a sixth of a drain's time).
        if update and any(v is UNCHANGED for v in values):
            values = self._fill_unchanged(shape, values, old)
        return {
            name: None if value is None else convert(value)  # type: ignore[arg-type]
            for name, convert, value in zip(shape.names, shape.converters, values, strict=False)
        }

    def _fill_unchanged(
        self, shape: _Shape, values: tuple[Value, ...], old: tuple[Value, ...] | None
    ) -> tuple[Value, ...]:
        # Only REPLICA IDENTITY FULL gives the old row whole ('O'), checked at start; a table
        # switched back since then is a person's problem.
        filled = list(values)
        for index, value in enumerate(values):
            if value is UNCHANGED:
                if old is None or old[index] is UNCHANGED:
                    table = shape.table
                    raise MappingStopped(
                        f"mapping {self.mapping}: an UPDATE of {table} left TOASTed column {shape.names[index]} "
                        f"unchanged and its value was not sent; run `ALTER TABLE {table} REPLICA IDENTITY "
                        f"FULL`, then {reset_hint(self.mapping)}"
                    )
                filled[index] = old[index]
        return tuple(filled)

    @staticmethod
    def _key(shape: _Shape, values: tuple[Value, ...]) -> str:
        if len(shape.key_at) == 1:
            value = values[shape.key_at[0]]
            if isinstance(value, str):
                return value
        return encode.key_text([v if isinstance(v := values[i], str) else None for i in shape.key_at])

    def add(self, change: Insert | Update | Delete | Truncate, transaction: Transaction) -> None:
        """Appends the change's messages to the transaction's."""
        out = transaction.messages
        if isinstance(change, Insert):
            shape = self._shape(change.relation_id)
            out.append(
                {
                    "type": shape.table,
                    "key": self._key(shape, change.new),
                    "value": self._row(shape, change.new, None),
                    "headers": transaction.headers_for("insert"),
                }
            )
        elif isinstance(change, Update):
            shape = self._shape(change.relation_id)
            key = self._key(shape, change.new)
            value = self._row(shape, change.new, change.old, update=True)
            old_key = None if change.old is None else self._key(shape, change.old)
            if old_key is not None and old_key != key:
                # The row's key changed: under its old key it is gone, under its new one it is new.
                out.append(
                    {"type": shape.table, "key": old_key, "headers": transaction.headers_for("delete")}
                )
                out.append(
                    {
                        "type": shape.table,
                        "key": key,
                        "value": value,
                        "headers": transaction.headers_for("insert"),
                    }
                )
            else:
                out.append(
                    {
                        "type": shape.table,
                        "key": key,
                        "value": value,
                        "headers": transaction.headers_for("update"),
                    }
                )
        elif isinstance(change, Delete):
            shape = self._shape(change.relation_id)
            out.append(
                {
                    "type": shape.table,
                    "key": self._key(shape, change.old),
                    "headers": transaction.headers_for("delete"),
                }
            )
        else:
            names = sorted({self.shapes[r].table for r in change.relation_ids if r in self.shapes})
            if set(names) == set(self.tables):
                # Every table of the mapping emptied: exactly what `reset` tells a reader.
                out.append(encode.control("reset"))
                return
            raise MappingStopped(
                f"mapping {self.mapping}: TRUNCATE of {', '.join(names)} (not of every table in the mapping) "
                f"has no State Protocol form; {reset_hint(self.mapping)}"
            )
