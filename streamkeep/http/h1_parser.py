"""HTTP/1.1 requests off one connection for the lean edge: its socket read, parsed by llhttp (Node's
parser) through httptools.

Why not h11: parsing one append's request with h11 takes ~19 us of CPU, with httptools ~1 us
(measured on this machine; docs/benchmarks.md). At ~130 us per in-memory append that was the
largest single cost left in the request path. llhttp is strict the way a server must be: it rejects
a Content-Length beside Transfer-Encoding, bad chunk sizes, control characters in headers and
obsolete line folding, so request smuggling is refused here, not reasoned about later.

`RequestReader` feeds received bytes to the parser and hands out one `ParsedRequest` at a time: first
when its head is complete (so the edge can refuse a declared-too-large body or answer
`Expect: 100-continue`), then when its body is. Pipelined requests queue up in order; bytes are
only read from the socket when the queue cannot answer, so the queue is bounded by one read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import httptools
import trio

from streamkeep.http import sockets
from streamkeep.http.sockets import READ_SIZE


class BadRequest(Exception):
    """The bytes are not HTTP/1.1 we accept; `status` says which 4xx to answer before closing."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class PeerClosed(Exception):
    """The client closed its side before a whole request arrived."""


class ParsedRequest:
    """One request as llhttp reports it: the head first, the body as it arrives (not yet the
    protocol's `Request`, which the connection builds once the body is whole)."""

    __slots__ = (
        "body",
        "complete",
        "declared_length",
        "expects_continue",
        "head_complete",
        "headers",
        "keep_alive",
        "method",
        "size",
        "url",
    )

    def __init__(self) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}  # lower-case names, repeats joined by ", "
        self.body: list[bytes] = []
        self.size = 0
        self.method = ""
        self.keep_alive = True
        self.declared_length: int | None = None
        self.expects_continue = False
        self.head_complete = False
        self.complete = False


class RequestReader:
    """Parses the requests arriving on one connection (the httptools callback protocol)."""

    def __init__(self, stream: trio.abc.Stream, max_head_bytes: int) -> None:
        self._stream = stream
        # Plain TCP is read straight from the socket: wait until readable, then recv. Through
        # trio's receive_some a request cost a recv that fails (the client waits for our answer
        # before sending its next request) and a yield around each call (docs/benchmarks.md).
        self._fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else None
        self._max_head_bytes = max_head_bytes
        self._parser = httptools.HttpRequestParser(self)
        self._messages: deque[ParsedRequest] = deque()
        self._head_bytes = 0
        self._head_too_large = False
        # Bytes fed while a request's head is unfinished: httptools buffers a header until it is
        # whole, so this is what bounds the memory one slow, endless header line can take.
        self._in_head = False
        self._head_fed = 0
        self._upgraded = False

    # ---- httptools callbacks ---------------------------------------------------------

    def on_message_begin(self) -> None:
        self._messages.append(ParsedRequest())
        self._head_bytes = 0
        self._in_head = True
        self._head_fed = 0

    def on_url(self, url: bytes) -> None:
        self._messages[-1].url += url
        self._head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        message = self._messages[-1]
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        headers = message.headers
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > self._max_head_bytes:
            self._head_too_large = True
        if key == "content-length" and text.isdigit():
            message.declared_length = int(text)
        elif key == "expect" and text.lower() == "100-continue":
            message.expects_continue = True

    def on_headers_complete(self) -> None:
        message = self._messages[-1]
        message.method = self._parser.get_method().decode("ascii", "replace")
        message.keep_alive = self._parser.should_keep_alive()
        message.head_complete = True
        self._in_head = False

    def on_body(self, body: bytes) -> None:
        message = self._messages[-1]
        message.body.append(body)
        message.size += len(body)

    def on_message_complete(self) -> None:
        self._messages[-1].complete = True

    # ---- reading -----------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # An Upgrade or CONNECT request: answered as a plain request, then the connection closes.
            self._upgraded = True
        except httptools.HttpParserError as error:
            raise BadRequest(400, f"malformed HTTP/1.1 request: {error}") from None
        if self._in_head:
            self._head_fed += len(data)
        if self._head_too_large or self._head_fed > self._max_head_bytes + READ_SIZE:
            raise BadRequest(431, "request head too large")

    async def head(self) -> ParsedRequest:
        """The next request, once its head has arrived (its body may still be on the way). No
        timeout here: the edge closes connections idle too long (edge.Connections.close_idle).

        Always a checkpoint: a request already parsed (pipelined) yields to other tasks first, so
        a client pipelining requests cannot keep the event loop to itself."""
        if self._head_ready():
            await trio.lowlevel.checkpoint()
        else:
            await self._read_until(self._head_ready)
        return self._messages[0]

    def _head_ready(self) -> bool:
        return bool(self._messages) and self._messages[0].head_complete

    async def body(self, message: ParsedRequest, deadline: float, on_bytes: Callable[[int], None]) -> None:
        """Reads until `message` is complete, TooSlowError at `deadline`; `on_bytes(size so far)`
        may refuse by raising."""

        def done() -> bool:
            on_bytes(message.size)
            return message.complete

        if done():
            return
        with trio.fail_at(deadline):
            await self._read_until(done)

    def finish(self, message: ParsedRequest) -> bool:
        """Drops the answered request; False if the connection must close after it."""
        if self._messages and self._messages[0] is message:
            self._messages.popleft()
        return message.keep_alive and not self._upgraded

    async def _read_until(self, ready: Callable[[], bool]) -> None:
        """Reads and parses until `ready()`."""
        if self._upgraded:
            raise PeerClosed
        while True:
            data = await sockets.receive(self._stream, self._fd)
            if not data:
                raise PeerClosed
            self.feed(data)
            if ready():
                return
            if self._upgraded:
                raise PeerClosed


__all__ = ["BadRequest", "ParsedRequest", "PeerClosed", "RequestReader"]
