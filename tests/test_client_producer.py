"""The idempotent producer against a real server: exactly-once through lost answers, order under
pipelining, auto-claim, gaps, JSON batching, Retry-After, closing; under trio and asyncio.

Faults come from `FaultProxy`, a TCP proxy between the client and the server that can forward a
request and then drop the connection before its answer (the server did it, the client cannot
know), hold a request back (so later ones overtake it), or answer a request itself (503, 500).
Reads go straight to the server with httpx, so what is checked is the stream itself.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import httpx
import pytest

from ops.serverproc import ServerProcess
from streamkeep.client import SequenceConflict, StaleEpoch, StreamClosed, StreamError
from streamkeep.client.client import Client
from streamkeep.client.http import RetryPolicy
from streamkeep.client.producer import IdempotentProducer, ProducerClosed, ProducerFull, Receipt
from streamkeep.client.stream import Stream

_names = itertools.count()
FAST_RETRY = RetryPolicy(attempts=6, base_delay=0.02, max_delay=0.2)


# The fault-injecting proxy ------------------------------------------------------------------


@dataclass
class Request:
    method: str
    headers: dict[str, str]
    body: bytes

    @property
    def seq(self) -> int | None:
        value = self.headers.get("producer-seq")
        return None if value is None else int(value)

    @property
    def epoch(self) -> int | None:
        value = self.headers.get("producer-epoch")
        return None if value is None else int(value)


def _parse(buffer: bytearray) -> tuple[Request, bytes] | None:
    """The first complete HTTP/1.1 request in `buffer` (removed from it) and its raw bytes."""
    head_end = buffer.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    lines = bytes(buffer[:head_end]).decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    assert "chunked" not in headers.get("transfer-encoding", ""), "the proxy reads Content-Length bodies"
    end = head_end + 4 + int(headers.get("content-length", "0"))
    if len(buffer) < end:
        return None
    raw = bytes(buffer[:end])
    del buffer[:end]
    return Request(lines[0].split(" ", 1)[0], headers, raw[head_end + 4 :]), raw


@dataclass
class FaultProxy:
    """Forwards loopback TCP to `target`, one upstream connection per client connection.

    `drop_answer(request)`: forward it, then close both sides instead of passing its answer on.
    `hold(request)`: seconds to wait before forwarding it. `answer(request)`: raw bytes to answer
    with instead of forwarding it. Each is asked once per request; `requests` lists every request
    seen, `statuses` the status line of every answer passed on."""

    target_port: int
    drop_answer: Callable[[Request], bool] = lambda request: False
    hold: Callable[[Request], float] = lambda request: 0.0
    answer: Callable[[Request], bytes | None] = lambda request: None
    requests: list[Request] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    dropped: list[Request] = field(default_factory=list)
    port: int = 0
    outstanding: int = 0  # requests received and not yet answered (or dropped)
    peak: int = 0

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        task_status.started()
        await listener.serve(self._connection)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _connection(self, client: anyio.abc.SocketStream) -> None:
        async with client, await anyio.connect_tcp("127.0.0.1", self.target_port) as upstream:
            drop_next = [False]
            async with anyio.create_task_group() as group:

                async def send(to: anyio.abc.SocketStream, data: bytes) -> None:
                    try:
                        await to.send(data)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        group.cancel_scope.cancel()

                async def up() -> None:
                    buffer = bytearray()
                    while True:
                        try:
                            chunk = await client.receive()
                        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                            group.cancel_scope.cancel()
                            return
                        buffer += chunk
                        while (parsed := _parse(buffer)) is not None:
                            request, raw = parsed
                            self.requests.append(request)
                            canned = self.answer(request)
                            if canned is not None:
                                await send(client, canned)
                                continue
                            self.outstanding += 1
                            self.peak = max(self.peak, self.outstanding)
                            delay = self.hold(request)
                            if delay:
                                await anyio.sleep(delay)
                            if self.drop_answer(request):
                                self.dropped.append(request)
                                drop_next[0] = True  # before sending: the answer may come at once
                            await send(upstream, raw)

                async def down() -> None:
                    while True:
                        try:
                            chunk = await upstream.receive()
                        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                            group.cancel_scope.cancel()
                            return
                        if drop_next[0]:
                            self.outstanding -= 1
                            group.cancel_scope.cancel()  # both sides close: no answer ever arrives
                            return
                        if chunk.startswith(b"HTTP/1.1 "):
                            self.outstanding -= 1
                            self.statuses.append(int(chunk[9:12]))
                        await send(client, chunk)

                group.start_soon(up)
                group.start_soon(down)

    def posts(self, seq: int | None = None) -> list[Request]:
        return [r for r in self.requests if r.method == "POST" and (seq is None or r.seq == seq)]


def canned(status: int, reason: str, *headers: str) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}", "Content-Length: 0", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class Once:
    """A predicate that is true for the first request matching `match` (or the first `times`)."""

    def __init__(self, match: Callable[[Request], bool], times: int = 1) -> None:
        self.match = match
        self.left = times

    def __call__(self, request: Request) -> bool:
        if self.left > 0 and self.match(request):
            self.left -= 1
            return True
        return False


class FirstOfEach:
    """True for the first POST carrying each of `seqs`, so only the first try of each is hit."""

    def __init__(self, seqs: set[int]) -> None:
        self.left = set(seqs)

    def __call__(self, request: Request) -> bool:
        if request.method == "POST" and request.seq in self.left:
            self.left.discard(request.seq)
            return True
        return False


# Helpers ------------------------------------------------------------------------------------


def new_path() -> str:
    return f"/v1/stream/producer-{next(_names)}-{uuid.uuid4().hex[:8]}"


async def create(server: ServerProcess, content_type: str = "text/plain") -> str:
    path = new_path()
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        response = await http.put(path, headers={"Content-Type": content_type})
        assert response.status_code == 201, response.text
    return path


async def read_all(server: ServerProcess, path: str) -> tuple[bytes, bool]:
    """The stream's bytes from the start (a JSON stream: its messages as one array per page),
    read straight from the server, and whether it is closed."""
    out = b""
    messages: list[Any] = []
    offset = "-1"
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        while True:
            response = await http.get(path, params={"offset": offset})
            assert response.status_code == 200, response.text
            if response.headers.get("content-type", "").startswith("application/json"):
                messages.extend(response.json())
            else:
                out += response.content
            offset = response.headers["stream-next-offset"]
            if response.headers.get("stream-up-to-date") == "true":
                closed = response.headers.get("stream-closed") == "true"
                return (json.dumps(messages).encode() if messages else out), closed


async def read_json(server: ServerProcess, path: str) -> list[Any]:
    data, _ = await read_all(server, path)
    return list(json.loads(data)) if data else []


async def raw_append(
    server: ServerProcess, path: str, data: bytes, producer: str, epoch: int, seq: int
) -> int:
    """A producer's append sent by hand (another instance of the same producer id)."""
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        response = await http.post(
            path,
            content=data,
            headers={
                "Content-Type": "text/plain",
                "Producer-Id": producer,
                "Producer-Epoch": str(epoch),
                "Producer-Seq": str(seq),
            },
        )
    return response.status_code


