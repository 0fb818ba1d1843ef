"""Parsing of the protocol's request headers into typed values, with the spec's 400s."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

from streamkeep.protocol.errors import bad_request
from streamkeep.protocol.model import Headers

MAX_SAFE_INTEGER = (1 << 53) - 1
DECIMAL = re.compile(r"0|[1-9][0-9]*")
_DIGITS = re.compile(r"[0-9]+")
_MEDIA_TYPE = re.compile(r"[A-Za-z0-9!#$&^_.+-]+/[A-Za-z0-9!#$&^_.+-]+")
DEFAULT_CONTENT_TYPE = "application/octet-stream"
MAX_TTL_SECONDS = 10 * 365 * 24 * 3600
# Hop-by-hop fields (RFC 9110 §7.6.1): never in an HTTP/2 response, never passed on by a proxy.
HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"))


def closed_flag(headers: Headers) -> bool:
    """`Stream-Closed` counts only when it is exactly `true`, in any case (§4.1)."""
    value = headers.get("stream-closed")
    return value is not None and value.strip().lower() == "true"


@lru_cache(maxsize=256)  # asked several times per append, of a few distinct values
def media_type(content_type: str) -> str:
    """`Text/Plain; charset=utf-8` -> `text/plain`: what stream content types are compared by."""
    return content_type.split(";", 1)[0].strip().lower()


def is_json(content_type: str) -> bool:
    return media_type(content_type) == "application/json"


def is_text(content_type: str) -> bool:
    kind = media_type(content_type)
    return kind.startswith("text/") or kind == "application/json"


def content_type_for_create(headers: Headers) -> str:
    value = headers.get("content-type")
    if value is None or not value.strip():
        return DEFAULT_CONTENT_TYPE
    value = value.strip()
    if not _MEDIA_TYPE.fullmatch(media_type(value)):
        raise bad_request("invalid_content_type", f"Content-Type {value[:100]!r} is not a media type")
    return value


# Content types that passed the check: appends repeat a handful of them (bounded like names).
_VALID_CONTENT_TYPES: set[str] = set()


def content_type_for_append(headers: Headers) -> str | None:
    value = headers.get("content-type")
    if value is None:
        return None
    if value in _VALID_CONTENT_TYPES:
        return value
    if not value.strip():
        return None
    if not _MEDIA_TYPE.fullmatch(media_type(value)):
        raise bad_request("invalid_content_type", f"Content-Type {value[:100]!r} is not a media type")
    if value == value.strip() and len(value) <= 200:
        if len(_VALID_CONTENT_TYPES) >= 1024:
            _VALID_CONTENT_TYPES.clear()
        _VALID_CONTENT_TYPES.add(value)
    return value.strip()


def ttl_seconds(headers: Headers) -> int | None:
    value = headers.get("stream-ttl")
    if value is None:
        return None
    if not DECIMAL.fullmatch(value):
        raise bad_request(
            "invalid_ttl",
            "Stream-TTL must be a whole number of seconds without sign, leading zeros or decimals",
        )
    seconds = int(value)
    if seconds > MAX_TTL_SECONDS:
        raise bad_request("invalid_ttl", f"Stream-TTL may be at most {MAX_TTL_SECONDS} seconds")
    return seconds


def expires_at(headers: Headers) -> tuple[str, float] | None:
    """The header as given (echoed back on HEAD) and its POSIX time."""
    value = headers.get("stream-expires-at")
    if value is None:
        return None
    text = value.strip()
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        parsed = None
    if parsed is None or parsed.tzinfo is None or "T" not in text.upper():
        raise bad_request(
            "invalid_expires_at",
            "Stream-Expires-At must be an RFC 3339 time with a zone, e.g. 2030-01-01T00:00:00Z",
        )
    return text, parsed.timestamp()


@dataclass(frozen=True)
class ProducerHeaders:
    producer_id: str
    epoch: int
    seq: int


def producer(headers: Headers) -> ProducerHeaders | None:
    producer_id = headers.get("producer-id")
    epoch = headers.get("producer-epoch")
    seq = headers.get("producer-seq")
    if producer_id is None and epoch is None and seq is None:
        return None
    if producer_id is None or epoch is None or seq is None:
        raise bad_request(
            "incomplete_producer",
            "Producer-Id, Producer-Epoch and Producer-Seq must be sent together",
        )
    if producer_id == "":
        raise bad_request("invalid_producer_id", "Producer-Id must not be empty")
    return ProducerHeaders(
        producer_id, _safe_integer("Producer-Epoch", epoch), _safe_integer("Producer-Seq", seq)
    )


def _safe_integer(name: str, value: str) -> int:
    if not _DIGITS.fullmatch(value) or len(value) > 16 or int(value) > MAX_SAFE_INTEGER:
        raise bad_request(
            "invalid_producer_header", f"{name} must be a non-negative integer no larger than 2^53-1"
        )
    return int(value)
