"""The lean edge: one trio task per connection driving llhttp (HTTP/1.1) or h2 (HTTP/2) directly.

hypercorn's trio worker spends ~580 us of CPU per request in its glue (a task and a memory channel
per request, per-send locks, timers); a bare trio loop over h11/h2 needs ~75 us, and ~45 us of an
append's remain once llhttp parses HTTP/1.1 instead of h11 (docs/architecture.md). This edge keeps
everything protocol-specific in `streamkeep.service` and only moves bytes: parse a request, read its
body under our limits, call `Service.handle`, write the response (streaming SSE as it comes). The
quart-trio edge (`--edge quart`) stays available and passes the same tests.

HTTP/2 arrives by ALPN on TLS or by prior knowledge (the connection preface) on plain TCP.
"""

from __future__ import annotations

import logging
import os
import ssl
from functools import partial
from http import HTTPStatus

import trio

from streamkeep.http import sockets
from streamkeep.http.edge import Connections, EdgeLimits, hung_up, rejection
from streamkeep.http.h1 import READ_SIZE, BadRequest, Message, PeerClosed, RequestReader
from streamkeep.http.lean_h2 import H2_PREFACE, serve_h2
from streamkeep.protocol.errors import ProtocolError, body_too_large
from streamkeep.protocol.model import Framed, Headers, Request, Response
from streamkeep.service import Service

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
HEADER_TIMEOUT = 30.0  # a client gets this long to send a request's head once it starts one
KEEP_ALIVE_TIMEOUT = 75.0


def reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def peer_address(stream: trio.abc.Stream) -> str:
    """The client's IP address, for the access log ("" if the transport has none)."""
    try:
        address = stream.socket.getpeername()  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return ""
    return str(address[0]) if isinstance(address, tuple) else str(address)


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
        except Exception as error:
            if hung_up(error):  # the client went away: nothing to report
                log.debug("connection ended by the peer: %r", error)
            else:
                log.exception("connection failed; closing it")
        finally:
            connections.all.discard(scope)
            connections.working(scope)
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
        first = await stream.receive_some(READ_SIZE)
    if not first:
        return
    if first.startswith(H2_PREFACE[: len(first)]) and len(first) >= 3:
        await serve_h2(stream, first, service, limits, scheme, connections, scope, client)
        return
    await serve_h1(stream, first, service, limits, connections, scope, scheme, client)


async def serve_h1(
    stream: trio.abc.Stream,
    first: bytes,
    service: Service,
    limits: EdgeLimits,
    connections: Connections,
    scope: trio.CancelScope,
    scheme: str,
    client: str = "",
) -> None:
    """HTTP/1.1: requests parsed by llhttp (streamkeep.http.h1), responses written directly."""
    reader = RequestReader(stream, MAX_HEADER_BYTES)
    fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else None
    push = ChunkedPush(fd) if fd is not None else None
    try:
        if first:
            reader.feed(first)
        while True:
            connections.waiting(scope)  # closed after KEEP_ALIVE_TIMEOUT (Connections.close_idle)
            if connections.closing:
                return
            try:
                message = await reader.head()
            except PeerClosed:
                return
            finally:
                connections.working(scope)
            charged = [0]
            try:
                try:
                    if message.complete:
                        # The whole request came in one read (nearly every append): no waiting.
                        _charge_body(message.size, limits, charged)
                    else:
                        await _wait_for_body(stream, reader, message, limits, charged)
                except ProtocolError as error:
                    await stream.send_all(_encode(rejection(service, error), False, True))
                    return
                except trio.TooSlowError:
                    error = body_timed_out(limits.body_timeout)
                    await stream.send_all(_encode(rejection(service, error), False, True))
                    return
                except PeerClosed:
                    return
                raw_path, _, query = message.url.decode("latin-1").partition("?")
                body = b"".join(message.body)
                message.body.clear()
                request = Request(
                    message.method, raw_path, query, Headers.lowered(message.headers), body, scheme, "1.1"
                )
                request.client = client
                if push is not None and message.method == "GET":
                    request.push = push
                response = await service.handle(request)
            finally:
                limits.budget.release(charged[0])
            keep_alive = reader.finish(message)
            if response.stream is None:
                await _send(stream, fd, _encode(response, message.method == "HEAD", not keep_alive))
            else:
                # A stream can last minutes and there may be 10,000 of them: the request and its
                # body are done with, so they are not kept alive alongside it.
                del request, body, message
                sent_meanwhile = await _send_streaming(stream, response, service.options.send_stall_timeout)
                if sent_meanwhile is None:
                    return
                reader.feed(sent_meanwhile)
            if not keep_alive:
                return
    except BadRequest as bad:
        error = ProtocolError(bad.status, "bad_http", str(bad))
        await stream.send_all(_encode(rejection(service, error), False, True))


def _charge_body(size: int, limits: EdgeLimits, charged: list[int]) -> None:
    """Refuses a body over --max-body-bytes, and charges what arrived so far to the server-wide
    body budget (`charged[0]`: what this request holds of it, released when it is answered)."""
    if size > limits.max_body_bytes:
        raise body_too_large(limits.max_body_bytes)
    if size > charged[0]:
        limits.budget.charge(size - charged[0])
        charged[0] = size


async def _wait_for_body(
    stream: trio.abc.Stream, reader: RequestReader, message: Message, limits: EdgeLimits, charged: list[int]
) -> None:
    """Reads the rest of a request's body under --max-body-bytes and --body-timeout."""
    if (message.declared_length or 0) > limits.max_body_bytes:
        raise body_too_large(limits.max_body_bytes)
    if message.expects_continue:
        await stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
    await reader.body(
        message, trio.current_time() + limits.body_timeout, lambda size: _charge_body(size, limits, charged)
    )


async def _send(stream: trio.abc.Stream, fd: int | None, data: bytes) -> None:
    """Writes a response: straight into a plain TCP socket when the kernel takes it all (almost
    always: the socket buffer is empty between requests), which spares trio's yield around a send;
    the connection's reads are its checkpoints. The rest, if any, goes through trio and waits."""
    if fd is not None:
        sent = sockets.write_now(fd, data)
        if sent == len(data):
            return
        data = data[sent:]
    await stream.send_all(data)


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
    iterator = response.stream
    assert iterator is not None
    try:
        await stream.send_all(_head(response, b"transfer-encoding: chunked\r\n\r\n"))
    except BaseException:
        # Closed even so: a forwarded answer holds a connection to its member (shielded, bounded).
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await iterator.aclose()  # type: ignore[attr-defined]
        raise
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
            acceptors.start_soon(connections.close_idle, KEEP_ALIVE_TIMEOUT)
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
