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


@dataclass(slots=True)
class Begin:
    final_lsn: int  # the commit record's LSN
    commit_time: int  # Postgres micros
    xid: int


@dataclass(slots=True)
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


@dataclass(slots=True)
class Insert:
    relation_id: int
    new: tuple[Value, ...]


@dataclass(slots=True)
class Update:
    relation_id: int
    old: tuple[Value, ...] | None  # the old key ('K') or whole old row ('O'), when sent
    new: tuple[Value, ...]


@dataclass(slots=True)
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


_BEGIN = struct.Struct("!QqI")
_COMMIT = struct.Struct("!xQQq")  # flags (unused), commit LSN, end LSN, commit time
_RELATION_ID = struct.Struct("!Ic")
_COUNT = struct.Struct("!h")
_SIZE = struct.Struct("!I")


def _tuple_at(data: bytes, at: int) -> tuple[tuple[Value, ...], int]:
    """TupleData at `at`, and where it ends: the hot path of a drain, so no reader object."""
    try:
        (count,) = _COUNT.unpack_from(data, at)
        at += 2
        values: list[Value] = []
        for _ in range(count):
            kind = data[at]
            at += 1
            if kind == 0x74:  # 't': text
                (size,) = _SIZE.unpack_from(data, at)
                at += 4
                if at + size > len(data):
                    raise DecodeError("a value ends past the message")
                values.append(data[at : at + size].decode("utf-8"))
                at += size
            elif kind == 0x6E:  # 'n': NULL
                values.append(None)
            elif kind == 0x75:  # 'u': unchanged TOASTed value
                values.append(UNCHANGED)
            else:  # 'b' comes only with the `binary` option, which we never ask for
                raise DecodeError(f"unexpected tuple value kind {chr(kind)!r}")
    except (struct.error, IndexError) as error:
        raise DecodeError(f"tuple data ends early: {error}") from None
    return tuple(values), at


def decode(data: bytes, at: int = 0) -> Message:
    """One pgoutput message: `data` from `at` (an XLogData's payload starts at 25, decoded in
    place: a drain handles three messages per one-row transaction, so no copy and no reader)."""
    kind = data[at]
    try:
        if kind == 0x49:  # 'I'
            relation_id, marker = _RELATION_ID.unpack_from(data, at + 1)
            if marker != b"N":
                raise DecodeError("insert without a new tuple")
            return Insert(relation_id, _tuple_at(data, at + 6)[0])
        if kind == 0x42:  # 'B'
            final_lsn, commit_time, xid = _BEGIN.unpack_from(data, at + 1)
            return Begin(final_lsn, commit_time, xid)
        if kind == 0x43:  # 'C'
            commit_lsn, end_lsn, commit_time = _COMMIT.unpack_from(data, at + 1)
            return Commit(commit_lsn, end_lsn, commit_time)
        if kind == 0x55:  # 'U'
            relation_id, marker = _RELATION_ID.unpack_from(data, at + 1)
            at += 6
            old = None
            if marker in (b"K", b"O"):
                old, at = _tuple_at(data, at)
                marker = data[at : at + 1]
                at += 1
            if marker != b"N":
                raise DecodeError("update without a new tuple")
            return Update(relation_id, old, _tuple_at(data, at)[0])
        if kind == 0x44:  # 'D'
            relation_id, marker = _RELATION_ID.unpack_from(data, at + 1)
            if marker not in (b"K", b"O"):
                raise DecodeError("delete without an old key or row")
            return Delete(relation_id, _tuple_at(data, at + 6)[0])
    except struct.error as error:
        raise DecodeError(f"message ends early: {error}") from None
    return _decode_rare(bytes(data[at:]))


def _decode_rare(data: bytes) -> Message:
    r = _Reader(data)
    kind = r.byte()
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


@dataclass(slots=True)
class XLogData:
    start: int
    wal_end: int
    payload: bytes


@dataclass(slots=True)
class Keepalive:
    wal_end: int
    reply_requested: bool


XLOG_DATA = 0x77  # 'w': start LSN, WAL end, send time, then one pgoutput message (from byte 25)
KEEPALIVE = 0x6B  # 'k': WAL end, send time, reply requested
XLOG_PAYLOAD = 25
_WAL_END = struct.Struct("!Q")
_KEEPALIVE = struct.Struct("!QqB")


def wal_end(data: bytes) -> int:
    """An XLogData's WAL end (the server's position when it sent it)."""
    return int(_WAL_END.unpack_from(data, 9)[0])


def decode_copy(data: bytes) -> XLogData | Keepalive:
    kind = data[0]
    if kind == XLOG_DATA:
        start, end, _sent = struct.unpack_from("!QQq", data, 1)
        return XLogData(start, end, bytes(data[XLOG_PAYLOAD:]))
    if kind == KEEPALIVE:
        end, _sent, reply = _KEEPALIVE.unpack_from(data, 1)
        return Keepalive(end, bool(reply))
    raise DecodeError(f"unknown replication message {chr(kind)!r}")


def standby_status(written: int, flushed: int, now_micros: int, reply: bool = False) -> bytes:
    """'r': what we have received (`written`) and made durable (`flushed` = applied): the slot's
    confirmed_flush_lsn moves to `flushed`."""
    return b"r" + struct.pack("!QQQqB", written, flushed, flushed, now_micros, 1 if reply else 0)
