"""HTTP/1.1 responses as bytes: the status line, the header lines and the body framing. Pure: no
socket here, the connection (h1_connection.py) writes what these return."""

from __future__ import annotations

from streamkeep.http.reasons import reason
from streamkeep.protocol.model import Response

# Header lines repeat across responses (CORS, content types, cache rules): encode each once.
_line_cache: dict[tuple[str, str], bytes] = {}
_STATUS_LINES: dict[int, bytes] = {}


def _header_line(name: str, value: str) -> bytes:
    key = (name, value)
    line = _line_cache.get(key)
    if line is None:
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        line = f"{name}: {value}\r\n".encode("latin-1")
        if len(_line_cache) < 4096:
            _line_cache[key] = line
    return line


def encode_head(response: Response, extra: bytes) -> bytes:
    """The status line and header lines of `response`, then `extra` (more lines, or the blank line
    that ends the head)."""
    status = _STATUS_LINES.get(response.status)
    if status is None:
        status = _STATUS_LINES[response.status] = b"HTTP/1.1 %d %s\r\n" % (
            response.status,
            reason(response.status),
        )
    return status + b"".join(_header_line(n, v) for n, v in response.headers) + extra


def encode(response: Response, head: bool, close: bool) -> bytes:
    """A whole response with no streaming body; `head`: answering a HEAD request (no body sent),
    `close`: the connection closes after it."""
    extra = b"connection: close\r\n" if close else b""
    if response.status in (204, 304) or (100 <= response.status < 200):
        return encode_head(response, extra + b"\r\n")
    body = b"" if head else response.body
    return encode_head(response, extra + b"content-length: %d\r\n\r\n" % len(response.body)) + body


def chunk(payload: bytes) -> bytes:
    """`payload` framed as one chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


LAST_CHUNK = b"0\r\n\r\n"
