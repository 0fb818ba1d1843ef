"""The SQL names one `[[stream_to_pg]]` mapping uses, quoted once here so no other module builds
SQL from text: its table, its offsets table, its snapshot staging table, its dead-letter table and
its replication origin."""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql

from streamkeep.sync.config import StreamToPg

SCHEMA = "streamkeep_sync"
# Postgres 15 lets one session at a time use a replication origin, so each mapping has its own
# (one shared origin would serialize every mapping's commits). The source skips every transaction
# whose origin is `streamkeep_sync` or starts with `streamkeep_sync_` (no echo).
ORIGIN_PREFIX = "streamkeep_sync_"


def qualified(name: str) -> sql.Identifier:
    """`schema.table` (config.py made every name qualified and unquoted) as a quoted identifier."""
    schema, _, table = name.partition(".")
    return sql.Identifier(schema, table)


@dataclass(frozen=True)
class Names:
    mapping: str
    table: sql.Identifier
    table_schema: sql.Identifier
    offsets: sql.Identifier
    offsets_schema: sql.Identifier
    staging: sql.Identifier  # state mode: a snapshot in progress, swapped in at snapshot-end
    dead_letter: sql.Identifier | None
    dead_letter_schema: sql.Identifier | None
    origin: str

    @classmethod
    def of(cls, mapping: StreamToPg) -> Names:
        dead = mapping.dead_letter
        return cls(
            mapping=mapping.name,
            table=qualified(mapping.table),
            table_schema=sql.Identifier(mapping.table.partition(".")[0]),
            offsets=qualified(mapping.offsets_table),
            offsets_schema=sql.Identifier(mapping.offsets_table.partition(".")[0]),
            staging=sql.Identifier(SCHEMA, f"{mapping.name}_snapshot"),
            dead_letter=qualified(dead) if dead else None,
            dead_letter_schema=sql.Identifier(dead.partition(".")[0]) if dead else None,
            origin=ORIGIN_PREFIX + mapping.name,
        )
