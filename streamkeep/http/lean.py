"""The lean edge: one trio task per connection driving h11 (HTTP/1.1) or h2 (HTTP/2) directly.

hypercorn's trio worker spends ~580 us of CPU per request in its glue (a task and a memory channel
per request, per-send locks, timers); a bare trio loop over h11/h2 needs ~115 us. This edge keeps
everything protocol-specific in `streamkeep.service` and only moves bytes: parse a request, read its
body under our limits, call `Service.handle`, write the response (streaming SSE as it comes). The
quart-trio edge (`--edge quart`) stays available and passes the same tests.

HTTP/2 arrives by ALPN on TLS or by prior knowledge (the connection preface) on plain TCP.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from functools import partial
from http import HTTPStatus

import h11
import trio

from streamkeep.http.budget import BodyBudget
from streamkeep.http.lean_h2 import H2_PREFACE, serve_h2
from streamkeep.protocol import responses
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.model import Framed, Headers, Request, Response
from streamkeep.service import Service

log = logging.getLogger(__name__)

READ_SIZE = 65536
MAX_HEADER_BYTES = 64 * 1024
HEADER_TIMEOUT = 30.0  # a client gets this long to send a request's head once it starts one
KEEP_ALIVE_TIMEOUT = 75.0


class EdgeLimits:
    def __init__(
        self, *, max_body_bytes: int, body_timeout: float, h2_max_concurrent_streams: int, budget: BodyBudget
    ) -> None:
        self.budget = budget
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.h2_max_concurrent_streams = h2_max_concurrent_streams


def reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def rejection(service: Service, error: ProtocolError) -> Response:
    response = responses.error(error)
    response.headers.extend(responses.common_headers(service.options.cors_origin))
    return response


def too_large(limit: int) -> ProtocolError:
    return ProtocolError(
        413, "body_too_large", f"request bodies may be at most {limit} bytes; split the append"
    )


def body_timed_out(timeout: float) -> ProtocolError:
    return ProtocolError(408, "body_timeout", f"the request body took longer than {timeout:g} s to arrive")


class ChunkedPush:
    """Lets live fan-out write SSE bytes straight into a plain HTTP/1.1 connection (see
    streamkeep.live): framed as one chunk, written without blocking while the connection's task
    sleeps in the service."""

    __slots__ = ("fd",)
    kind = "http/1.1 chunked"

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def frame(self, payload: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(payload), payload)

    def write(self, data: bytes) -> int:
        return os.write(self.fd, data)  # the socket is non-blocking: BlockingIOError when full


class Connections:
    """Open connections, so shutdown can close idle ones at once and busy ones after a grace."""

    def __init__(self) -> None:
        self.idle: set[trio.CancelScope] = set()
        self.all: set[trio.CancelScope] = set()
        self.closing = False


async def serve_connection(
    stream: trio.abc.Stream,
    service: Service,
    limits: EdgeLimits,
    connections: Connections,
    ssl_context: ssl.SSLContext | None,
) -> None:
    with trio.CancelScope() as scope:
        connections.all.add(scope)
        try:
            await _serve(stream, service, limits, connections, scope, ssl_context)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, ssl.SSLError, OSError):
            pass
        except Exception:
            log.exception("connection failed; closing it")
        finally:
            connections.all.discard(scope)
            connections.idle.discard(scope)
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                try:
                    await stream.aclose()
                except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
                    pass


async def _serve(
    stream: trio.abc.Stream,
    service: Service,
    limits: EdgeLimits,
    connections: Connections,
    scope: trio.CancelScope,
    ssl_context: ssl.SSLContext | None,
) -> None:
    scheme = "http"
    if ssl_context is not None:
        stream = trio.SSLStream(stream, ssl_context, server_side=True, https_compatible=True)
        with trio.fail_after(HEADER_TIMEOUT):
            await stream.do_handshake()
        scheme = "https"
        if stream.selected_alpn_protocol() == "h2":
            await serve_h2(stream, b"", service, limits, scheme, connections, scope)
            return
    with trio.fail_after(HEADER_TIMEOUT):
        first = await stream.receive_some(READ_SIZE)
    if not first:
        return
    if first.startswith(H2_PREFACE[: len(first)]) and len(first) >= 3:
        await serve_h2(stream, first, service, limits, scheme, connections, scope)
        return
    await serve_h11(stream, first, service, limits, connections, scope, scheme)


async def serve_h11(
    stream: trio.abc.Stream,
    first: bytes,
    service: Service,
    limits: EdgeLimits,
    connections: Connections,
    scope: trio.CancelScope,
    scheme: str,
) -> None:
    """h11 parses requests; responses are written directly (h11's per-header validation of our
    own, already valid headers was the single largest cost of the loop). Each request gets a fresh
    h11 parser fed with the bytes left over from the previous one."""
    pending = first
    while True:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        if pending:
            conn.receive_data(pending)

        async def next_event(timeout: float, conn: h11.Connection = conn) -> h11.Event:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            with trio.fail_after(timeout):
                while event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(READ_SIZE))
                    event = conn.next_event()
            return event

        connections.idle.add(scope)
        if connections.closing:
            return
        try:
            event = await next_event(KEEP_ALIVE_TIMEOUT)
        except h11.RemoteProtocolError as error:
            connections.idle.discard(scope)
            status = error.error_status_hint
            message = "request head too large" if status == 431 else f"malformed HTTP/1.1 request: {error}"
            await stream.send_all(
                _encode(rejection(service, ProtocolError(status, "bad_http", message)), False, True)
            )
            return
        connections.idle.discard(scope)
        if not isinstance(event, h11.Request):
            return
        method = event.method.decode("ascii", "replace")
        target = event.target.decode("latin-1")
        raw_path, _, query = target.partition("?")
        headers = Headers([(k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers])
        keep_alive = event.http_version == b"1.1" and (headers.get("connection") or "").lower() != "close"
        charged: list[int] = [0]
        try:
            try:
                body = await _read_h11_body(conn, event, next_event, stream, limits, charged)
            except ProtocolError as error:
                await stream.send_all(_encode(rejection(service, error), False, True))
                return
            request = Request(method, raw_path, query, headers, body, scheme, "1.1")
            if method == "GET" and isinstance(stream, trio.SocketStream):
                request.push = ChunkedPush(stream.socket.fileno())
            response = await service.handle(request)
        finally:
            limits.budget.release(charged[0])
        pending, closed = conn.trailing_data
        if response.stream is None:
            await stream.send_all(_encode(response, method == "HEAD", not keep_alive))
        else:
            # A stream can last minutes and there may be 10,000 of them: the parser, request and
            # its headers are done with, so they are not kept alive alongside it.
            del conn, next_event, request, headers, event, body
            sent_meanwhile = await _send_streaming(stream, response, service.options.send_stall_timeout)
            if sent_meanwhile is None:
                return
            pending += sent_meanwhile
        if not keep_alive or closed:
            return


async def _read_h11_body(
    conn: h11.Connection,
    request: h11.Request,
    next_event: Callable[[float], Awaitable[h11.Event]],
    stream: trio.abc.Stream,
    limits: EdgeLimits,
    charged: list[int],
) -> bytes:
    for name, value in request.headers:
        if name == b"content-length" and value.isdigit() and int(value) > limits.max_body_bytes:
            raise too_large(limits.max_body_bytes)
    if conn.they_are_waiting_for_100_continue:
        await stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
    chunks: list[bytes] = []
    size = 0
    deadline = trio.current_time() + limits.body_timeout
    try:
        while True:
            event = await next_event(max(0.0, deadline - trio.current_time()))
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > limits.max_body_bytes:
                    raise too_large(limits.max_body_bytes)
                limits.budget.charge(len(event.data))
                charged[0] += len(event.data)
                chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            else:
                raise ProtocolError(400, "bad_http", "the connection ended inside the request body")
    except trio.TooSlowError:
        raise body_timed_out(limits.body_timeout) from None
    except h11.RemoteProtocolError as error:
        raise ProtocolError(400, "bad_http", f"malformed request body: {error}") from None


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


def _head(response: Response, extra: bytes) -> bytes:
    status = _STATUS_LINES.get(response.status)
    if status is None:
        status = _STATUS_LINES[response.status] = b"HTTP/1.1 %d %s\r\n" % (
            response.status,
            reason(response.status),
        )
    return status + b"".join(_header_line(n, v) for n, v in response.headers) + extra


def _encode(response: Response, head: bool, close: bool) -> bytes:
    extra = b"connection: close\r\n" if close else b""
    if response.status in (204, 304) or (100 <= response.status < 200):
        return _head(response, extra + b"\r\n")
    body = b"" if head else response.body
    return _head(response, extra + b"content-length: %d\r\n\r\n" % len(response.body)) + body


async def _send_streaming(stream: trio.abc.Stream, response: Response, stall_timeout: float) -> bytes | None:
    """A streaming body (SSE), framed with chunked transfer encoding.

    Returns the bytes the client sent meanwhile (its next request), or None once the connection is
    done for: the client hung up (noticed at once, so its reader does not linger until the next
    event), or it took no bytes for `stall_timeout`. The kernel's socket buffer is the only
    per-subscriber buffer; a reader cut off resumes by offset.
    """
    await stream.send_all(_head(response, b"transfer-encoding: chunked\r\n\r\n"))
    iterator = response.stream
    assert iterator is not None
    received = bytearray()
    done_for = False

    async def watch_client(scope: trio.CancelScope) -> None:
        nonlocal done_for
        try:
            while data := await stream.receive_some(READ_SIZE):
                received.extend(data)
                if len(received) > MAX_HEADER_BYTES:
                    break
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
            pass
        done_for = True
        scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_client, nursery.cancel_scope)
        try:
            async for chunk in iterator:
                if not chunk:
                    continue
                with trio.move_on_after(stall_timeout) as waited:
                    if isinstance(chunk, Framed):
                        await stream.send_all(chunk)  # the rest of a pushed chunk, framed already
                    else:
                        await stream.send_all(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                if waited.cancelled_caught:
                    done_for = True
                    break
        finally:
            await iterator.aclose()  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()
    if done_for:
        return None
    await stream.send_all(b"0\r\n\r\n")
    return bytes(received)


async def serve_lean(
    service: Service,
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
            task_status.started(urls)
            await shutdown.wait()
            acceptors.cancel_scope.cancel()
        connections.closing = True
        for scope in list(connections.idle):
            scope.cancel()
        with trio.move_on_after(shutdown_grace):
            while connections.all:
                await trio.sleep(0.05)
        handlers.cancel_scope.cancel()