async def with_proxy(server: ServerProcess, body: Callable[[FaultProxy], Awaitable[None]]) -> FaultProxy:
    proxy = FaultProxy(int(server.url.rsplit(":", 1)[1]))
    async with anyio.create_task_group() as group:
        await group.start(proxy.run)
        with anyio.fail_after(30):
            await body(proxy)
        group.cancel_scope.cancel()
    return proxy


def producer(stream: Stream, name: str = "p", **options: Any) -> IdempotentProducer:
    options.setdefault("retry", FAST_RETRY)
    options.setdefault("retry_for", 0)  # the tests that spend retries spend FAST_RETRY's attempts
    return IdempotentProducer(stream, name, **options)


# Scenarios (each runs under trio below, and the main ones under asyncio too) ----------------


async def lost_answers_are_retried_with_the_same_seq_and_bytes(server: ServerProcess) -> None:
    """The answers to seq 0 and seq 2 are lost after the server wrote them: the producer sends
    each again with the same seq and the same bytes although more appends arrived meanwhile, the
    server calls the repeats duplicates, and every item is in the stream exactly once."""
    path = await create(server)

    async def body(proxy: FaultProxy) -> None:
        proxy.drop_answer = FirstOfEach({0, 2})
        async with Client(proxy.url) as client:
            stream = client.stream(path, content_type="text/plain")
            async with producer(stream, linger=0.05, max_in_flight=1) as p:
                first = [p.append(b"a"), p.append(b"b")]
                while not proxy.posts(0):  # seq 0 is out: what follows must not join it
                    await anyio.sleep(0.005)
                second = [p.append(b"c"), p.append("d")]
                await p.flush()
                third = p.append(b"e")
                await p.flush()
                assert first[0] is first[1] and second[0] is second[1]
                results = [await first[0], await second[0], await third]
                assert [r.duplicate for r in results] == [True, False, True]
                assert [r.seq for r in (first[0], second[0], third)] == [0, 1, 2]

    proxy = await with_proxy(server, body)
    assert [r.seq for r in proxy.dropped] == [0, 2]
    assert [r.body for r in proxy.posts(0)] == [b"ab", b"ab"]
    assert [r.body for r in proxy.posts(1)] == [b"cd"]
    assert [r.body for r in proxy.posts(2)] == [b"e", b"e"]
    assert proxy.statuses.count(204) == 2  # the two repeats, answered as duplicates
    assert await read_all(server, path) == (b"abcde", False)


