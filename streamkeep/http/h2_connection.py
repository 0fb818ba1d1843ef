"""One HTTP/2 connection of the lean edge: h2's state machine, flow control both ways.

The connection's task reads and answers: a request the service answers without waiting
(`Handler.begin` returns a `Response`: an append to an idle in-memory stream) is answered inline
when the answer fits the flow-control window in one frame. Every other request (reads, long-polls,
SSE, durable appends, refused bodies, answers larger than the window) gets a task of its own,
because a task per request was ~20 % of an in-memory append over h2c. Beside the reader run a
writer task (bytes the socket did not take at once) and, only while bodies are arriving, one
task answering 408 to those past --body-timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import trio

from streamkeep.http import sockets
from streamkeep.http.edge import (
    KEEP_ALIVE_TIMEOUT,
    MAX_HEADER_BYTES,
    Connections,
    EdgeLimits,
    Handler,
    body_timed_out,
    rejection,
)
from streamkeep.http.h2_encoder import ResponseEncoder
from streamkeep.http.h2_validate import malformed
from streamkeep.protocol.errors import ProtocolError, body_too_large
from streamkeep.protocol.headers import HOP_BY_HOP
from streamkeep.protocol.model import Headers, Request, Response

log = logging.getLogger(__name__)

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class _Stream:
    __slots__ = ("chunks", "complete", "deadline", "headers", "rejected", "scope", "size", "started")

    def __init__(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.headers = headers
        self.chunks: list[bytes] = []
        self.size = 0
        self.complete = False
        self.started = False
        self.rejected: ProtocolError | None = None
        self.scope: trio.CancelScope | None = None
        self.deadline = 0.0  # when the body must have arrived


async def serve_h2(
    stream: trio.abc.Stream,
    first: bytes,
    service: Handler,
    limits: EdgeLimits,
    scheme: str,
    connections: Connections,
    scope: trio.CancelScope,
    client: str = "",
) -> None:
    connection = _H2Connection(stream, service, limits, scheme, connections, scope)
    connection.client = client
    await connection.run(first)


class _Stalled(Exception):
    """A stream's client opened no flow-control window within the stall timeout."""


