"""pgoutput row changes as State Protocol change messages (pure: the Relation messages seen so far
and the tables' primary keys in, message dicts out).

A Relation message precedes the first change of a table on each connection and again after its
definition changed (ALTER TABLE ... ADD COLUMN): the new columns simply flow into `value`. A primary
key that no longer matches the one checked at start stops the mapping (its keys would change
meaning); so does a renamed table."""

from __future__ import annotations

from typing import Any

from streamkeep.sync.source import encode
from streamkeep.sync.source.catalog import TableInfo
from streamkeep.sync.source.pgoutput import UNCHANGED, Delete, Insert, Relation, Truncate, Update, Value
from streamkeep.sync.stats import MappingStopped


def reset_hint(mapping: str) -> str:
    return (
        f"run `streamkeep sync reset {mapping}` (drops the slot and checkpoint; the next start re-snapshots)"
    )


class Changes:
    def __init__(self, mapping: str, tables: dict[str, TableInfo]) -> None:
        self.mapping = mapping
        self.tables = tables
        self.relations: dict[int, Relation] = {}

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
        names = [c.name for c in relation.columns]
        if relation.replica_identity == "d":
            key = {c.name for c in relation.columns if c.key}
            changed = key != set(table.primary_key)
        else:
            changed = catalog_key != table.primary_key
        if changed or not all(k in names for k in table.primary_key):
            raise MappingStopped(
                f"mapping {self.mapping}: the primary key of {table.name} changed (was {', '.join(table.primary_key)}); "
                f"{reset_hint(self.mapping)}"
            )
        self.relations[relation.relation_id] = relation

    def _relation(self, relation_id: int) -> tuple[Relation, TableInfo]:
        relation = self.relations.get(relation_id)
        if relation is None:
            raise ValueError(f"a change for relation {relation_id} before its Relation message")
        return relation, self.tables[relation.qualified]

    def _row(
        self, relation: Relation, values: tuple[Value, ...], old: tuple[Value, ...] | None
    ) -> dict[str, Any]:
        row: dict[str, Any] = {}
        for index, column in enumerate(relation.columns):
            value = values[index]
            if value is UNCHANGED:
                # Only REPLICA IDENTITY FULL gives the old row whole ('O'), checked at start; a table
                # switched back since then is a person's problem.
                if old is None or old[index] is UNCHANGED:
                    raise MappingStopped(
                        f"mapping {self.mapping}: an UPDATE of {relation.qualified} left TOASTed column "
                        f"{column.name} unchanged and its value was not sent; run "
                        f"`ALTER TABLE {relation.qualified} REPLICA IDENTITY FULL`, then {reset_hint(self.mapping)}"
                    )
                value = old[index]
            assert value is None or isinstance(value, str)
            row[column.name] = encode.to_json(column.type_oid, value)
        return row

    def _key(self, relation: Relation, table: TableInfo, values: tuple[Value, ...]) -> str:
        names = [c.name for c in relation.columns]
        parts: list[str | None] = []
        for name in table.primary_key:
            value = values[names.index(name)]
            parts.append(None if value is UNCHANGED else value)  # type: ignore[arg-type]
        return encode.key_text(parts)

    def messages(self, change: Insert | Update | Delete | Truncate, txid: int) -> list[dict[str, Any]]:
        """The change's messages, their `lsn` header left empty (the commit's, filled at Commit)."""
        if isinstance(change, Truncate):
            names = sorted({self.relations[r].qualified for r in change.relation_ids if r in self.relations})
            if set(names) == set(self.tables):
                # Every table of the mapping emptied: exactly what `reset` tells a reader.
                return [encode.control("reset")]
            raise MappingStopped(
                f"mapping {self.mapping}: TRUNCATE of {', '.join(names)} (not of every table in the mapping) "
                f"has no State Protocol form; {reset_hint(self.mapping)}"
            )
        relation, table = self._relation(change.relation_id)
        if isinstance(change, Insert):
            key = self._key(relation, table, change.new)
            return [encode.change(table.name, key, "insert", self._row(relation, change.new, None), txid, "")]
        if isinstance(change, Update):
            key = self._key(relation, table, change.new)
            value = self._row(relation, change.new, change.old)
            if change.old is not None:
                old_key = self._key(relation, table, change.old)
                if old_key != key:
                    # The row's key changed: under its old key it is gone, under its new one it is new.
                    return [
                        encode.change(table.name, old_key, "delete", None, txid, ""),
                        encode.change(table.name, key, "insert", value, txid, ""),
                    ]
            return [encode.change(table.name, key, "update", value, txid, "")]
        key = self._key(relation, table, change.old)
        return [encode.change(table.name, key, "delete", None, txid, "")]


def set_lsn(messages: list[dict[str, Any]], lsn: str) -> None:
    for message in messages:
        headers = message["headers"]
        if "operation" in headers:
            headers["lsn"] = lsn
