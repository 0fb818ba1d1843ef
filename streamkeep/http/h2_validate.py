"""The checks RFC 9113 §8.2-8.3 asks of a request's header block, done with regular expressions.

h2 makes the same checks with a Python loop over every byte of every header (~15 us of an append's
~245 us over h2c, docs/benchmarks.md), so the lean edge turns h2's inbound validation off and
runs these instead, on request header blocks. A malformed request is a stream error: its stream
is reset with PROTOCOL_ERROR and the connection goes on (h2's own check ended the connection).
"""

from __future__ import annotations

import re

# Field names: no controls, space, upper case, DEL or non-ASCII; a colon only as the pseudo sigil.
_NAME = re.compile(rb"[^\x00-\x20A-Z\x7f-\xff:]+")
# Field values: no NUL, CR or LF anywhere, no space or tab at either end.
_BAD_VALUE = re.compile(rb"[\x00\r\n]|\A[ \t]|[ \t]\Z")
_PSEUDO = frozenset((b":method", b":scheme", b":path", b":authority", b":protocol"))
# Connection-specific fields have no meaning in HTTP/2 (§8.2.2).
_CONNECTION_SPECIFIC = frozenset(
    (b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding", b"upgrade")
)


def malformed(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why a request header block is malformed, or None if it is well formed."""
    pseudo: dict[bytes, bytes] = {}
    regular = False
    host = None
    for name, value in headers:
        if name[:1] == b":":
            if regular:
                return f"pseudo-header {name[:40]!r} after a regular header"
            if name not in _PSEUDO:
                return f"unknown pseudo-header {name[:40]!r}"
            if name in pseudo:
                return f"repeated pseudo-header {name[:40]!r}"
            pseudo[name] = value
        else:
            regular = True
            if not _NAME.fullmatch(name):
                return f"malformed header name {name[:40]!r}"
            if name in _CONNECTION_SPECIFIC:
                return f"connection-specific header {name[:40]!r}"
            if name == b"te" and value.lower() != b"trailers":
                return "TE other than trailers"
            if name == b"host":
                host = value
        if value and _BAD_VALUE.search(value):
            return f"malformed value of {name[:40]!r}"
    method = pseudo.get(b":method")
    if method is None:
        return "no :method"
    if method == b"CONNECT" and b":protocol" not in pseudo:
        if b":scheme" in pseudo or b":path" in pseudo:
            return "CONNECT with :scheme or :path"
    elif not pseudo.get(b":path") or b":scheme" not in pseudo:
        return "no :scheme or :path"
    authority = pseudo.get(b":authority")
    if authority is not None and host is not None and authority != host:
        return ":authority and host disagree"
    return None
