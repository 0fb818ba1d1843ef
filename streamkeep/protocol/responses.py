"""Responses of the protocol: status, headers (ETag, caching, cursors) and bodies, from snapshots."""

from __future__ import annotations

import json
from collections.abc import Iterable

from streamkeep.protocol import jsonmode
from streamkeep.protocol.cursor import response_cursor
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.headers import is_text
from streamkeep.protocol.model import Response
from streamkeep.protocol.offsets import Offset, encode
from streamkeep.protocol.stream import StreamMeta

NO_STORE = "no-store"
JSON = "application/json"
# On every response but the stream browser's own files: a document the browser renders from a
# stream (text/html, image/svg+xml opened directly) gets an opaque origin and runs no script, so
# it can reach neither the UI's token nor the API as the UI's origin. fetch() ignores it.
SANDBOX = ("Content-Security-Policy", "sandbox")
CORS_ALLOW_METHODS = "GET, POST, PUT, DELETE, HEAD, OPTIONS"
CORS_ALLOW_HEADERS = (
    "Content-Type, Authorization, If-None-Match, Stream-Seq, Stream-TTL, Stream-Expires-At, "
    "Stream-Closed, Producer-Id, Producer-Epoch, Producer-Seq, Stream-Forked-From, "
    "Stream-Fork-Offset, Stream-Fork-Sub-Offset, Last-Event-ID"
)


def preflight() -> Response:
    return Response(
        204,
        [
            ("Access-Control-Allow-Methods", CORS_ALLOW_METHODS),
            ("Access-Control-Allow-Headers", CORS_ALLOW_HEADERS),
            ("Access-Control-Max-Age", "86400"),
        ],
    )


def json_response(status: int, body: object, headers: Iterable[tuple[str, str]] = ()) -> Response:
    """A JSON answer about the server's own state (stats, probes, subscriptions): never cached."""
    return Response(
        status,
        [("Content-Type", JSON), ("Cache-Control", NO_STORE), *headers],
        json.dumps(body).encode(),
    )


def error(err: ProtocolError, **fields: object) -> Response:
    """Every refusal's body: `{"error": {"code", "message", ...fields}}`, with the error's headers."""
    body = json.dumps({"error": {"code": err.code, "message": err.message, **fields}}).encode()
    return Response(err.status, [("Content-Type", JSON), *err.headers], body)


def etag(meta: StreamMeta, start: Offset | str, end: int, closed_at_end: bool, floor: int = 0) -> str:
    start_token = start if isinstance(start, str) else encode(start.position, meta.incarnation)
    if start == "-1" and floor:
        # From -1 a read starts at the floor: once retention moves it, the same tail is other bytes.
        start_token = f"-1@{encode(floor, meta.incarnation)}"
    suffix = ":c" if closed_at_end else ""
    return f'"{meta.stream_id}:{start_token}:{encode(end, meta.incarnation)}{suffix}"'


def if_none_match_hits(header: str | None, tag: str) -> bool:
    if not header:
        return False
    return any(candidate.strip() in (tag, f"W/{tag}", "*") for candidate in header.split(","))


def stream_headers(meta: StreamMeta, tail: int) -> list[tuple[str, str]]:
    out = [("Content-Type", meta.content_type), ("Stream-Next-Offset", encode(tail, meta.incarnation))]
    if meta.closed:
        out.append(("Stream-Closed", "true"))
    return out


def created(status: int, meta: StreamMeta, tail: int, location: str) -> Response:
    headers = stream_headers(meta, tail)
    if status == 201:
        headers.append(("Location", location))
    return Response(status, headers)


def head(meta: StreamMeta, tail: int, floor: int = 0) -> Response:
    headers = stream_headers(meta, tail)
    # The earliest offset a reader can start from (retention moves it up; PROTOCOL.md lets a
    # server drop old data). Its name is ours; clients that do not know it ignore it.
    headers.append(("Stream-Earliest-Offset", encode(floor, meta.incarnation)))
    headers.append(("Cache-Control", NO_STORE))
    headers.append(("ETag", etag(meta, "-1", tail, meta.closed, floor)))
    if meta.ttl_seconds is not None:
        headers.append(("Stream-TTL", str(meta.ttl_seconds)))
    if meta.expires_at is not None:
        headers.append(("Stream-Expires-At", meta.expires_at))
    return Response(200, headers)


def body_for(meta: StreamMeta, messages: list[bytes]) -> bytes:
    if meta.json_mode:
        return jsonmode.render_array(messages)
    return b"".join(messages)


def sse_uses_base64(meta: StreamMeta) -> bool:
    return not is_text(meta.content_type)


__all__ = [
    "NO_STORE",
    "body_for",
    "created",
    "error",
    "etag",
    "head",
    "if_none_match_hits",
    "json_response",
    "preflight",
    "response_cursor",
    "sse_uses_base64",
    "stream_headers",
]
