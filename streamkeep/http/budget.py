"""A server-wide cap on request-body bytes held in memory at once.

Each request body may be up to --max-body-bytes, and HTTP/2 lets one connection run many requests
at once; without a shared cap a hostile client could make the server buffer gigabytes. Bodies are
charged as their bytes arrive and released once the request is answered (or its connection ends);
a body that would pass the cap is refused with 503 and Retry-After.
"""

from __future__ import annotations

from streamkeep.protocol.errors import ProtocolError


class BodyBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def charge(self, amount: int) -> None:
        if self.used + amount > self.limit:
            raise busy()
        self.used += amount

    def release(self, amount: int) -> None:
        self.used = max(0, self.used - amount)


def busy() -> ProtocolError:
    return ProtocolError(
        503,
        "server_busy",
        "too many request bodies are in flight on this server; retry shortly",
        [("Retry-After", "1")],
    )
