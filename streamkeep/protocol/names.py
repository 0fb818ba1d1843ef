"""Stream names: what may follow `/v1/stream/` in a URL.

Names may be hierarchical (`a/b/c`) but can never climb out of a directory once they become file
names: no empty, `.` or `..` segments, no control characters or backslashes, bounded length.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from streamkeep.protocol.errors import ProtocolError, bad_request

STREAM_PREFIX = "/v1/stream/"
# The stream the server keeps its list of streams in (streamkeep/registry/): no client writes it.
REGISTRY_STREAM = "__registry__"
RESERVED_SEGMENT = "__ds"
# The subscriptions' control API (PROTOCOL.md §6) lives under the reserved segment.
CONTROL_PREFIX = f"{STREAM_PREFIX}{RESERVED_SEGMENT}/"
# The wake endpoints (POST .../subscriptions/<id>/<action>) and the token kind each takes: they are
# called with the subscription's own wake tokens, never the server's JWTs (auth/gate.py lets them
# through; the subscriptions' wake protocol checks their tokens).
WAKE_ACTIONS = {"callback": "callback", "ack": "claim", "release": "claim"}
# Calls between cluster members (cluster/peers.py); never reachable through the front door.
CLUSTER_PREFIX = "/_cluster/"
MAX_NAME_BYTES = 1024
MAX_SEGMENT_BYTES = 255
_BROKEN_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f\\]")  # control characters and the backslash


# Paths seen recently and their names: every request parses its path, and a stream's requests
# repeat it (~3 us of an append, with the checks below). Bounded in entries and path length, and
# emptied when full, so random names cannot grow it; only valid names are kept.
_PARSED: dict[str, str] = {}
_PARSED_MAX_ENTRIES = 4096
_PARSED_MAX_PATH = 256


def parse_stream_name(raw_path: str) -> str:
    """The stream name of a raw (still percent-encoded) request path under STREAM_PREFIX."""
    name = _PARSED.get(raw_path)
    if name is None:
        name = _parse_stream_name(raw_path)
        if len(raw_path) <= _PARSED_MAX_PATH:
            if len(_PARSED) >= _PARSED_MAX_ENTRIES:
                _PARSED.clear()
            _PARSED[raw_path] = name
    return name


def _parse_stream_name(raw_path: str) -> str:
    encoded = raw_path[len(STREAM_PREFIX) :]
    if _BROKEN_ESCAPE.search(encoded):
        raise bad_request("invalid_stream_name", "stream name has a '%' that is not a %XX escape")
    try:
        name = unquote(encoded, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise bad_request("invalid_stream_name", "stream name is not valid UTF-8") from None
    check_stream_name(name)
    return name


def check_stream_name(name: str) -> None:
    if not name:
        raise bad_request("invalid_stream_name", "stream name is empty")
    size = len(name) if name.isascii() else len(name.encode())
    if size > MAX_NAME_BYTES:
        raise bad_request("invalid_stream_name", f"stream name is longer than {MAX_NAME_BYTES} bytes")
    if _FORBIDDEN.search(name):
        raise bad_request("invalid_stream_name", "stream name contains a control character or backslash")
    # A name that is short, has no dot and no empty segment needs no look at each segment: every
    # create's name is new, so not in `_PARSED`, and the loop below cost it ~1.5 us (issue 26).
    if size > MAX_SEGMENT_BYTES or "." in name or "//" in name or name[0] == "/" or name[-1] == "/":
        for segment in name.split("/"):
            if segment in ("", ".", ".."):
                raise bad_request(
                    "invalid_stream_name",
                    "stream name has an empty, '.' or '..' segment; use names like 'a/b/c'",
                )
            if len(segment.encode()) > MAX_SEGMENT_BYTES:
                raise bad_request(
                    "invalid_stream_name",
                    f"a stream name segment is longer than {MAX_SEGMENT_BYTES} bytes",
                )
    if name.partition("/")[0] == RESERVED_SEGMENT:
        raise ProtocolError(
            404, "reserved_path", f"paths under {STREAM_PREFIX}{RESERVED_SEGMENT}/ are reserved"
        )
