"""Stream-Cursor values (PROTOCOL.md §10.1): 20 s intervals since 2024-10-09, never going back."""

from __future__ import annotations

import random
import time

EPOCH = 1728432000.0  # 2024-10-09T00:00:00Z
INTERVAL_SECONDS = 20
MIN_JITTER_SECONDS = 1
MAX_JITTER_SECONDS = 3600


def current_interval(now: float | None = None) -> int:
    return int(((time.time() if now is None else now) - EPOCH) // INTERVAL_SECONDS)


def response_cursor(client_cursor: str | None, now: float | None = None) -> str:
    """The cursor for a live response: the current interval, or past the client's own cursor.

    A client cursor at or ahead of the current interval gets 1 to 3600 s of random jitter added, so a
    CDN can never hand the same cursor back and loop.
    """
    current = current_interval(now)
    if not client_cursor or not client_cursor.isdigit() or len(client_cursor) > 18:
        return str(current)
    theirs = int(client_cursor)
    if theirs < current:
        return str(current)
    jitter_seconds = random.randint(MIN_JITTER_SECONDS, MAX_JITTER_SECONDS)
    return str(theirs + max(1, -(-jitter_seconds // INTERVAL_SECONDS)))
