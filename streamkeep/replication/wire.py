"""The replication channel's frames: bytes in, operations out, no socket (h11's shape).

The owner sends operations on paths relative to the data directory, in the order it made them;
the follower answers each `SYNC n` with `n` once everything before it is applied and durable.
A frame is a 5-byte header (operation, body length) and its body; paths are length-prefixed.
The handshake before the frames is one JSON line each way (`hello` and the owner's answer).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

WRITE = 1  # path, offset, bytes
TRUNCATE = 2  # path, length
RENAME = 3  # source, target
UNLINK = 4  # path
MKDIR = 5  # path
RMDIR = 6  # path
CREATE = 7  # path, flags: open(O_CREAT [| O_TRUNC], mode); see create_flags
SYNC = 8  # barrier number: answer it once everything before is durable

NAMES = {WRITE: "write", TRUNCATE: "truncate", RENAME: "rename", UNLINK: "unlink", MKDIR: "mkdir",
         RMDIR: "rmdir", CREATE: "create", SYNC: "sync"}  # fmt: skip

_HEADER = struct.Struct("!BI")
_U64 = struct.Struct("!Q")
_PATH_LEN = struct.Struct("!H")
ACK = _U64  # follower -> owner: the highest barrier applied and durable
MAX_FRAME = 64 << 20


class ProtocolError(Exception):
    """The peer sent something that is not a frame of this protocol."""


@dataclass(frozen=True)
class Op:
    code: int
    path: str = ""
    target: str = ""
    number: int = 0  # offset, length, barrier number or the truncate flag
    data: bytes = b""


def create_flags(truncate: bool, mode: int) -> int:
    """A CREATE's number: bit 0 truncates, the bits above are the file's permission bits."""
    return int(truncate) | (mode & 0o7777) << 1


def parse_create(number: int) -> tuple[bool, int]:
    return bool(number & 1), (number >> 1) & 0o7777 or 0o644


def _path(path: str) -> bytes:
    raw = path.encode("utf-8", "surrogateescape")
    return _PATH_LEN.pack(len(raw)) + raw


def encode(op: Op) -> bytes:
    if op.code == WRITE:
        body = _path(op.path) + _U64.pack(op.number) + op.data
    elif op.code in (TRUNCATE, CREATE):
        body = _path(op.path) + _U64.pack(op.number)
    elif op.code == RENAME:
        body = _path(op.path) + _path(op.target)
    elif op.code in (UNLINK, MKDIR, RMDIR):
        body = _path(op.path)
    elif op.code == SYNC:
        body = _U64.pack(op.number)
    else:
        raise ValueError(f"unknown operation {op.code}")
    return _HEADER.pack(op.code, len(body)) + body


def write(path: str, offset: int, data: bytes | memoryview) -> bytes:
    """A WRITE frame without copying `data` twice (the hot path)."""
    head = _path(path) + _U64.pack(offset)
    return _HEADER.pack(WRITE, len(head) + len(data)) + head + bytes(data)


def _read_path(body: memoryview, at: int) -> tuple[str, int]:
    (length,) = _PATH_LEN.unpack_from(body, at)
    at += _PATH_LEN.size
    raw = bytes(body[at : at + length])
    if len(raw) != length:
        raise ProtocolError("a path runs past its frame")
    return raw.decode("utf-8", "surrogateescape"), at + length


def decode_body(code: int, body: memoryview) -> Op:
    try:
        if code == WRITE:
            path, at = _read_path(body, 0)
            (offset,) = _U64.unpack_from(body, at)
            return Op(code, path, number=offset, data=bytes(body[at + _U64.size :]))
        if code in (TRUNCATE, CREATE):
            path, at = _read_path(body, 0)
            return Op(code, path, number=_U64.unpack_from(body, at)[0])
        if code == RENAME:
            source, at = _read_path(body, 0)
            target, _ = _read_path(body, at)
            return Op(code, source, target)
        if code in (UNLINK, MKDIR, RMDIR):
            return Op(code, _read_path(body, 0)[0])
        if code == SYNC:
            return Op(code, number=_U64.unpack_from(body, 0)[0])
    except struct.error as error:
        raise ProtocolError(f"a {NAMES.get(code, code)} frame is cut short") from error
    raise ProtocolError(f"unknown operation {code}")


class Decoder:
    """Bytes in (as they arrive, in any pieces), operations out."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Op]:
        self._buffer += data
        ops: list[Op] = []
        view = memoryview(self._buffer)
        at = 0
        try:
            while len(view) - at >= _HEADER.size:
                code, length = _HEADER.unpack_from(view, at)
                if length > MAX_FRAME:
                    raise ProtocolError(f"a frame of {length} bytes is over the limit")
                end = at + _HEADER.size + length
                if end > len(view):
                    break
                ops.append(decode_body(code, view[at + _HEADER.size : end]))
                at = end
        finally:
            view.release()
        del self._buffer[:at]
        return ops


def hello(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, separators=(",", ":")).encode() + b"\n"


def read_line(recv: Any, limit: int = 4096) -> dict[str, Any]:
    """One JSON line from a blocking `recv(n)`, byte by byte (the handshake is tiny and must not
    swallow the frames after it)."""
    line = bytearray()
    while not line.endswith(b"\n"):
        chunk = recv(1)
        if not chunk:
            raise ProtocolError("the peer closed the connection during the handshake")
        line += chunk
        if len(line) > limit:
            raise ProtocolError("the handshake line is too long")
    try:
        value = json.loads(line)
    except ValueError as error:
        raise ProtocolError(f"the handshake is not JSON: {error}") from error
    if not isinstance(value, dict):
        raise ProtocolError("the handshake is not a JSON object")
    return value