async def pipelined_batches_keep_append_order(server: ServerProcess) -> None:
    """Five batches in flight; seq 1 is held back so later seqs overtake it and are refused with
    409: they wait for it and go again, and the stream holds every item once, in append order."""
    path = await create(server)
    items = [f"item-{i:03d}\n".encode() for i in range(60)]

    async def body(proxy: FaultProxy) -> None:
        first_seq_1 = FirstOfEach({1})
        proxy.hold = lambda r: 0.3 if first_seq_1(r) else 0.0
        async with Client(proxy.url) as client:
            stream = client.stream(path, content_type="text/plain")
            async with producer(stream, max_in_flight=5, max_batch_bytes=len(items[0]) * 2) as p:
                receipts: list[Receipt] = []
                for item in items:
                    receipts.append(p.append(item))
                    await anyio.lowlevel.checkpoint()
                await p.flush()
                seqs = [r.seq for r in dict.fromkeys(receipts)]
                assert seqs == list(range(len(seqs))) and len(seqs) >= 30  # 2 items a batch at most
                assert [(await r).duplicate for r in receipts] == [False] * len(receipts)

    proxy = await with_proxy(server, body)
    assert 409 in proxy.statuses, "no batch overtook seq 1: the test did not pipeline"
    assert 2 <= proxy.peak <= 5  # max_in_flight bounds what is out at once
    assert max(len(r.body) for r in proxy.posts()) <= len(items[0]) * 2
    assert await read_all(server, path) == (b"".join(items), False)


async def json_items_are_batched_as_one_array(server: ServerProcess) -> None:
    """Appends in one tick share a batch, sent as one JSON array; each append stays one message
    (a list, or pre-encoded text of an array, is not flattened); `max_batch_bytes` splits batches."""
    path = await create(server, "application/json")
    values: list[Any] = [{"id": 1}, [1, 2, 3], '"text"', '{"raw": true}', b"[4,5]", None, 7.5]
    expected = [{"id": 1}, [1, 2, 3], "text", {"raw": True}, [4, 5], None, 7.5]

    async def body(proxy: FaultProxy) -> None:
        async with Client(proxy.url) as client:
            stream = client.stream(path)
            async with producer(stream, linger=0.01, max_batch_bytes=40) as p:
                receipts = [p.append(v) for v in values]  # text and bytes: already JSON
                await p.flush()
                assert receipts[0] is receipts[1] and len(set(map(id, receipts))) > 1
                with pytest.raises(ValueError):
                    p.append("not json")
                with pytest.raises(TypeError):
                    p.append({1, 2})

    proxy = await with_proxy(server, body)
    posts = proxy.posts()
    assert all(len(r.body) <= 40 for r in posts) and len(posts) >= 2
    assert posts[0].body.startswith(b'[{"id":1},[1,2,3]') and posts[0].headers["content-type"].startswith(
        "application/json"
    )
    assert await read_json(server, path) == expected


async def auto_claim_takes_the_next_epoch_and_pipelines(server: ServerProcess) -> None:
    """Another instance owns epoch 5: the producer, at epoch 0 with auto_claim, is fenced, takes
    epoch 6 from seq 0, and then pipelines; everything arrives once, in order."""
    path = await create(server)
    assert await raw_append(server, path, b"fencer;", "ac", 5, 0) == 200
    items = [f"ac-{i:02d};".encode() for i in range(20)]

    async def body(proxy: FaultProxy) -> None:
        async with Client(proxy.url) as client:
            stream = client.stream(path, content_type="text/plain")
            async with producer(stream, "ac", auto_claim=True, max_in_flight=5, max_batch_bytes=6) as p:
                for item in items:
                    p.append(item)
                    await anyio.lowlevel.checkpoint()
                await p.flush()
                assert p.epoch == 6

    proxy = await with_proxy(server, body)
    stale = [r for r in proxy.posts() if r.epoch == 0]
    assert len(stale) == 1, "before the claim only one batch may be out"
    assert proxy.statuses[0] == 403 and {r.epoch for r in proxy.posts()} == {0, 6}
    assert await read_all(server, path) == (b"fencer;" + b"".join(items), False)


