"""The reason phrase of an HTTP/1.1 status line, for both edges that write one (the lean edge's
HTTP/1.1 writer and hypercorn's, see hypercorn_fixes.py).

A phrase is optional (RFC 9112 §4), but h2load's HTTP/1.1 mode counted every response without one
as failed, and other clients may too. HTTP/2 has no reason phrases.
"""

from __future__ import annotations

from http import HTTPStatus

PHRASES: dict[int, bytes] = {status.value: status.phrase.encode("ascii") for status in HTTPStatus}


def reason(status: int) -> bytes:
    """The registered phrase of `status`, or b"" for a code without one (still a valid line)."""
    return PHRASES.get(status, b"")
