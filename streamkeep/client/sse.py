"""Server-Sent Events as the protocol uses them (PROTOCOL.md §5.8): `data` and `control` events.

Pure parsing, no I/O: `SseParser.feed(bytes)` gives the complete events so far, so the reader can
feed it whatever chunks the connection delivers (a line, or an event, may be split anywhere,
even inside a UTF-8 character). Line endings may be CRLF, LF or CR, as the SSE format allows.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
import re
from dataclasses import dataclass
from typing import Any

from streamkeep.client.errors import ProtocolError

_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class SseEvent:
    """One dispatched event: its type (`message` when it named none) and its data lines joined
    with `\\n`."""

    event: str
    data: str


@dataclass(frozen=True)
class Control:
    """A `control` event: where to resume, and the stream's state at that point."""

    next_offset: str
    cursor: str | None
    up_to_date: bool
    closed: bool


class SseParser:
    """Incremental parser of an event stream's bytes."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # text after the last complete line
        self._after_cr = False  # the last chunk ended in CR: a following LF belongs to it
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[SseEvent]:
        text = self._decoder.decode(chunk)
        if not text:
            return []
        if self._after_cr and text.startswith("\n"):
            text = text[1:]  # the LF of a CRLF split between two chunks
        self._after_cr = text.endswith("\r")
        buffer = self._pending + text
        events: list[SseEvent] = []
        start = 0
        # Only CR, LF and CRLF end lines (str.splitlines would also split at U+2028 and others,
        # which JSON text may hold).
        for match in _LINE_END.finditer(buffer):
            event = self._line(buffer[start : match.start()])
            if event is not None:
                events.append(event)
            start = match.end()
        self._pending = buffer[start:]
        return events

    def _line(self, line: str) -> SseEvent | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None  # a comment (keep-alive)
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None  # id and retry mean nothing to this protocol

    def _dispatch(self) -> SseEvent | None:
        event, data = self._event, self._data
        self._event, self._data = "", []
        if not data:
            return None  # the SSE format drops an event without data
        return SseEvent(event or "message", "\n".join(data))


def parse_control(data: str) -> Control:
    """A control event's JSON. Its offset is what resuming depends on, so a malformed one is an
    error, never skipped."""
    try:
        fields = json.loads(data)
    except ValueError as exc:
        raise ProtocolError(f"malformed SSE control event: {data[:200]!r}") from exc
    if not isinstance(fields, dict) or not isinstance(fields.get("streamNextOffset"), str):
        raise ProtocolError(f"SSE control event without streamNextOffset: {data[:200]!r}")
    closed = fields.get("streamClosed") is True
    cursor = fields.get("streamCursor")
    return Control(
        next_offset=fields["streamNextOffset"],
        cursor=cursor if isinstance(cursor, str) else None,
        # §5.8: streamClosed implies upToDate.
        up_to_date=fields.get("upToDate") is True or closed,
        closed=closed,
    )


def decode_data(data: str, *, base64_mode: bool) -> bytes:
    """A `data` event's payload as bytes: base64-decoded when the answer said
    `stream-sse-data-encoding: base64` (line breaks between the data lines removed first, §5.8)."""
    if not base64_mode:
        return data.encode("utf-8")
    compact = data.replace("\n", "").replace("\r", "")
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError(f"SSE data event is not valid base64: {compact[:100]!r}") from exc


def json_messages(data: str) -> list[Any]:
    """A JSON stream's `data` event as messages: servers send a JSON array of them, flattened
    one level like a catch-up body (§5.8, §9.1)."""
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise ProtocolError(f"SSE data event of a JSON stream is not JSON: {data[:200]!r}") from exc
    return value if isinstance(value, list) else [value]


__all__ = ["Control", "SseEvent", "SseParser", "decode_data", "json_messages", "parse_control"]
