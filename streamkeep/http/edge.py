"""What the edges share: what they ask of the service (`Handler`), the limits a connection runs
under, the answers to a refused body (written without the service), and for the lean edge's
listener (accept.py) and its two protocols (h1_connection.py, h2_connection.py) the set of open
connections and how to tell a client that hung up from a failure of ours."""

from __future__ import annotations

import ssl
from collections.abc import Awaitable
from typing import Protocol

import trio

from streamkeep.http.budget import BodyBudget
from streamkeep.protocol import responses
from streamkeep.protocol.cors import Cors
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.model import Request, Response

MAX_HEADER_BYTES = 64 * 1024  # a request's head (HTTP/1.1) or header list (HTTP/2)
KEEP_ALIVE_TIMEOUT = 75.0  # a connection waiting this long for its next request is closed


class HandlerOptions(Protocol):
    @property
    def send_stall_timeout(self) -> float: ...


class Handler(Protocol):
    """What an edge asks of the service behind it (the server's `Service`, or the metrics port's
    endpoint): the edge knows requests and responses, not what answers them."""

    @property
    def options(self) -> HandlerOptions: ...

    @property
    def cors(self) -> Cors: ...

    def begin(self, request: Request) -> Response | Awaitable[Response]:
        """The response if it can be given without waiting, else what gives it (HTTP/2 runs a
        task only for the latter)."""
        ...

    async def handle(self, request: Request) -> Response: ...


class EdgeLimits:
    def __init__(
        self, *, max_body_bytes: int, body_timeout: float, h2_max_concurrent_streams: int, budget: BodyBudget
    ) -> None:
        self.budget = budget
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.h2_max_concurrent_streams = h2_max_concurrent_streams


def body_timed_out(timeout: float) -> ProtocolError:
    return ProtocolError(408, "body_timeout", f"the request body took longer than {timeout:g} s to arrive")


def rejection(service: Handler, error: ProtocolError) -> Response:
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
        self._none_left: trio.Event | None = None

    def opened(self, scope: trio.CancelScope) -> None:
        self.all.add(scope)

    def closed(self, scope: trio.CancelScope) -> None:
        self.all.discard(scope)
        self.idle.pop(scope, None)
        if not self.all and self._none_left is not None:
            self._none_left.set()

    async def none_left(self) -> None:
        """Returns once every connection has closed."""
        if self.all:
            self._none_left = trio.Event()
            await self._none_left.wait()

    def waiting(self, scope: trio.CancelScope) -> None:
        self.idle[scope] = trio.current_time()

    def working(self, scope: trio.CancelScope) -> None:
        self.idle.pop(scope, None)

    async def close_idle(self, idle_limit: float) -> None:
        """Ends connections that waited for a request longer than `idle_limit` seconds (within a
        quarter of it): one task for every connection, where a timer per request cost ~3 us of an
        append."""
        while True:
            await trio.sleep(idle_limit / 4)
            cutoff = trio.current_time() - idle_limit
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
