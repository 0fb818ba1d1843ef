"""The pgoutput logical replication protocol, version 1: bytes in, messages out, no socket.

Also the replication sub-protocol's framing around it (XLogData 'w', primary keepalive 'k', the
standby status update 'r' we send back) and LSN text. Formats: Postgres docs, "Logical Replication
Message Formats" and "Streaming Replication Protocol"."""

from __future__ import annotations

import struct
from dataclasses import dataclass

# Postgres timestamps count microseconds from 2000-01-01 UTC.
POSTGRES_EPOCH_UNIX = 946684800


def lsn_text(lsn: int) -> str:
    """An LSN as Postgres writes it (`0/16B3748`)."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def lsn_parse(text: str) -> int:
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


def unix_time(postgres_micros: int) -> float:
    return POSTGRES_EPOCH_UNIX + postgres_micros / 1_000_000


class DecodeError(ValueError):
    """Bytes that are not pgoutput version 1 (a bug here, or a protocol we did not ask for)."""


# A column value of a tuple: None (NULL), UNCHANGED (a TOASTed value the update did not touch, not
# sent), or the value's text representation.
class _Unchanged:
    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED = _Unchanged()
Value = str | None | _Unchanged


@dataclass(frozen=True)
class Column:
    name: str
    type_oid: int
    type_modifier: int
    key: bool  # part of the replica identity (every column with REPLICA IDENTITY FULL)


@dataclass(frozen=True)
class Begin:
    final_lsn: int  # the commit record's LSN
    commit_time: int  # Postgres micros
    xid: int


@dataclass(frozen=True)
class Commit:
    commit_lsn: int
    end_lsn: int  # the end of the commit record: what a transaction is identified and confirmed by
    commit_time: int


@dataclass(frozen=True)
class Origin:
    lsn: int
    name: str


@dataclass(frozen=True)
class Relation:
    relation_id: int
    namespace: str
    name: str
    replica_identity: str  # 'd' default, 'n' nothing, 'f' full, 'i' index
    columns: tuple[Column, ...]

    @property
    def qualified(self) -> str:
        return f"{self.namespace}.{self.name}"


@dataclass(frozen=True)
class TypeInfo:
    type_oid: int
    namespace: str
    name: str


@dataclass(frozen=True)
class Insert:
    relation_id: int
    new: tuple[Value, ...]


@dataclass(frozen=True)
class Update:
    relation_id: int
    old: tuple[Value, ...] | None  # the old key ('K') or whole old row ('O'), when sent
    new: tuple[Value, ...]


@dataclass(frozen=True)
class Delete:
    relation_id: int
    old: tuple[Value, ...]  # the key ('K') or the whole row ('O', REPLICA IDENTITY FULL)


@dataclass(frozen=True)
class Truncate:
    relation_ids: tuple[int, ...]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True)
class LogicalMessage:
    """pg_logical_emit_message (sent only with the `messages` option; decoded to be skipped)."""

    transactional: bool
    lsn: int
    prefix: str
    content: bytes


Message = Begin | Commit | Origin | Relation | TypeInfo | Insert | Update | Delete | Truncate | LogicalMessage


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise DecodeError(f"message ends early (wanted {size} bytes at {self.at} of {len(self.data)})")
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return int(value)

    def byte(self) -> str:
        return chr(self.take("!B"))

    def string(self) -> str:
        end = self.data.find(b"\0", self.at)
        if end < 0:
            raise DecodeError("unterminated string")
        text = self.data[self.at : end].decode("utf-8")
        self.at = end + 1
        return text

    def raw(self, size: int) -> bytes:
        if self.at + size > len(self.data):
            raise DecodeError("value ends early")
        chunk = self.data[self.at : self.at + size]
        self.at += size
        return chunk

    def tuple_data(self) -> tuple[Value, ...]:
        count = self.take("!h")
        values: list[Value] = []
        for _ in range(count):
            kind = self.byte()
            if kind == "n":
                values.append(None)
            elif kind == "u":
                values.append(UNCHANGED)
            elif kind == "t":
                values.append(self.raw(self.take("!i")).decode("utf-8"))
            else:  # 'b' comes only with the `binary` option, which we never ask for
                raise DecodeError(f"unexpected tuple value kind {kind!r}")
        return tuple(values)


def decode(data: bytes) -> Message:
    """One pgoutput message (the payload of an XLogData)."""
    r = _Reader(bytes(data))
    kind = r.byte()
    if kind == "B":
        return Begin(final_lsn=r.take("!Q"), commit_time=r.take("!q"), xid=r.take("!I"))
    if kind == "C":
        r.take("!B")  # flags, unused
        return Commit(commit_lsn=r.take("!Q"), end_lsn=r.take("!Q"), commit_time=r.take("!q"))
    if kind == "O":
        return Origin(lsn=r.take("!Q"), name=r.string())
    if kind == "R":
        relation_id = r.take("!I")
        namespace, name = r.string(), r.string()
        identity = r.byte()
        columns = []
        for _ in range(r.take("!h")):
            flags = r.take("!B")
            columns.append(
                Column(
                    name=r.string(), type_oid=r.take("!I"), type_modifier=r.take("!i"), key=bool(flags & 1)
                )
            )
        return Relation(relation_id, namespace or "pg_catalog", name, identity, tuple(columns))
    if kind == "Y":
        return TypeInfo(type_oid=r.take("!I"), namespace=r.string(), name=r.string())
    if kind == "I":
        relation_id = r.take("!I")
        if r.byte() != "N":
            raise DecodeError("insert without a new tuple")
        return Insert(relation_id, r.tuple_data())
    if kind == "U":
        relation_id = r.take("!I")
        marker = r.byte()
        old = None
        if marker in ("K", "O"):
            old = r.tuple_data()
            marker = r.byte()
        if marker != "N":
            raise DecodeError("update without a new tuple")
        return Update(relation_id, old, r.tuple_data())
    if kind == "D":
        relation_id = r.take("!I")
        if r.byte() not in ("K", "O"):
            raise DecodeError("delete without an old key or row")
        return Delete(relation_id, r.tuple_data())
    if kind == "T":
        count = r.take("!I")
        options = r.take("!B")
        ids = tuple(r.take("!I") for _ in range(count))
        return Truncate(ids, cascade=bool(options & 1), restart_identity=bool(options & 2))
    if kind == "M":
        transactional = bool(r.take("!B"))
        lsn = r.take("!Q")
        prefix = r.string()
        return LogicalMessage(transactional, lsn, prefix, r.raw(r.take("!I")))
    raise DecodeError(f"unknown pgoutput message {kind!r}")


# The replication sub-protocol (inside CopyBoth).


@dataclass(frozen=True)
class XLogData:
    start: int
    wal_end: int
    payload: bytes


@dataclass(frozen=True)
class Keepalive:
    wal_end: int
    reply_requested: bool


def decode_copy(data: bytes) -> XLogData | Keepalive:
    kind = data[:1]
    if kind == b"w":
        start, wal_end, _sent = struct.unpack_from("!QQq", data, 1)
        return XLogData(start, wal_end, bytes(data[25:]))
    if kind == b"k":
        wal_end, _sent, reply = struct.unpack_from("!QqB", data, 1)
        return Keepalive(wal_end, bool(reply))
    raise DecodeError(f"unknown replication message {kind!r}")


def standby_status(written: int, flushed: int, now_micros: int, reply: bool = False) -> bytes:
    """'r': what we have received (`written`) and made durable (`flushed` = applied): the slot's
    confirmed_flush_lsn moves to `flushed`."""
    return b"r" + struct.pack("!QQQqB", written, flushed, flushed, now_micros, 1 if reply else 0)
