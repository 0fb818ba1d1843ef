"""The initial copy: the mapping's tables read in the slot's exported snapshot, so the copy plus
the slot's changes from its consistent point are every committed row exactly once.

Columns are read as the text of the type's output function, exactly what pgoutput sends (not
`column::text`: a cast may differ, `true::text` is 'true' where boolout gives 't'), so a snapshot
row and a streamed row of the same values encode to the same JSON. Rows come in key order, a chunk at a
time through a server-side cursor (a table larger than memory is fine). Blocking: the caller
runs each step in a worker thread."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.string import TextLoader

from streamkeep.sync.source import catalog, encode
from streamkeep.sync.source.catalog import TableInfo


class SnapshotReader:
    def __init__(self, dsn: str, snapshot_name: str) -> None:
        self.conn: psycopg.Connection[tuple[object, ...]] = psycopg.connect(dsn, autocommit=False)
        self.conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        self.conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name)))

    def close(self) -> None:
        self.conn.close()

    def rows(self, table: TableInfo, chunk: int, lsn: str) -> Iterator[list[dict[str, Any]]]:
        """The table's rows as insert messages, `chunk` at a time."""
        columns = catalog.column_types(self.conn, table.name)
        names = [name for name, _ in columns]
        key_at = [names.index(k) for k in table.primary_key]
        query = sql.SQL("SELECT {} FROM {} ORDER BY {}").format(
            sql.SQL(", ").join(sql.Identifier(n) for n in names),
            sql.Identifier(*table.name.split(".")),
            sql.SQL(", ").join(sql.Identifier(k) for k in table.primary_key),
        )
        with self.conn.cursor(name=f"snapshot_{abs(hash(table.name))}") as cursor:
            cursor.itersize = chunk
            for _, oid in columns:
                cursor.adapters.register_loader(oid, TextLoader)  # the server's text, not Python values
            cursor.execute(query)
            while True:
                fetched = cursor.fetchmany(chunk)
                if not fetched:
                    return
                out = []
                for row in fetched:
                    texts = [None if v is None else str(v) for v in row]
                    value = {name: encode.to_json(oid, texts[i]) for i, (name, oid) in enumerate(columns)}
                    key = encode.key_text([texts[i] for i in key_at])
                    out.append(encode.change(table.name, key, "insert", value, None, lsn))
                yield out
