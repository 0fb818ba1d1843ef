"""The request path's shortcuts (issue 15) keep the promises of the long way round.

- An append, read or HEAD runs in the caller's task only when the stream's actor is idle with
  nothing queued, so it never overtakes a message and the actor stays the stream's one writer.
- A handler that would have to wait (an expired stream to remove) falls back to the mailbox
  before it changes anything.
- Idle keep-alive connections are closed by one sweeper, not a timer per request.
- HTTP/2: requests are checked by our own header rules (h2's are off) and refused per stream;
  responses are HPACK-encoded with remembered index bytes that must decode to what was sent.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator

import h2.config
import h2.connection
import h2.errors
import h2.events
import hpack
import httpx
import pytest
import trio
import trio.testing

from ops.serverproc import ServerProcess, start
from streamkeep.actors.mailbox import NotNow
from streamkeep.actors.messages import Append, Create, Read
from streamkeep.actors.stream_ops import HANDLERS, StreamOps
from streamkeep.actors.supervisor import Supervisor
from streamkeep.http.edge import Connections
from streamkeep.http.h2_encoder import ResponseEncoder
from streamkeep.http.h2_validate import malformed
from streamkeep.protocol.cors import Cors
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.model import Headers
from streamkeep.protocol.stream import AppendSpec, CreateSpec
from streamkeep.storage.memory import MemoryStorage


def new_supervisor(nursery: trio.Nursery) -> Supervisor:
    return Supervisor(MemoryStorage(max_stream_bytes=1 << 20, max_total_bytes=1 << 22), nursery)


def append(body: bytes) -> Append:
    return Append(AppendSpec.from_request(Headers([("Content-Type", "text/plain")]), body))


async def test_a_direct_call_never_overtakes_a_queued_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the actor is busy or has messages queued, `call_now` refuses; appends sent through
    the mailbox and appends that arrive later land in the order they were made."""
    gate = trio.Event()
    original = HANDLERS[Create]

    async def slow_create(ops: StreamOps, message: Create) -> object:
        await gate.wait()
        return await original(ops, message)

    async with trio.open_nursery() as nursery:
        supervisor = new_supervisor(nursery)
        create = CreateSpec.from_request(Headers([("Content-Type", "text/plain")]), b"")
        await supervisor.call("s", Create(create), must_exist=False)
        assert supervisor.call_now("s", append(b"a")).commit.done  # idle: taken at once
        monkeypatch.setitem(HANDLERS, Create, slow_create)
        nursery.start_soon(supervisor.call, "s", Create(create))  # the actor is busy with this one
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(NotNow):
            supervisor.call_now("s", append(b"x"))
        order: list[bytes] = []

        async def send(body: bytes) -> None:
            await (await supervisor.call("s", append(body))).wait()
            order.append(body)

        nursery.start_soon(send, b"b")  # queued behind the slow create
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(NotNow):
            supervisor.call_now("s", append(b"x"))
        gate.set()
        # Step through every point of the actor's way from the create to "b" (including the
        # moment it has taken "b" from the mailbox but not begun it): wherever a direct call is
        # taken, it must land after "b".
        direct = []
        for step in range(100):
            await trio.lowlevel.checkpoint()
            try:
                supervisor.call_now("s", append(b"c%02d" % step))
            except NotNow:
                continue
            direct.append(b"c%02d" % step)
        await trio.testing.wait_all_tasks_blocked()
        assert order == [b"b"] and direct
        plan = await supervisor.call("s", Read("-1", True))
        read = await plan.log.read(0, 1 << 16, whole_messages=False)
        assert b"".join(read.messages) == b"ab" + b"".join(direct)
        nursery.cancel_scope.cancel()


async def test_an_expired_stream_goes_the_long_way_and_is_removed() -> None:
    async with trio.open_nursery() as nursery:
        supervisor = new_supervisor(nursery)
        create = CreateSpec.from_request(Headers([("Content-Type", "text/plain"), ("Stream-TTL", "60")]), b"")
        await supervisor.call("s", Create(create), must_exist=False)
        log = supervisor.storage.open("s")
        assert log is not None
        log.meta.last_access -= 120  # expired a minute ago
        with pytest.raises(NotNow):
            supervisor.call_now("s", append(b"late"))
        assert supervisor.storage.open("s") is log, "the direct call changed nothing"
        with pytest.raises(ProtocolError) as refused:
            await supervisor.call("s", append(b"late"))
        assert refused.value.status == 404
        assert supervisor.storage.open("s") is None
        nursery.cancel_scope.cancel()


async def test_idle_connections_close_after_the_keep_alive_timeout_and_busy_ones_do_not(
    autojump_clock: trio.testing.MockClock,
) -> None:
    connections = Connections()
    ended: dict[str, float] = {}

    async def connection(name: str, idle: bool) -> None:
        with trio.CancelScope() as scope:
            if idle:
                connections.waiting(scope)
            await trio.sleep(1000)
        ended[name] = trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(connections.close_idle, 10.0)
        started = trio.current_time()
        nursery.start_soon(connection, "idle", True)
        nursery.start_soon(connection, "busy", False)
        await trio.sleep(20)
        assert set(ended) == {"idle"}
        assert 10 <= ended["idle"] - started <= 12.5 + 1e-6  # within a quarter of the timeout
        nursery.cancel_scope.cancel()