async def a_fenced_producer_without_auto_claim_fails_with_stale_epoch(server: ServerProcess) -> None:
    """A newer epoch owns the id: the receipt, flush and every later append raise `StaleEpoch`
    with the server's epoch, and nothing of the zombie's reaches the stream."""
    path = await create(server)
    assert await raw_append(server, path, b"new;", "z", 2, 0) == 200
    async with Client(server.url) as client:
        stream = client.stream(path, content_type="text/plain")
        with pytest.raises(StaleEpoch) as raised:
            async with producer(stream, "z", epoch=1) as p:
                receipt = p.append(b"zombie;")
                with pytest.raises(StaleEpoch) as from_receipt:
                    await receipt
                assert from_receipt.value.current_epoch == 2
                with pytest.raises(StaleEpoch):
                    p.append(b"more;")
        assert raised.value.current_epoch == 2  # leaving the block reports it (flush on close)
    assert await read_all(server, path) == (b"new;", False)


async def leaving_on_an_exception_fails_unanswered_receipts(server: ServerProcess) -> None:
    """An exception in the block stops the producer: queued appends are not sent and their
    receipts raise `ProducerClosed` instead of waiting forever."""
    path = await create(server)
    async with Client(server.url) as client:
        stream = client.stream(path, content_type="text/plain")
        p = producer(stream, linger=10)
        with pytest.raises(RuntimeError, match="boom"):
            async with p:
                receipt = p.append(b"never")
                raise RuntimeError("boom")
        with pytest.raises(ProducerClosed):
            await receipt
    assert await read_all(server, path) == (b"", False)


async def chaos_keeps_exactly_once_and_order(server: ServerProcess, seed: int = 24) -> None:
    """Pipelined batches while a seeded fault plan drops a fifth of the answers (after the server
    wrote them) and holds another fifth back: every item is in the stream once, in append order."""
    plan = random.Random(seed)
    path = await create(server)
    items = [f"c{i:03d};".encode() for i in range(150)]

    async def body(proxy: FaultProxy) -> None:
        proxy.drop_answer = lambda r: r.method == "POST" and plan.random() < 0.2
        proxy.hold = lambda r: plan.uniform(0, 0.03) if r.method == "POST" and plan.random() < 0.2 else 0.0
        async with Client(proxy.url) as client:
            stream = client.stream(path, content_type="text/plain")
            retry = RetryPolicy(attempts=20, base_delay=0.01, max_delay=0.05)
            async with producer(stream, max_in_flight=5, max_batch_bytes=15, retry=retry) as p:
                for item in items:
                    p.append(item)
                    if plan.random() < 0.5:
                        await anyio.lowlevel.checkpoint()
                await p.flush()

    proxy = await with_proxy(server, body)
    assert proxy.dropped, "the plan dropped nothing"
    assert 204 in proxy.statuses  # some repeats were answered as duplicates
    assert await read_all(server, path) == (b"".join(items), False)


# trio -----------------------------------------------------------------------------------------


async def test_a_fenced_producer_without_auto_claim_fails_with_stale_epoch(server: ServerProcess) -> None:
    await a_fenced_producer_without_auto_claim_fails_with_stale_epoch(server)


async def test_leaving_on_an_exception_fails_unanswered_receipts(server: ServerProcess) -> None:
    await leaving_on_an_exception_fails_unanswered_receipts(server)


async def test_lost_answers_are_retried_with_the_same_seq_and_bytes(server: ServerProcess) -> None:
    await lost_answers_are_retried_with_the_same_seq_and_bytes(server)


async def test_pipelined_batches_keep_append_order(server: ServerProcess) -> None:
    await pipelined_batches_keep_append_order(server)


async def test_json_items_are_batched_as_one_array(server: ServerProcess) -> None:
    await json_items_are_batched_as_one_array(server)


async def test_auto_claim_takes_the_next_epoch_and_pipelines(server: ServerProcess) -> None:
    await auto_claim_takes_the_next_epoch_and_pipelines(server)


# asyncio: the same scenarios, each on its own event loop --------------------------------------


@pytest.mark.parametrize(
    "scenario",
    [
        lost_answers_are_retried_with_the_same_seq_and_bytes,
        pipelined_batches_keep_append_order,
        json_items_are_batched_as_one_array,
        auto_claim_takes_the_next_epoch_and_pipelines,
        a_fenced_producer_without_auto_claim_fails_with_stale_epoch,
        leaving_on_an_exception_fails_unanswered_receipts,
        chaos_keeps_exactly_once_and_order,
    ],
    ids=lambda scenario: scenario.__name__,
)
def test_under_asyncio(server: ServerProcess, scenario: Callable[[ServerProcess], Awaitable[None]]) -> None:
    async def main() -> None:
        await scenario(server)

    asyncio.run(main())


