"""JSON mode (§9.1): message boundaries, one level of array flattening, validation, rendering."""

from __future__ import annotations

import json
import math

from streamkeep.protocol.errors import bad_request


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    # 1e400 is JSON by its grammar, but a message is stored re-encoded, and a float that overflows
    # has no JSON form: refused as the client's error (400), never a failed encode (500).
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


_decoder = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite)
_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
_ascii_encoder = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=False)


def encode_message(value: object) -> bytes:
    """A message's stored bytes. A string with a lone surrogate escape ("\\ud800" alone) is JSON by
    its grammar but has no UTF-8 form: such a message is stored with its non-ASCII characters
    escaped, which reads back as the same value (never a failed encode, a 500)."""
    text = _encoder.encode(value)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return _ascii_encoder.encode(value).encode()


def split_messages(body: bytes, *, allow_empty_array: bool) -> list[bytes]:
    """The messages one request body stores: each element of a top-level array, else the value."""
    try:
        text = body.decode("utf-8")
        value = _decoder.decode(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise bad_request("invalid_json", f"body is not valid JSON: {error}") from None
    if isinstance(value, list):
        if not value and not allow_empty_array:
            raise bad_request(
                "empty_json_array", "an empty JSON array appends nothing; send at least one message"
            )
        return [encode_message(item) for item in value]
    return [encode_message(value)]


def render_array(messages: list[bytes]) -> bytes:
    return b"[" + b",".join(messages) + b"]"