def test_hpack_with_remembered_indices_decodes_to_what_was_sent() -> None:
    rng = random.Random(1501)
    constant = [(n.lower().encode(), v.encode()) for n, v in Cors("*").headers(None)]
    constant.append((b"content-security-policy", b"sandbox"))
    encoder, decoder = ResponseEncoder(), hpack.Decoder()
    for i in range(5000):
        headers = [(b":status", rng.choice([b"200", b"204", b"404"])), (b"stream-next-offset", b"%033d" % i)]
        headers += rng.sample(constant, rng.randint(0, len(constant)))
        if rng.random() < 0.1:  # a new header inserted into the table moves every index
            headers.append((b"x-%d" % rng.randint(0, 200), b"v%d" % rng.randint(0, 500)))
        if rng.random() < 0.01:
            encoder.header_table_size = decoder.header_table_size = rng.choice([0, 256, 4096])
        decoded = [tuple(pair) for pair in decoder.decode(encoder.encode(headers), raw=True)]
        assert decoded == headers, f"response {i}"
    # Per-response values never enter the table, so the constant ones stay indexed.
    assert all(name != b"stream-next-offset" for name, _ in encoder.header_table.dynamic_entries)


GOOD = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/v1/stream/a"), (b":authority", b"h")]


@pytest.mark.parametrize(
    "headers",
    [
        [*GOOD, (b"Content-Type", b"text/plain")],  # upper case
        [*GOOD, (b"content-type", b"text/plain\r\nx: y")],  # CR LF in a value
        [*GOOD, (b"content-type", b" text/plain")],  # surrounding whitespace
        [*GOOD, (b"connection", b"keep-alive")],  # connection-specific
        [*GOOD, (b"te", b"gzip")],
        [*GOOD, (b"x:y", b"1")],  # a colon in a name
        [*GOOD, (b"", b"1")],  # empty name
        [*GOOD, (b":status", b"200")],  # a response pseudo-header
        [(b"content-type", b"text/plain"), *GOOD],  # pseudo-headers after a regular one
        [*GOOD, (b":path", b"/again")],  # repeated
        GOOD[:2] + GOOD[3:],  # no :path
        [*GOOD, (b"host", b"other")],  # :authority and host disagree
    ],
)
def test_malformed_h2_requests_are_recognised(headers: list[tuple[bytes, bytes]]) -> None:
    assert malformed(headers) is not None


def test_well_formed_h2_requests_pass() -> None:
    assert malformed([*GOOD, (b"content-type", b"text/plain"), (b"te", b"trailers"), (b"host", b"h")]) is None
    assert malformed([(b":method", b"CONNECT"), (b":authority", b"h:1")]) is None


@pytest.fixture(scope="module")
def lean_server() -> Iterator[ServerProcess]:
    server = start("--storage", "memory", "--edge", "lean")
    yield server
    server.stop()


def test_a_malformed_h2_request_resets_its_stream_and_the_connection_goes_on(
    lean_server: ServerProcess,
) -> None:
    path = f"/v1/stream/fast-{time.time_ns()}"
    assert httpx.put(lean_server.url + path, headers={"Content-Type": "text/plain"}).status_code == 201
    config = h2.config.H2Configuration(
        client_side=True,
        header_encoding=None,
        validate_outbound_headers=False,
        normalize_outbound_headers=False,
    )
    conn = h2.connection.H2Connection(config)
    conn.initiate_connection()
    request = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"x"), (b":path", path.encode())]
    conn.send_headers(1, [*request, (b"Content-Type", b"text/plain")], end_stream=True)  # upper case
    conn.send_headers(3, [*request, (b"connection", b"close"), (b"content-type", b"text/plain")])
    conn.send_data(3, b"never", end_stream=True)
    conn.send_headers(5, [*request, (b"content-type", b"text/plain")])
    conn.send_data(5, b"kept", end_stream=True)
    host, port = lean_server.url.removeprefix("http://").rsplit(":", 1)
    resets: dict[int, int] = {}
    statuses: dict[int, bytes] = {}
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(conn.data_to_send())
        deadline = time.monotonic() + 8
        while (len(resets) < 2 or 5 not in statuses) and time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.StreamReset):
                    resets[event.stream_id] = event.error_code
                elif isinstance(event, h2.events.ResponseReceived):
                    statuses[event.stream_id] = dict(event.headers)[b":status"]
            sock.sendall(conn.data_to_send())
    assert resets == {1: h2.errors.ErrorCodes.PROTOCOL_ERROR, 3: h2.errors.ErrorCodes.PROTOCOL_ERROR}
    assert statuses == {5: b"204"}
    assert httpx.get(f"{lean_server.url}{path}?offset=-1").content == b"kept"


def test_pipelined_http11_appends_are_answered_in_order(lean_server: ServerProcess) -> None:
    """Requests already parsed from one read are answered one by one, each after a checkpoint."""
    path = f"/v1/stream/pipe-{time.time_ns()}"
    assert httpx.put(lean_server.url + path, headers={"Content-Type": "text/plain"}).status_code == 201
    host, port = lean_server.url.removeprefix("http://").rsplit(":", 1)
    count = 60
    burst = b"".join(
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n\r\n%03d"
        % (path.encode(), i)
        for i in range(count)
    )
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(burst)
        received = b""
        deadline = time.monotonic() + 8
        while received.count(b"HTTP/1.1 204") < count and time.monotonic() < deadline:
            received += sock.recv(65536)
    offsets = [
        int(line.split(b"_")[1])
        for line in received.split(b"\r\n")
        if line.lower().startswith(b"stream-next-offset:")
    ]
    assert offsets == [3 * (i + 1) for i in range(count)]
    body = httpx.get(f"{lean_server.url}{path}?offset=-1").content
    assert body == b"".join(b"%03d" % i for i in range(count))