# trio only ------------------------------------------------------------------------------------


async def test_a_claim_mid_stream_moves_every_unwritten_batch_to_the_new_epoch(server: ServerProcess) -> None:
    """Fenced while batches are in flight: the producer claims the epoch after the fencer's and
    writes everything that was not written, in order, once."""
    path = await create(server)
    async with Client(server.url) as client:
        stream = client.stream(path, content_type="text/plain")
        async with producer(stream, "m", auto_claim=True, max_in_flight=3, max_batch_bytes=4) as p:
            for i in range(5):
                p.append(f"a{i};".encode())
            await p.flush()
            assert await raw_append(server, path, b"B;", "m", 3, 0) == 200
            for i in range(8):
                p.append(f"c{i};".encode())
                await anyio.lowlevel.checkpoint()
            await p.flush()
            assert p.epoch == 4
    expected = "".join(f"a{i};" for i in range(5)) + "B;" + "".join(f"c{i};" for i in range(8))
    assert await read_all(server, path) == (expected.encode(), False)


async def test_a_gap_no_batch_of_ours_fills_is_a_sequence_conflict(server: ServerProcess) -> None:
    """A producer resuming at seq 3 of an epoch the server never saw: 409, the server expects 0;
    the receipt raises `SequenceConflict` with both seqs, the producer stops, nothing is written."""
    path = await create(server)
    async with Client(server.url) as client:
        stream = client.stream(path, content_type="text/plain")
        p = producer(stream, "gap", start_seq=3)
        with pytest.raises(SequenceConflict):
            async with p:
                receipt = p.append(b"x")
                with pytest.raises(SequenceConflict) as raised:
                    await receipt
                assert (raised.value.expected_seq, raised.value.received_seq) == (0, 3)
                assert isinstance(p.failure, SequenceConflict)
    assert await read_all(server, path) == (b"", False)


async def test_retry_after_is_honoured_and_server_errors_are_retried(server: ServerProcess) -> None:
    """A 503 with `Retry-After: 1` makes the producer wait a second before the same seq goes
    again; a 500, a 429 and a 507 are retried too; every item is written once."""
    path = await create(server)

    async def body(proxy: FaultProxy) -> None:
        replies = {
            0: canned(503, "Service Unavailable", "Retry-After: 1"),
            1: canned(500, "Internal Server Error"),
            2: canned(429, "Too Many Requests", "Retry-After: 0"),
            3: canned(507, "Insufficient Storage"),  # a full disk: appends resume once freed
        }
        seen: set[int] = set()

        def answer(request: Request) -> bytes | None:
            seq = request.seq
            if request.method != "POST" or seq is None or seq in seen or seq not in replies:
                return None
            seen.add(seq)
            return replies[seq]

        proxy.answer = answer
        async with Client(proxy.url) as client:
            stream = client.stream(path, content_type="text/plain")
            async with producer(stream, max_in_flight=1) as p:
                started = anyio.current_time()
                await p.append(b"0;")
                assert anyio.current_time() - started >= 0.95
                await p.append(b"1;")
                await p.append(b"2;")
                await p.append(b"3;")

    proxy = await with_proxy(server, body)
    assert [r.seq for r in proxy.posts()] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert await read_all(server, path) == (b"0;1;2;3;", False)


async def test_close_stream_closes_with_the_last_batch_and_survives_a_lost_answer(
    server: ServerProcess,
) -> None:
    """`close(close_stream=True)` with items still queued closes atomically with them; the lost
    answer to that request is repeated with the same seq and answered as the duplicate it is."""
    path = await create(server)

    async def body(proxy: FaultProxy) -> None:
        proxy.drop_answer = Once(lambda r: r.headers.get("stream-closed") == "true")
        async with Client(proxy.url) as client:
            stream = client.stream(path, content_type="text/plain")
            async with producer(stream, linger=10) as p:
                p.append(b"one;")
                p.append(b"two;")
                result = await p.close(close_stream=True)
                assert result is not None and result.closed and result.duplicate
                with pytest.raises(ProducerClosed):
                    p.append(b"late")

    proxy = await with_proxy(server, body)
    closes = [r for r in proxy.posts() if r.headers.get("stream-closed") == "true"]
    assert len(closes) == 2 and {r.body for r in closes} == {b"one;two;"} and len(proxy.posts()) == 2
    assert await read_all(server, path) == (b"one;two;", True)


