"""HPACK for our responses: repeated headers encoded once per connection, per-response values kept
out of the dynamic table.

A streamkeep response carries the same handful of headers every time (CORS, the sandbox, content
types) and one or two values that change with every append (`Stream-Next-Offset`, `ETag`). With
hpack's defaults each changing value was Huffman-coded and inserted into the connection's dynamic
table, so every ~50 responses the constant headers were evicted and encoded again, Huffman and
all: ~24 us of an append's ~245 us over h2c (docs/benchmarks.md). Here:

- a header already in the table is encoded by hpack once; its index bytes are kept and reused
  until the table changes (an insertion or a size change clears them);
- values that change per response are sent as literals that are never indexed, so they do not
  churn the table, and without Huffman coding, which costs more CPU than the few bytes it saves.

The encoding itself stays hpack's: this only decides what it is asked to do and remembers answers.
"""

from __future__ import annotations

from typing import Any

import hpack

# Response headers whose values change from one response to the next.
PER_RESPONSE = frozenset(
    (
        b"stream-next-offset",
        b"etag",
        b"content-length",
        b"stream-cursor",
        b"stream-earliest-offset",
        b"location",
        b"producer-epoch",
        b"producer-seq",
        b"producer-expected-seq",
        b"producer-received-seq",
        b"last-modified",
        b"date",
    )
)
_MAX_REMEMBERED = 256


class ResponseEncoder(hpack.Encoder):
    def __init__(self) -> None:
        super().__init__()
        self._indexed: dict[tuple[bytes, bytes], bytes] = {}
        self._table_size = self.header_table.maxsize

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        table = self.header_table
        if table.resized or table.maxsize != self._table_size:
            self._indexed.clear()
            self._table_size = table.maxsize
        return super().encode(headers, huffman=False)

    def add(self, to_add: tuple[bytes, bytes], sensitive: bool, huffman: bool = False) -> bytes:
        remembered = self._indexed.get(to_add)
        if remembered is not None:
            return remembered
        if to_add[0] in PER_RESPONSE:
            return super().add(to_add, True, False)
        entries = self.header_table.dynamic_entries
        first = entries[0] if entries else None
        encoded = super().add(to_add, sensitive, huffman)
        if (entries[0] if entries else None) is not first:
            self._indexed.clear()  # an insertion (and maybe evictions) moved every index
        elif encoded[0] & 0x80 and len(self._indexed) < _MAX_REMEMBERED:
            self._indexed[to_add] = encoded  # an indexed field: the same bytes until the table moves
        return encoded
