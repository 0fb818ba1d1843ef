"""Segment record format, version 1 (docs/segment-format.md). Bytes in, bytes out; no I/O.

A segment file is a header record followed by append records. Every record is

    magic "SK" | version u8 | kind u8 | header_len u32le | payload_len u32le | crc32 u32le
    | CBOR header (header_len bytes) | payload (payload_len bytes)

with the CRC-32 (zlib) over the first 12 bytes, the CBOR header and the payload. One append (its
messages, producer state and close flag) is one record, written with one write: after a crash it is
either whole and valid or detected as torn.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import cbor2

MAGIC = b"SK"
VERSION = 1
KIND_SEGMENT = 0  # first record of every file: which stream, where the segment starts
KIND_APPEND = 1
FIXED = struct.Struct("<2sBBIII")
FIXED_SIZE = FIXED.size  # 16
MAX_HEADER = 1 << 20


class CorruptRecord(Exception):
    pass


@dataclass(frozen=True)
class Record:
    kind: int
    header: dict
    file_offset: int  # where the record starts in the file
    payload_offset: int  # where its payload starts in the file
    payload_len: int
    payload: bytes | None  # None when scanned without payloads

    @property
    def end(self) -> int:
        return self.payload_offset + self.payload_len

    # ---- fields of append records ----
    @property
    def start(self) -> int:
        return self.header["s"]

    @property
    def time_ms(self) -> int:
        return self.header["t"]

    @property
    def message_lengths(self) -> list[int]:
        return self.header.get("n") or ([self.payload_len] if self.payload_len else [])

    @property
    def producer(self) -> tuple[str, int, int] | None:
        if "pi" not in self.header:
            return None
        return self.header["pi"], self.header["pe"], self.header["ps"]

    @property
    def closes(self) -> bool:
        return bool(self.header.get("c"))

    @property
    def stream_seq(self) -> str | None:
        return self.header.get("q")


def _frame(kind: int, header: dict, payload: bytes) -> bytes:
    header_bytes = cbor2.dumps(header)
    prefix = struct.pack("<2sBBII", MAGIC, VERSION, kind, len(header_bytes), len(payload))
    crc = zlib.crc32(payload, zlib.crc32(header_bytes, zlib.crc32(prefix)))
    return prefix + struct.pack("<I", crc) + header_bytes + payload


def encode_segment_header(name: str, start: int, content_type: str, stream_id: str) -> bytes:
    return _frame(KIND_SEGMENT, {"name": name, "s": start, "ct": content_type, "id": stream_id}, b"")


def append_header(
    start: int,
    time_ms: int,
    message_lengths: list[int],
    *,
    producer: tuple[str, int, int] | None = None,
    closes: bool = False,
    stream_seq: str | None = None,
) -> dict:
    header: dict = {"s": start, "t": time_ms}
    if len(message_lengths) > 1:
        header["n"] = message_lengths
    if producer is not None:
        header["pi"], header["pe"], header["ps"] = producer
    if closes:
        header["c"] = True
    if stream_seq is not None:
        header["q"] = stream_seq
    return header


def frame_append(header: dict, payload: bytes) -> bytes:
    return _frame(KIND_APPEND, header, payload)


def encode_append(
    start: int,
    time_ms: int,
    messages: list[bytes],
    *,
    producer: tuple[str, int, int] | None = None,
    closes: bool = False,
    stream_seq: str | None = None,
) -> bytes:
    header = append_header(
        start, time_ms, [len(m) for m in messages], producer=producer, closes=closes, stream_seq=stream_seq
    )
    return frame_append(header, b"".join(messages))


def decode_at(buf: bytes | memoryview, offset: int, *, keep_payload: bool = True) -> Record:
    """The record starting at `offset`; raises CorruptRecord if it is torn or damaged."""
    if len(buf) - offset < FIXED_SIZE:
        raise CorruptRecord("truncated record prefix")
    magic, version, kind, header_len, payload_len, crc = FIXED.unpack_from(buf, offset)
    if magic != MAGIC:
        raise CorruptRecord("bad magic")
    if version != VERSION:
        raise CorruptRecord(f"unknown record version {version}")
    if header_len > MAX_HEADER:
        raise CorruptRecord("header length out of range")
    header_at = offset + FIXED_SIZE
    payload_at = header_at + header_len
    end = payload_at + payload_len
    if end > len(buf):
        raise CorruptRecord("truncated record")
    view = memoryview(buf)
    check = zlib.crc32(view[offset : offset + 12])
    check = zlib.crc32(view[header_at:end], check)
    if check != crc:
        raise CorruptRecord("checksum mismatch")
    try:
        header = cbor2.loads(bytes(view[header_at:payload_at]))
    except Exception as error:  # cbor2 raises several types on garbage
        raise CorruptRecord(f"bad CBOR header: {error}") from None
    if not isinstance(header, dict):
        raise CorruptRecord("header is not a map")
    payload = bytes(view[payload_at:end]) if keep_payload else None
    return Record(kind, header, offset, payload_at, payload_len, payload)


def scan(buf: bytes | memoryview, *, keep_payload: bool = False) -> tuple[list[Record], int, str | None]:
    """Every valid record from the start of a segment file's bytes.

    Returns the records, the length of the valid prefix, and why scanning stopped early (None if
    the whole buffer was valid). A torn tail shows up as a reason with a valid prefix before it.
    """
    records: list[Record] = []
    offset = 0
    while offset < len(buf):
        try:
            record = decode_at(buf, offset, keep_payload=keep_payload)
        except CorruptRecord as error:
            return records, offset, f"{error} at byte {offset}"
        records.append(record)
        offset = record.end
    return records, offset, None


def iter_messages(record: Record) -> Iterator[tuple[int, bytes]]:
    """(position, message bytes) of each message of an append record with its payload."""
    assert record.payload is not None
    position, cut = record.start, 0
    for length in record.message_lengths:
        yield position, record.payload[cut : cut + length]
        position += length
        cut += length
