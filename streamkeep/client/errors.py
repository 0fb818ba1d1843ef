"""Typed errors for every refusal a Durable Streams server can give.

A caller decides what to do from the class (resume from `StreamGone.earliest_offset`, bump an epoch
on `StaleEpoch`, wait on `Unavailable`), never by parsing a message. `error_for` is the one place an
HTTP answer becomes an exception, so the reader, the stream handle and the producer agree on it.
"""

from __future__ import annotations

import datetime
import email.utils
import json
import time
from collections.abc import Mapping
from typing import Any


class StreamError(Exception):
    """A refusal (or, with `status` 0, a failure to reach the server at all).

    `code` is the server's stable name for the cause when its body says one (streamkeep sends
    `{"error": {"code", "message"}}`); `headers` are the answer's, lower-cased names.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 0,
        body: bytes = b"",
        url: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.body = body
        self.url = url
        self.code = code
        self.headers: dict[str, str] = {k.lower(): v for k, v in (headers or {}).items()}

    def __str__(self) -> str:
        where = f" ({self.url})" if self.url else ""
        return f"{self.status} {self.message}{where}" if self.status else f"{self.message}{where}"


class BadRequest(StreamError):
    """400: the request was malformed (a bad offset, header or body); repeating it cannot help."""


class Unauthorized(StreamError):
    """401 or 403 from the server's auth: no valid credential, or one without the scope."""


class StreamNotFound(StreamError):
    """404: no stream at that URL (or the fork source does not exist)."""


class StreamGone(StreamError):
    """410: the stream was deleted while forks still read it, or the offset asked for was
    dropped by retention; `earliest_offset` (when the server says it) is where reading can resume."""

    def __init__(self, message: str, *, earliest_offset: str | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.earliest_offset = earliest_offset


class Conflict(StreamError):
    """409 not covered by a subclass: a content type that differs from the stream's, or a
    `Stream-Seq` regression."""


class StreamExists(Conflict):
    """409 on create: a stream is already there with another configuration."""


class StreamClosed(Conflict):
    """409 on append: the stream is closed; `final_offset` is its tail, when the server says it."""

    def __init__(self, message: str, *, final_offset: str | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.final_offset = final_offset


class SequenceConflict(Conflict):
    """409 for an idempotent producer: a gap in its sequence numbers (`expected_seq` is the one
    the server waits for, `received_seq` the one it got)."""

    def __init__(
        self, message: str, *, expected_seq: int | None = None, received_seq: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)
        self.expected_seq = expected_seq
        self.received_seq = received_seq


class StaleEpoch(StreamError):
    """403 for an idempotent producer: a newer epoch owns the producer id (zombie fencing);
    `current_epoch` is the server's."""

    def __init__(self, message: str, *, current_epoch: int | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.current_epoch = current_epoch


class PayloadTooLarge(StreamError):
    """413: the body is over the server's limit; split it."""


class Unavailable(StreamError):
    """429 or 503 still refused after the retries: `retry_after` is the server's wait in seconds."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class ProtocolError(StreamError):
    """An answer the client cannot read (status 0): a malformed SSE control event, base64 that
    does not decode, a JSON stream's body that is not JSON. Reconnecting cannot help."""


class ConnectionFailed(StreamError):
    """The server could not be reached, or the connection broke, after the retries (status 0)."""


def retry_after_seconds(value: str | None, *, now: float | None = None) -> float | None:
    """`Retry-After` as seconds: delta-seconds or an HTTP date (RFC 9110 §10.2.3); None if absent
    or unreadable."""
    if value is None:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        # asctime dates (and `-0000`) carry no zone; RFC 9110 §5.6.7 says HTTP dates are UTC.
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _int_header(headers: Mapping[str, str], name: str) -> int | None:
    value = headers.get(name)
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None


def _code_and_message(body: bytes, status: int) -> tuple[str | None, str]:
    """The server's `{"error": {"code", "message"}}` when it sent one, else the body's text."""
    try:
        parsed = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        parsed = None
    if isinstance(parsed, dict):
        inner = parsed.get("error")
        if isinstance(inner, dict):
            code = inner.get("code")
            message = inner.get("message")
            return (code if isinstance(code, str) else None), (
                message if isinstance(message, str) else f"HTTP {status}"
            )
        if isinstance(inner, str):
            return None, inner
    text = body.decode("utf-8", errors="replace").strip()[:500]
    return None, text or f"HTTP {status}"


def error_for(
    status: int, headers: Mapping[str, str], body: bytes = b"", *, method: str = "GET", url: str | None = None
) -> StreamError:
    """The typed error for a refusal. `headers` may use any case; `method` tells a create's 409
    (`StreamExists`) from an append's."""
    lower = {k.lower(): v for k, v in headers.items()}
    code, message = _code_and_message(body, status)
    common: dict[str, Any] = {"status": status, "body": body, "url": url, "code": code, "headers": lower}
    closed = lower.get("stream-closed", "").strip().lower() == "true"
    if status == 400:
        return BadRequest(message, **common)
    if status == 401:
        return Unauthorized(message, **common)
    if status == 403:
        epoch = _int_header(lower, "producer-epoch")
        if epoch is not None:
            return StaleEpoch(message, current_epoch=epoch, **common)
        return Unauthorized(message, **common)
    if status == 404:
        return StreamNotFound(message, **common)
    if status == 409:
        if closed:
            return StreamClosed(message, final_offset=lower.get("stream-next-offset"), **common)
        expected = _int_header(lower, "producer-expected-seq")
        if expected is not None:
            received = _int_header(lower, "producer-received-seq")
            return SequenceConflict(message, expected_seq=expected, received_seq=received, **common)
        if method.upper() == "PUT":
            return StreamExists(message, **common)
        return Conflict(message, **common)
    if status == 410:
        return StreamGone(message, earliest_offset=lower.get("stream-earliest-offset"), **common)
    if status == 413:
        return PayloadTooLarge(message, **common)
    if status in (429, 503):
        return Unavailable(message, retry_after=retry_after_seconds(lower.get("retry-after")), **common)
    return StreamError(message, **common)


__all__ = [
    "BadRequest",
    "Conflict",
    "ConnectionFailed",
    "PayloadTooLarge",
    "ProtocolError",
    "SequenceConflict",
    "StaleEpoch",
    "StreamClosed",
    "StreamError",
    "StreamExists",
    "StreamGone",
    "StreamNotFound",
    "Unauthorized",
    "Unavailable",
    "error_for",
    "retry_after_seconds",
]