class _H2Connection:
    def __init__(
        self,
        stream: trio.abc.Stream,
        service: Handler,
        limits: EdgeLimits,
        scheme: str,
        connections: Connections,
        scope: trio.CancelScope,
    ) -> None:
        self.stream = stream
        self.service = service
        self.limits = limits
        self.scheme = scheme
        self.connections = connections
        self.scope = scope
        # Our own response headers are lower-case and valid already (the service builds them);
        # checking them again cost ~10 % of an append over h2c. What clients send is still checked.
        config = h2.config.H2Configuration(
            client_side=False,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
            # Checked by streamkeep.http.h2_validate instead, at a fraction of the cost.
            validate_inbound_headers=False,
        )
        self.conn = h2.connection.H2Connection(config=config)
        self.conn.encoder = ResponseEncoder()
        self.conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: limits.h2_max_concurrent_streams,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_BYTES,
            },
        )
        self.streams: dict[int, _Stream] = {}
        self.send_lock = trio.Lock()
        self.window_changed = trio.Event()
        self.closed = False
        self.nursery: trio.Nursery | None = None
        self._write_soon = trio.Event()
        self._reaping = False
        # Plain TCP is read and written straight through the socket (as over HTTP/1.1, h1_connection.py);
        # bytes the kernel did not take wait in `_unsent` for the writer task, in order.
        self.fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else None
        self._unsent = bytearray()
        self.client = ""

    async def run(self, first: bytes) -> None:
        self.conn.initiate_connection()
        await self.flush()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            nursery.start_soon(self._writer)
            data = first
            while not self.closed:
                if data:
                    try:
                        events = self.conn.receive_data(data)
                    except h2.exceptions.ProtocolError:
                        await self.flush()  # h2 queued a GOAWAY saying why
                        break
                    self.handle(events)
                    self.write_queued()
                # Not idle while answers already given wait to be written.
                idle = not self.streams and not self._unsent and not self.send_lock.locked()
                if idle:
                    self.connections.waiting(self.scope)
                    if self.connections.closing:
                        self.conn.close_connection()
                        await self.flush()
                        break
                if idle:
                    data = b""
                    with trio.move_on_after(KEEP_ALIVE_TIMEOUT):
                        data = await self.receive()
                    self.connections.working(self.scope)
                else:
                    # No timer while requests are open: a cancel scope per read cost ~5 % here.
                    data = await self.receive()
                if not data:
                    break
            nursery.cancel_scope.cancel()
        for state in self.streams.values():
            self._release(state)

    # ---- events from the client -------------------------------------------------------

    def handle(self, events: list[h2.events.Event]) -> None:
        for event in events:
            if isinstance(event, h2.events.RequestReceived):
                if malformed(event.headers) is not None:
                    # A stream error (RFC 9113 §8.1.1): this request ends, the connection goes on.
                    self.conn.reset_stream(event.stream_id, h2.errors.ErrorCodes.PROTOCOL_ERROR)
                    continue
                state = _Stream(list(event.headers))
                self.streams[event.stream_id] = state
                declared = _header(state.headers, b"content-length")
                if declared is not None and declared.isdigit() and int(declared) > self.limits.max_body_bytes:
                    state.rejected = body_too_large(self.limits.max_body_bytes)
                    self.start(event.stream_id, state)
                elif event.stream_ended is not None:
                    state.complete = True
                    self.start(event.stream_id, state)
                else:
                    state.deadline = trio.current_time() + self.limits.body_timeout
                    if not self._reaping:
                        self._reaping = True
                        assert self.nursery is not None
                        self.nursery.start_soon(self._reap_slow_bodies)
            elif isinstance(event, h2.events.DataReceived):
                self.receive_body(event)
            elif isinstance(event, h2.events.StreamEnded):
                ended = self.streams.get(event.stream_id)
                if ended is not None and not ended.started:
                    ended.complete = True
                    self.start(event.stream_id, ended)
            elif isinstance(event, h2.events.StreamReset):
                reset = self.streams.pop(event.stream_id, None)
                if reset is not None:
                    self._release(reset)
                    if reset.scope is not None:
                        reset.scope.cancel()
                self.wake_senders()
            elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
                self.wake_senders()
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.closed = True

    def receive_body(self, event: h2.events.DataReceived) -> None:
        # Credit comes back for every byte, kept or not: a body we already answered is drained,
        # never left to stall the connection's window.
        try:
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass
        state = self.streams.get(event.stream_id)
        if state is None or state.started:
            return
        if state.size + len(event.data) > self.limits.max_body_bytes:
            state.rejected = body_too_large(self.limits.max_body_bytes)
        else:
            try:
                self.limits.budget.charge(len(event.data))
            except ProtocolError as error:
                state.rejected = error
        if state.rejected is not None:
            self._release(state)
            self.start(event.stream_id, state)
            return
        state.size += len(event.data)
        state.chunks.append(event.data)

    async def _reap_slow_bodies(self) -> None:
        """Answers 408 to bodies that outlive --body-timeout: one task per connection, and only
        while bodies are arriving (a sleeping task per request piled up thousands per second)."""
        try:
            while True:
                waiting = [(sid, state) for sid, state in self.streams.items() if not state.started]
                if not waiting:
                    return
                now = trio.current_time()
                for stream_id, state in waiting:
                    if state.deadline <= now:
                        state.rejected = body_timed_out(self.limits.body_timeout)
                        self.start(stream_id, state)
                remaining = [state.deadline for _, state in waiting if not state.started]
                if remaining:
                    await trio.sleep_until(min(remaining))
        finally:
            self._reaping = False

    def _release(self, state: _Stream) -> None:
        """Gives a stream's buffered body back to the server-wide budget (once)."""
        self.limits.budget.release(state.size)
        state.size = 0
        state.chunks = []

    def start(self, stream_id: int, state: _Stream) -> None:
        """Answers a request whose body is complete (or refused): at once when the service can
        (see Handler.begin) and the answer fits the flow-control window, else in a task."""
        state.started = True
        head = False
        if state.rejected is not None:
            answer: Response | Awaitable[Response] = rejection(self.service, state.rejected)
        else:
            request = self.request(state)
            head = request.method == "HEAD"
            answer = self.service.begin(request)
            if isinstance(answer, Response) and self._send_now(stream_id, answer, head):
                self._release(state)
                if self.streams.get(stream_id) is state:
                    del self.streams[stream_id]
                return
        assert self.nursery is not None
        self.nursery.start_soon(self.respond, stream_id, state, answer, head)

    # ---- responses ----------------------------------------------------------------------

    def _send_now(self, stream_id: int, response: Response, head: bool) -> bool:
        """Queues a whole response in h2 if nothing has to wait for it (no streaming body, and the
        body fits the window in one frame); the receive loop sends it with what else is queued."""
        if response.stream is not None:
            return False
        body = b"" if head or response.status in (204, 304) else response.body
        try:
            if body and len(body) > min(
                self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size
            ):
                return False
            self.conn.send_headers(stream_id, self._response_headers(response), end_stream=not body)
            if body:
                self.conn.send_data(stream_id, body, end_stream=True)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass  # the client reset the stream meanwhile: nothing to send
        return True

    async def respond(
        self, stream_id: int, state: _Stream, answer: Response | Awaitable[Response], head: bool
    ) -> None:
        with trio.CancelScope() as scope:
            state.scope = scope
            try:
                response = answer if isinstance(answer, Response) else await answer
                await self.send_response(stream_id, response, head=head)
            except _Stalled:
                await self.cancel_stream(stream_id)
            except (
                h2.exceptions.StreamClosedError,
                h2.exceptions.ProtocolError,
                trio.BrokenResourceError,
                trio.ClosedResourceError,
            ):
                pass
            finally:
                self._release(state)
                if self.streams.get(stream_id) is state:
                    del self.streams[stream_id]

    async def cancel_stream(self, stream_id: int) -> None:
        try:
            self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            await self.flush()
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def request(self, state: _Stream) -> Request:
        pseudo: dict[bytes, bytes] = {}
        pairs: list[tuple[str, str]] = []
        for name, value in state.headers:
            if name.startswith(b":"):
                pseudo[name] = value
            else:
                pairs.append((name.decode("latin-1"), value.decode("latin-1")))
        if b":authority" in pseudo:
            pairs.append(("host", pseudo[b":authority"].decode("latin-1")))
        target = pseudo.get(b":path", b"/").decode("latin-1")
        raw_path, _, query = target.partition("?")
        method = pseudo.get(b":method", b"GET").decode("ascii", "replace")
        body = b"".join(state.chunks)
        request = Request(method, raw_path, query, Headers(pairs), body, self.scheme, "2")
        request.client = self.client
        return request

    def _response_headers(self, response: Response) -> list[tuple[bytes, bytes]]:
        headers = [_STATUS.get(response.status) or (b":status", str(response.status).encode())]
        headers += [
            _h2_header(name, value) for name, value in response.headers if name.lower() not in HOP_BY_HOP
        ]
        if response.stream is None and response.status not in (204, 304):
            headers.append((b"content-length", str(len(response.body)).encode()))
        return headers

    async def send_response(self, stream_id: int, response: Response, *, head: bool) -> None:
        headers = self._response_headers(response)
        if response.stream is None:
            body = b"" if head or response.status in (204, 304) else response.body
            self.conn.send_headers(stream_id, headers, end_stream=not body)
            if body:
                await self.send_data(stream_id, body, end=True)
            else:
                self.flush_soon()
            return
        iterator = response.stream
        try:  # closed even if the head cannot be sent (a forwarded answer holds a connection)
            self.conn.send_headers(stream_id, headers, end_stream=False)
            await self.flush()
            async for chunk in iterator:
                await self.send_data(stream_id, chunk, end=False)
        finally:
            await iterator.aclose()  # type: ignore[attr-defined]
        self.conn.end_stream(stream_id)
        await self.flush()

    async def send_data(self, stream_id: int, data: bytes, *, end: bool) -> None:
        view = memoryview(data)
        while view:
            window = self.conn.local_flow_control_window(stream_id)
            if window <= 0:
                # A client that opens no window for this long loses the stream, not the connection.
                with trio.move_on_after(self.service.options.send_stall_timeout) as waited:
                    await self.window_changed.wait()
                if waited.cancelled_caught:
                    raise _Stalled
                continue
            size = min(window, self.conn.max_outbound_frame_size, len(view))
            self.conn.send_data(stream_id, bytes(view[:size]), end_stream=end and size == len(view))
            view = view[size:]
            await self.flush()

    def wake_senders(self) -> None:
        self.window_changed.set()
        self.window_changed = trio.Event()

    async def receive(self) -> bytes:
        return await sockets.receive(self.stream, self.fd)

    def write_queued(self) -> None:
        """Sends what h2 queued: straight into the socket when no flush is under way and the
        kernel takes it all (no writer task to wake, no lock), else through the writer task."""
        data = self.conn.data_to_send()
        if not data:
            return
        if self.fd is not None and not self._unsent and not self.send_lock.locked():
            sent = sockets.write_now(self.fd, data)
            if sent == len(data):
                return
            data = data[sent:]
        self._unsent += data
        self.flush_soon()

    def flush_soon(self) -> None:
        """Has the writer task send what h2 queued, without waiting: responses that arrive together
        leave in one write."""
        self._write_soon.set()

    async def _writer(self) -> None:
        while True:
            await self._write_soon.wait()
            self._write_soon = trio.Event()
            await self.flush()

    async def flush(self) -> None:
        """Sends what h2 queued and waits until the socket took it (backpressure for bodies)."""
        # Take the lock before collecting bytes, so frames reach the socket in the order h2 made them.
        async with self.send_lock:
            data = self.conn.data_to_send()
            if self._unsent:
                data = bytes(self._unsent) + data
                self._unsent.clear()
            if data:
                # Shielded: a request cancelled meanwhile (its client reset it) must not cut a
                # write short, which would leave half a frame and break every other stream on
                # the connection. The stall timeout still bounds it.
                with (
                    trio.CancelScope(shield=True),
                    trio.move_on_after(self.service.options.send_stall_timeout) as waited,
                ):
                    await self.stream.send_all(data)
                if waited.cancelled_caught:
                    # The client takes nothing at all; a half-sent frame leaves only closing.
                    self.closed = True
                    self.scope.cancel()
                    await trio.lowlevel.checkpoint()


_STATUS = {status: (b":status", b"%d" % status) for status in (200, 201, 204, 304, 400, 404, 409)}
# Header pairs repeat across responses (CORS, content types, cache rules): encode each once.
_pair_cache: dict[tuple[str, str], tuple[bytes, bytes]] = {}


def _h2_header(name: str, value: str) -> tuple[bytes, bytes]:
    pair = _pair_cache.get((name, value))
    if pair is None:
        if "\r" in value or "\n" in value or "\0" in value:
            raise ValueError(f"header {name!r} holds a line break")
        pair = (name.lower().encode("latin-1"), value.encode("latin-1"))
        if len(_pair_cache) < 4096:
            _pair_cache[(name, value)] = pair
    return pair


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None
