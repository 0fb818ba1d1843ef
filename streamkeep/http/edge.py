"""What both halves of the lean edge share (lean.py: HTTP/1.1 and the accept loop; lean_h2.py:
HTTP/2): the limits a connection runs under, the set of open connections, the error answers
written without the service, and how to tell a client that hung up from a failure of ours."""

from __future__ import annotations

import ssl

import trio

from streamkeep.http.budget import BodyBudget
from streamkeep.protocol import responses
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.model import Response
from streamkeep.service import Service


class EdgeLimits:
    def __init__(
        self, *, max_body_bytes: int, body_timeout: float, h2_max_concurrent_streams: int, budget: BodyBudget
    ) -> None:
        self.budget = budget
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.h2_max_concurrent_streams = h2_max_concurrent_streams


def rejection(service: Service, error: ProtocolError) -> Response:
    response = responses.error(error)
    response.headers.extend(service.cors.headers(None))
    response.headers.append(responses.SANDBOX)  # as the service sends with every answer but the UI's
    return response


class Connections:
    """Open connections, so shutdown can close idle ones at once and busy ones after a grace, and
    connections idle too long (keep-alive) are closed."""

    def __init__(self) -> None:
        self.idle: dict[trio.CancelScope, float] = {}  # connections waiting for a request: since when
        self.all: set[trio.CancelScope] = set()
        self.closing = False

    def waiting(self, scope: trio.CancelScope) -> None:
        self.idle[scope] = trio.current_time()

    def working(self, scope: trio.CancelScope) -> None:
        self.idle.pop(scope, None)

    async def close_idle(self, timeout: float) -> None:
        """Ends connections that waited for a request longer than `timeout` (within a quarter of
        it): one task for every connection, where a timer per request cost ~3 us of an append."""
        while True:
            await trio.sleep(timeout / 4)
            cutoff = trio.current_time() - timeout
            for scope, since in list(self.idle.items()):
                if since <= cutoff:
                    scope.cancel()


# How a connection ends when its client goes away (a reset, a broken pipe, a stalled reader cut off,
# a TLS session torn down): no fault of ours, so never worth an ERROR.
PEER_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, ssl.SSLError, OSError)


def hung_up(error: BaseException) -> bool:
    """Whether `error` (or every error in an exception group, as a connection's tasks raise
    together) only says that the peer went away."""
    if isinstance(error, BaseExceptionGroup):
        return all(hung_up(inner) for inner in error.exceptions)
    return isinstance(error, PEER_GONE)