async def test_close_only_after_flush_and_a_closed_stream_refuses(server: ServerProcess) -> None:
    """Closing after everything was sent takes one empty request; a second producer appending
    to the closed stream gets `StreamClosed`."""
    path = await create(server)
    async with Client(server.url) as client:
        stream = client.stream(path, content_type="text/plain")
        async with producer(stream, "first") as p:
            written = await p.append(b"data")
            result = await p.close(close_stream=True)
            assert result is not None and result.closed and not result.duplicate
            assert result.next_offset == written.next_offset  # nothing appended by the close
        with pytest.raises(StreamClosed):
            async with producer(stream, "second") as q:
                with pytest.raises(StreamClosed):
                    await q.append(b"after")
    assert await read_all(server, path) == (b"data", True)


async def test_the_content_type_is_asked_when_unknown_and_restarts_use_a_new_epoch(
    server: ServerProcess,
) -> None:
    """A handle that does not know its stream's content type learns it with HEAD; a restarted
    producer at a higher epoch writes from seq 0 while its old epoch's seqs are remembered."""
    path = await create(server, "application/json")
    async with Client(server.url) as client:
        async with client.stream(path).producer("r", retry=FAST_RETRY) as p:
            await p.append({"n": 1})
        async with client.stream(path).producer("r", epoch=1, retry=FAST_RETRY) as p:
            result = await p.append({"n": 2})
            assert result.duplicate is False and result.producer_epoch == 1
        async with client.stream(path).producer("r", epoch=1, retry=FAST_RETRY) as p:
            # same id and epoch again: the server has seq 0, so this is a duplicate (not written)
            assert (await p.append({"n": 3})).duplicate is True
    assert await read_json(server, path) == [{"n": 1}, {"n": 2}]


async def test_a_lost_answer_whose_retries_run_out_is_proven_written_by_a_later_seq(
    server: ServerProcess,
) -> None:
    """Every answer to seq 3 is lost, so its retries run out; but seq 4 was written after it,
    which the server allows only once seq 3 is there: seq 3 is reported written, not failed."""
    path = await create(server)
    items = [f"{i};".encode() for i in range(8)]

    async def body(proxy: FaultProxy) -> None:
        proxy.drop_answer = lambda r: r.method == "POST" and r.seq == 3
        first_seq_4 = FirstOfEach({4})
        proxy.hold = lambda r: 0.1 if first_seq_4(r) else 0.0  # seq 3 reaches the server first
        async with Client(proxy.url) as client:
            stream = client.stream(path, content_type="text/plain")
            async with producer(stream, max_batch_bytes=2, max_in_flight=5) as p:
                await p.append(items[0])  # the epoch is confirmed: the rest is pipelined
                receipts = [p.append(item) for item in items[1:]]
                await p.flush()
                third = await receipts[2]
                assert receipts[2].seq == 3 and third.duplicate

    proxy = await with_proxy(server, body)
    assert len(proxy.posts(3)) == FAST_RETRY.attempts + 1  # it really did run out of retries
    assert await read_all(server, path) == (b"".join(items), False)


async def test_pipelining_over_http2(server: ServerProcess) -> None:
    """Over one HTTP/2 connection the batches travel as concurrent streams; order still holds."""
    path = await create(server)
    items = [f"h2-{i:03d};".encode() for i in range(80)]
    async with Client(server.url, http2=True) as client:
        stream = client.stream(path, content_type="text/plain")
        async with producer(stream, max_batch_bytes=len(items[0]) * 3, max_in_flight=8) as p:
            receipts = []
            for item in items:
                receipts.append(p.append(item))
                await anyio.lowlevel.checkpoint()
            await p.flush()
            assert len(set(receipts)) >= 27
            assert (await receipts[-1]).next_offset is not None
    assert await read_all(server, path) == (b"".join(items), False)


async def test_data_a_stream_cannot_take_is_refused_at_append(server: ServerProcess) -> None:
    """An empty append (the server refuses an empty body) and a value that is not bytes or text
    on a byte stream raise at the call, before they could fail a whole batch."""
    path = await create(server)
    async with Client(server.url) as client:
        async with producer(client.stream(path, content_type="text/plain")) as p:
            with pytest.raises(ValueError):
                p.append(b"")
            with pytest.raises(TypeError):
                p.append({"a": 1})
            await p.append("ok")
    assert await read_all(server, path) == (b"ok", False)


