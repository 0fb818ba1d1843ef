"""One HTTP/1.1 connection of the lean edge: requests parsed by llhttp (h1_parser.py), each body
read under our limits, the service's `handle` called, the response written (h1_writer.py)
straight into the socket, or streamed with chunked framing (SSE) while the client is watched for
hanging up.
"""

from __future__ import annotations

import os
import ssl

import trio

from streamkeep.http import sockets
from streamkeep.http.edge import MAX_HEADER_BYTES, Connections, EdgeLimits, Handler, body_timed_out, rejection
from streamkeep.http.h1_parser import BadRequest, ParsedRequest, PeerClosed, RequestReader
from streamkeep.http.h1_writer import LAST_CHUNK, chunk, encode, encode_head
from streamkeep.http.sockets import READ_SIZE
from streamkeep.protocol.errors import ProtocolError, body_too_large
from streamkeep.protocol.model import Framed, Headers, Request, Response


class ChunkedPush:
    """Lets live fan-out write SSE bytes straight into a plain HTTP/1.1 connection (see
    streamkeep.server.fanout): framed as one chunk, written without blocking while the
    connection's task sleeps in the service."""

    __slots__ = ("fd",)
    kind = "http/1.1 chunked"

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def frame(self, payload: bytes) -> bytes:
        return chunk(payload)

    def write(self, data: bytes) -> int:
        return os.write(self.fd, data)  # the socket is non-blocking: BlockingIOError when full


async def serve_h1(
    stream: trio.abc.Stream,
    first: bytes,
    service: Handler,
    limits: EdgeLimits,
    connections: Connections,
    scope: trio.CancelScope,
    scheme: str,
    client: str = "",
) -> None:
    """Serves requests until the client closes, the connection idles past the keep-alive timeout
    (Connections.close_idle) or the server shuts down; `first`: bytes already read from it."""
    reader = RequestReader(stream, MAX_HEADER_BYTES)
    fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else None
    push = ChunkedPush(fd) if fd is not None else None
    try:
        if first:
            reader.feed(first)
        while True:
            connections.waiting(scope)  # closed if idle too long (Connections.close_idle)
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
                    await stream.send_all(encode(rejection(service, error), False, True))
                    return
                except trio.TooSlowError:
                    refusal = rejection(service, body_timed_out(limits.body_timeout))
                    await stream.send_all(encode(refusal, False, True))
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
                await _send(stream, fd, encode(response, message.method == "HEAD", not keep_alive))
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
        refusal = rejection(service, ProtocolError(bad.status, "bad_http", str(bad)))
        await stream.send_all(encode(refusal, False, True))


def _charge_body(size: int, limits: EdgeLimits, charged: list[int]) -> None:
    """Refuses a body over --max-body-bytes, and charges what arrived so far to the server-wide
    body budget (`charged[0]`: what this request holds of it, released when it is answered)."""
    if size > limits.max_body_bytes:
        raise body_too_large(limits.max_body_bytes)
    if size > charged[0]:
        limits.budget.charge(size - charged[0])
        charged[0] = size


async def _wait_for_body(
    stream: trio.abc.Stream,
    reader: RequestReader,
    message: ParsedRequest,
    limits: EdgeLimits,
    charged: list[int],
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
        await stream.send_all(encode_head(response, b"transfer-encoding: chunked\r\n\r\n"))
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
            async for piece in iterator:
                if not piece:
                    continue
                with trio.move_on_after(stall_timeout) as waited:
                    if isinstance(piece, Framed):
                        await stream.send_all(piece)  # the rest of a pushed chunk, framed already
                    else:
                        await stream.send_all(chunk(piece))
                if waited.cancelled_caught:
                    done_for = True
                    break
        finally:
            await iterator.aclose()  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()
    if done_for:
        return None
    await stream.send_all(LAST_CHUNK)
    return bytes(received)
