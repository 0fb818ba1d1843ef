"""The lean edge's listener: accepts TCP connections, does the TLS handshake, picks HTTP/1.1 or
HTTP/2 for each connection, closes connections idle too long, and drains them at shutdown.

hypercorn's trio worker spends ~580 us of CPU per request in its glue (a task and a memory channel
per request, per-send locks, timers); a bare trio loop over h11/h2 needs ~75 us, and ~45 us of an
append's remain once llhttp parses HTTP/1.1 instead of h11 (docs/benchmarks.md). So this edge
keeps everything protocol-specific in the service behind it (edge.Handler) and only moves bytes:
one trio task per connection (h1_connection.py, h2_connection.py). The quart-trio edge
(`--edge quart`) stays available and passes the same tests.

HTTP/2 arrives by ALPN on TLS or by prior knowledge (the connection preface) on plain TCP.
"""

from __future__ import annotations

import logging
import ssl
from functools import partial

import trio

from streamkeep.http.edge import KEEP_ALIVE_TIMEOUT, Connections, EdgeLimits, Handler, hung_up
from streamkeep.http.h1_connection import serve_h1
from streamkeep.http.h2_connection import H2_PREFACE, serve_h2
from streamkeep.http.sockets import READ_SIZE

log = logging.getLogger(__name__)

HEADER_TIMEOUT = 30.0  # a client gets this long to send a request's head once it starts one


def peer_address(stream: trio.abc.Stream) -> str:
    """The client's IP address, for the access log ("" if the transport has none)."""
    try:
        address = stream.socket.getpeername()  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return ""
    return str(address[0]) if isinstance(address, tuple) else str(address)


async def serve_connection(
    stream: trio.abc.Stream,
    service: Handler,
    limits: EdgeLimits,
    connections: Connections,
    ssl_context: ssl.SSLContext | None,
) -> None:
    with trio.CancelScope() as scope:
        connections.opened(scope)
        try:
            await _serve(stream, service, limits, connections, scope, ssl_context)
        except Exception as error:
            if hung_up(error):  # the client went away: nothing to report
                log.debug("connection ended by the peer: %r", error)
            else:
                log.exception("connection failed; closing it")
        finally:
            connections.closed(scope)
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                try:
                    await stream.aclose()
                except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
                    pass


async def _serve(
    stream: trio.abc.Stream,
    service: Handler,
    limits: EdgeLimits,
    connections: Connections,
    scope: trio.CancelScope,
    ssl_context: ssl.SSLContext | None,
) -> None:
    scheme = "http"
    client = peer_address(stream)
    if ssl_context is not None:
        stream = trio.SSLStream(stream, ssl_context, server_side=True, https_compatible=True)
        with trio.fail_after(HEADER_TIMEOUT):
            await stream.do_handshake()
        scheme = "https"
        if stream.selected_alpn_protocol() == "h2":
            await serve_h2(stream, b"", service, limits, scheme, connections, scope, client)
            return
    with trio.fail_after(HEADER_TIMEOUT):
        first = bytes(await stream.receive_some(READ_SIZE))  # bytes already: bytes() keeps it
    if not first:
        return
    if first.startswith(H2_PREFACE[: len(first)]) and len(first) >= 3:
        await serve_h2(stream, first, service, limits, scheme, connections, scope, client)
        return
    await serve_h1(stream, first, service, limits, connections, scope, scheme, client)


async def serve_lean(
    service: Handler,
    *,
    host: str,
    port: int,
    backlog: int,
    limits: EdgeLimits,
    ssl_context: ssl.SSLContext | None,
    shutdown_grace: float,
    shutdown: trio.Event,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serves until `shutdown` fires, then gives busy connections `shutdown_grace` seconds."""
    listeners = await trio.open_tcp_listeners(port, host=host, backlog=backlog)
    scheme = "https" if ssl_context is not None else "http"
    urls = []
    for listener in listeners:
        address = listener.socket.getsockname()
        shown = f"[{address[0]}]" if ":" in address[0] else address[0]
        urls.append(f"{scheme}://{shown}:{address[1]}")
    connections = Connections()
    async with trio.open_nursery() as handlers:
        async with trio.open_nursery() as acceptors:
            acceptors.start_soon(
                partial(trio.serve_listeners, handler_nursery=handlers),
                lambda stream: serve_connection(stream, service, limits, connections, ssl_context),
                listeners,
            )
            acceptors.start_soon(connections.close_idle, KEEP_ALIVE_TIMEOUT)
            task_status.started(urls)
            await shutdown.wait()
            acceptors.cancel_scope.cancel()
        connections.closing = True
        for scope in list(connections.idle):
            scope.cancel()
        with trio.move_on_after(shutdown_grace):
            await connections.none_left()
        handlers.cancel_scope.cancel()