async def test_chaos_keeps_exactly_once_and_order(server: ServerProcess) -> None:
    await chaos_keeps_exactly_once_and_order(server)


async def test_a_batch_fenced_on_its_retry_is_not_sent_again_when_a_later_seq_proves_it(
    server: ServerProcess,
) -> None:
    """Seq 1 is written but its answer lost; seq 2 is written after it; then another instance
    fences the epoch, so seq 1's retry is refused with 403. Seq 2's success proves seq 1 is in
    the stream: the claim must not send it again (exactly once, even across the claim)."""
    path = await create(server)

    def hold(request: Request) -> float:
        if request.method == "POST" and request.seq == 2 and len(proxy_ref[0].posts(2)) == 1:
            return 0.05  # seq 1 reaches the server first
        if request.method == "POST" and request.seq == 1 and len(proxy_ref[0].posts(1)) == 2:
            return 0.4  # the retry of seq 1 arrives after the fence
        return 0.0

    proxy_ref: list[FaultProxy] = []

    async def body(proxy: FaultProxy) -> None:
        proxy_ref.append(proxy)
        proxy.drop_answer = FirstOfEach({1})
        proxy.hold = hold
        async with Client(proxy.url) as client:
            stream = client.stream(path, content_type="text/plain")
            async with producer(stream, "pf", auto_claim=True, max_batch_bytes=2, linger=0) as p:
                await p.append(b"0;")
                first, second = p.append(b"1;"), p.append(b"2;")
                await second
                assert await raw_append(server, path, b"F;", "pf", 5, 0) == 200
                assert (await first).duplicate
                await p.append(b"3;")
                assert p.epoch == 6

    proxy = await with_proxy(server, body)
    assert [r.epoch for r in proxy.posts(1)] == [0, 0]  # never sent in the claimed epoch
    assert await read_all(server, path) == (b"0;1;2;F;3;", False)


async def test_json_the_server_refuses_is_refused_at_append(server: ServerProcess) -> None:
    """NaN/Infinity (Python's json extension, as values or as text), a byte order mark and
    non-UTF-8 text are refused at `append`: the server would refuse the whole batch with 400 and
    stop the producer, failing the good appends that shared the batch."""
    path = await create(server, "application/json")
    async with Client(server.url) as client:
        async with producer(client.stream(path, content_type="application/json"), linger=0.05) as p:
            good = p.append({"ok": 1})
            for bad in (
                {"v": float("nan")},
                [float("-inf")],
                "NaN",
                b"-Infinity",
                b'\xef\xbb\xbf{"a":1}',
                "\ufeff1",
                '{"a":1}'.encode("utf-16"),
            ):
                with pytest.raises(ValueError):
                    p.append(bad)
            last = p.append('{"ok":2}')
            await p.flush()
            assert (await good).status == 200 and await last == await good
    assert await read_json(server, path) == [{"ok": 1}, {"ok": 2}]


async def test_a_204_to_a_first_try_is_another_writer_with_auto_claim_and_a_replay_without(
    server: ServerProcess,
) -> None:
    """Another instance wrote seqs 0..2 at epoch 0. An auto-claiming producer starting at epoch 0
    is answered 204 on the FIRST try of seq 0: no try of its own can have written that, so its
    items are not in the stream; it claims epoch 1 and writes them (before: three 204s counted
    written, the items lost). One that starts at an epoch someone else already took is moved past
    it the same way. Without auto_claim the same 204 is a restarted producer's replay of what it
    wrote before (upstream's client-deduplication-works): counted written, nothing added."""
    path = await create(server)
    for seq, item in enumerate((b"a0", b"a1", b"a2")):
        assert await raw_append(server, path, item, "p", 0, seq) == 200
    async with Client(server.url) as client:
        stream = client.stream(path, content_type="text/plain")
        async with producer(stream, auto_claim=True, linger=0) as p:
            receipts = [p.append(b"b0"), p.append(b"b1")]
            await p.flush()
            receipts.append(p.append(b"b2"))
            results = [await r for r in receipts]
        assert p.epoch == 1 and [r.duplicate for r in results] == [False] * 3
        assert await raw_append(server, path, b"c0", "p", 2, 0) == 200  # another instance takes epoch 2
        async with producer(stream, epoch=2, auto_claim=True) as p:
            assert not (await p.append(b"d0")).duplicate
        assert p.epoch == 3
        # A restart without auto_claim re-sending what epoch 3 wrote: the server's dedup answers.
        async with producer(stream, epoch=3) as p:
            assert (await p.append(b"d0")).duplicate
    assert await read_all(server, path) == (b"a0a1a2b0b1b2c0d0", False)


async def test_client_deduplication_works_for_a_restarted_json_producer(server: ServerProcess) -> None:
    """Upstream's client-deduplication-works: a new instance at the same epoch re-sending the same
    items is deduplicated by the server and every append succeeds."""
    path = await create(server, "application/json")
    async with Client(server.url) as client:
        stream = client.stream(path, content_type="application/json")
        for expect_duplicate in (False, True):
            async with producer(stream, "dedup-test-producer", linger=0.05) as p:
                receipts = [p.append('{"msg": "first"}'), p.append('{"msg": "second"}')]
                await p.flush()
                assert [(await r).duplicate for r in receipts] == [expect_duplicate] * 2
    assert await read_json(server, path) == [{"msg": "first"}, {"msg": "second"}]


async def test_sends_are_retried_for_retry_for_seconds_beyond_the_attempts(server: ServerProcess) -> None:
    """The server is unavailable (503, connections refused in a restart look the same) for
    0.8 s, longer than the policy's 2 attempts last: with `retry_for` the batch keeps going and is
    written once; with a budget shorter than the outage it fails after both are spent. Before,
    the attempts alone decided and the producer stopped for good after about 50 ms."""
    path = await create(server)
    policy = RetryPolicy(attempts=2, base_delay=0.02, max_delay=0.05)

    async def body(proxy: FaultProxy) -> None:
        until = anyio.current_time() + 0.8

        def answer(request: Request) -> bytes | None:
            if request.method == "POST" and anyio.current_time() < until:
                return canned(503, "Service Unavailable")
            return None

        proxy.answer = answer
        async with Client(proxy.url) as client:
            stream = client.stream(path, content_type="text/plain")
            async with producer(stream, retry=policy, retry_for=5.0) as p:
                assert (await p.append(b"x")).status == 200
            assert anyio.current_time() >= until
            until = anyio.current_time() + 2.0
            async with producer(stream, "q", retry=policy, retry_for=0.3) as p:
                started = anyio.current_time()
                with pytest.raises(StreamError) as caught:
                    await p.append(b"y")
                assert caught.value.status == 503 and 0.3 <= anyio.current_time() - started < 1.5
                with pytest.raises(StreamError):
                    await p.close()

    proxy = await with_proxy(server, body)
    assert len(proxy.posts()) > 3
    assert await read_all(server, path) == (b"x", False)


async def test_unwritten_appends_are_bounded_by_max_buffered_bytes(server: ServerProcess) -> None:
    """A producer faster than its server held every unwritten append in memory (the review's
    340 MiB): past `max_buffered_bytes` `append` raises `ProducerFull` and `send` waits until a
    batch is written, and a written batch's bytes are not kept alive by its receipt."""
    path = await create(server)
    async with Client(server.url) as client:
        stream = client.stream(path, content_type="text/plain")
        async with producer(stream, linger=10, max_buffered_bytes=10) as p:
            first = p.append(b"aaaaaa")
            with pytest.raises(ProducerFull):
                p.append(b"bbbbbb")
            sent: list[Receipt] = []

            async def send_later() -> None:
                sent.append(await p.send(b"bbbbbb"))

            async with anyio.create_task_group() as group:
                group.start_soon(send_later)
                await anyio.sleep(0.1)
                assert not sent  # waiting for room: the first batch lingers, unwritten
                await p.flush()
            assert (await first).status == 200 and first._batch.body == b""
            await p.flush()
            assert (await sent[0]).status == 200
            big = p.append(b"c" * 20)  # larger than the bound, taken when nothing else is held
            await p.flush()
            assert (await big).status == 200
    assert await read_all(server, path) == (b"aaaaaabbbbbb" + b"c" * 20, False)


async def test_pipelined_batches_over_http2_do_not_stall_on_flow_control(server: ServerProcess) -> None:
    """httpcore stalls concurrent HTTP/2 uploads that wait for a flow-control window until its
    read timeout (32 KiB batches, several in flight). Over HTTP/2 the producer keeps the bodies in
    flight within the default window, so with no retries allowed every batch still goes through."""
    path = await create(server)
    async with Client(server.url, http2=True, timeout=5, retries=0) as client:
        stream = client.stream(path, content_type="text/plain")
        async with producer(
            stream, max_batch_bytes=32 << 10, retry=RetryPolicy(attempts=0), linger=0.001
        ) as p:
            for n in range(3000):
                await p.send(b"%099d;" % n)
            await p.flush()
    assert await read_all(server, path) == (b"".join(b"%099d;" % n for n in range(3000)), False)
