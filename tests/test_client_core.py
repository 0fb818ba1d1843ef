"""streamkeep.client against a real server: the stream operations, the typed errors, the transport's
retry rules (Retry-After honoured; a non-idempotent request never repeated after it may have
happened), HTTP/2, and the same code under asyncio as under trio."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from ops.serverproc import ServerProcess
from streamkeep.client import (
    BadRequest,
    Client,
    Conflict,
    ConnectionFailed,
    IdempotentProducer,
    RetryPolicy,
    SequenceConflict,
    StaleEpoch,
    StreamClosed,
    StreamError,
    StreamExists,
    StreamGone,
    StreamNotFound,
    Unauthorized,
    Unavailable,
)
from streamkeep.client.errors import error_for, retry_after_seconds
from streamkeep.client.http import HttpTransport
from streamkeep.client.stream import encode_body, stream_path
from streamkeep.client.sync import Client as SyncClient

_names = itertools.count()
ROOT = Path(__file__).resolve().parent.parent


def fresh(prefix: str = "client") -> str:
    return f"{prefix}/{next(_names)}-{time.monotonic_ns()}"


@pytest.fixture(params=["http/1.1", "h2c"])
async def client(request: pytest.FixtureRequest, server: ServerProcess) -> AsyncIterator[Client]:
    async with Client(server.url, http2=request.param == "h2c", retries=RetryPolicy(attempts=2)) as c:
        yield c


async def test_create_append_read_head_delete_round_trip(client: Client) -> None:
    stream = client.stream(fresh())
    info = await stream.create(content_type="text/plain")
    assert info.created and info.content_type == "text/plain" and not info.closed
    again = await stream.create(content_type="text/plain")
    assert not again.created  # same configuration: 200, idempotent
    first = await stream.append("hello ")
    second = await stream.append(b"world")
    assert first.next_offset is not None and second.next_offset is not None
    assert first.next_offset < second.next_offset  # offsets sort lexicographically
    batches = await stream.read_all()
    assert b"".join(b.data for b in batches) == b"hello world"
    assert batches[-1].up_to_date and batches[-1].next_offset == second.next_offset
    head = await stream.head()
    assert head.next_offset == second.next_offset and not head.closed
    assert await stream.exists()
    await stream.delete()
    assert not await stream.exists()
    with pytest.raises(StreamNotFound) as caught:
        await stream.append("more")
    assert caught.value.status == 404 and caught.value.code == "stream_not_found"


async def test_http2_is_spoken_when_asked(server: ServerProcess) -> None:
    async with Client(server.url, http2=True) as client:
        stream = client.stream(fresh())
        await stream.create(content_type="text/plain")
        response = await client.transport.request("HEAD", stream.path)
        assert response.http_version == "HTTP/2"
    async with Client(server.url) as client:
        response = await client.transport.request("HEAD", stream.path)
        assert response.http_version == "HTTP/1.1"


async def test_create_with_other_configuration_is_stream_exists(client: Client) -> None:
    stream = client.stream(fresh())
    await stream.create(content_type="text/plain")
    with pytest.raises(StreamExists) as caught:
        await stream.create(content_type="application/json")
    assert caught.value.status == 409 and isinstance(caught.value, Conflict)


async def test_ttl_and_expiry_are_sent_and_read_back(client: Client) -> None:
    with_ttl = client.stream(fresh())
    await with_ttl.create(content_type="text/plain", ttl=timedelta(hours=1))
    assert (await with_ttl.head()).ttl == 3600
    expiring = client.stream(fresh())
    when = datetime(2099, 1, 1, tzinfo=UTC)
    await expiring.create(content_type="text/plain", expires_at=when)
    expires = (await expiring.head()).expires_at
    assert expires is not None and expires.startswith("2099-01-01T00:00:00")
    with pytest.raises(BadRequest):
        await client.stream(fresh()).create(ttl=60, expires_at=when)


async def test_json_values_are_one_message_each_and_raw_arrays_flatten(client: Client) -> None:
    stream = client.stream(fresh())
    await stream.create(content_type="application/json")
    await stream.append({"n": 1})
    await stream.append([1, 2])  # a Python list is one message
    await stream.append(b'[{"n": 2}, {"n": 3}]')  # raw JSON: the server flattens the array
    messages = [m async for m in stream.messages()]
    assert messages == [{"n": 1}, [1, 2], {"n": 2}, {"n": 3}]


async def test_append_learns_the_content_type_of_a_stream_it_did_not_create(
    client: Client, server: ServerProcess
) -> None:
    name = fresh()
    await client.stream(name).create(content_type="text/csv")
    async with Client(server.url) as other:
        stream = other.stream(name)
        assert stream.content_type is None
        await stream.append("a,b\n")
        assert stream.content_type == "text/csv"
    assert b"".join(b.data for b in await client.stream(name).read_all()) == b"a,b\n"


async def test_close_then_append_is_stream_closed_with_the_final_offset(client: Client) -> None:
    stream = client.stream(fresh())
    await stream.create(content_type="text/plain")
    last = await stream.append("final", close=True)
    assert last.closed
    again = await stream.close()  # closing a closed stream succeeds
    assert again.closed and again.next_offset == last.next_offset
    with pytest.raises(StreamClosed) as caught:
        await stream.append("too late")
    assert caught.value.final_offset == last.next_offset
    batches = await stream.read_all()
    assert batches[-1].closed and b"".join(b.data for b in batches) == b"final"
    assert (await stream.head()).closed


async def test_created_closed_with_a_body(client: Client) -> None:
    stream = client.stream(fresh())
    info = await stream.create(content_type="text/plain", body="all of it", closed=True)
    assert info.closed
    batches = await stream.read_all()
    assert b"".join(b.data for b in batches) == b"all of it" and batches[-1].closed


async def test_stream_seq_regression_is_a_conflict(client: Client) -> None:
    stream = client.stream(fresh())
    await stream.create(content_type="text/plain")
    await stream.append("a", seq="0002")
    with pytest.raises(Conflict) as caught:
        await stream.append("b", seq="0001")
    assert caught.value.status == 409
    assert not isinstance(caught.value, (StreamClosed, SequenceConflict))


async def test_fork_reads_the_source_up_to_the_fork_offset(client: Client) -> None:
    source = client.stream(fresh())
    await source.create(content_type="text/plain")
    middle = await source.append("one,")
    await source.append("two")
    fork = client.stream(fresh())
    info = await fork.create(fork_of=source, fork_offset=middle.next_offset)
    assert info.created and info.content_type == "text/plain"
    await fork.append("three")
    assert b"".join(b.data for b in await fork.read_all()) == b"one,three"
    await source.delete()  # the fork still reads it: soft-deleted, 410 to clients
    with pytest.raises(StreamGone) as caught:
        await source.head()
    assert caught.value.status == 410
    with pytest.raises(StreamGone):
        await source.read_all()


async def test_a_producer_header_conflict_and_a_stale_epoch_are_typed(client: Client) -> None:
    stream = client.stream(fresh())
    await stream.create(content_type="text/plain")

    def producer(epoch: int, seq: int) -> dict[str, str]:
        return {"Producer-Id": "p", "Producer-Epoch": str(epoch), "Producer-Seq": str(seq)}

    first = await stream.append("a", headers=producer(1, 0))
    assert first.status == 200 and not first.duplicate and first.producer_seq == 0
    duplicate = await stream.append("a", headers=producer(1, 0))
    assert duplicate.duplicate and duplicate.status == 204
    with pytest.raises(SequenceConflict) as gap:
        await stream.append("c", headers=producer(1, 5))
    assert gap.value.expected_seq == 1 and gap.value.received_seq == 5
    with pytest.raises(StaleEpoch) as stale:
        await stream.append("z", headers=producer(0, 0))
    assert stale.value.current_epoch == 1 and stale.value.status == 403


async def test_a_signed_link_keeps_its_query_on_every_request(server: ServerProcess) -> None:
    seen: list[httpx.URL] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url)
        headers = {"Stream-Next-Offset": "0_5", "Stream-Up-To-Date": "true", "Content-Type": "text/plain"}
        return httpx.Response(200, headers=headers, content=b"hello")

    async with Client("http://ignored", transport=httpx.MockTransport(handler)) as client:
        stream = client.stream("https://streams.example/v1/stream/a?signed=v1.k.9.mac")
        batches = await stream.read_all()
    assert batches[0].data == b"hello"
    assert seen[0].host == "streams.example" and seen[0].params["signed"] == "v1.k.9.mac"
    assert list(seen[0].params.keys()) == ["offset", "signed"]  # sorted, for CDN keys


async def test_stream_producer_builds_an_idempotent_producer(client: Client) -> None:
    stream = client.stream(fresh())
    await stream.create(content_type="application/json")
    producer = stream.producer("maker", epoch=2)
    assert isinstance(producer, IdempotentProducer) and producer.epoch == 2
    async with producer:
        receipt = producer.append({"made": True})
    assert (await receipt).next_offset is not None
    assert [m async for m in stream.messages()] == [{"made": True}]


@pytest.mark.parametrize("name", ["a/../../admin", "..", ".", "a/./b", "a//b", "", "a/"])
def test_stream_names_that_would_leave_the_stream_prefix_are_refused(name: str) -> None:
    with pytest.raises(ValueError):
        stream_path(name)


def test_backoff_does_not_overflow_after_many_attempts() -> None:
    policy = RetryPolicy(base_delay=0.05, max_delay=5.0)
    assert 0.0 <= policy.wait(5000) <= 5.0


def test_stream_path_encodes_names_and_keeps_paths() -> None:
    assert stream_path("chat/room 1") == "/v1/stream/chat/room%201"
    assert stream_path("/other/x") == "/other/x"
    assert encode_body({"a": 1}) == (b'[{"a":1}]', "application/json")
    assert encode_body("é") == ("é".encode(), None)
    with pytest.raises(ValueError):  # NaN and Infinity are not JSON: refused before sending
        encode_body({"x": float("inf")})


# -- the error mapping ------------------------------------------------------------------------


def test_error_mapping_reads_the_protocol_headers() -> None:
    gone = error_for(410, {"Stream-Earliest-Offset": "0_42"}, b'{"error":{"code":"x","message":"m"}}')
    assert isinstance(gone, StreamGone) and gone.earliest_offset == "0_42" and gone.code == "x"
    assert gone.message == "m"
    gap = error_for(409, {"Producer-Expected-Seq": "3", "Producer-Received-Seq": "7"}, method="POST")
    assert isinstance(gap, SequenceConflict) and (gap.expected_seq, gap.received_seq) == (3, 7)
    assert isinstance(error_for(409, {}, method="PUT"), StreamExists)
    assert isinstance(error_for(409, {"Stream-Closed": "true"}, method="POST"), StreamClosed)
    assert isinstance(error_for(403, {"Producer-Epoch": "4"}), StaleEpoch)
    assert isinstance(error_for(403, {}), Unauthorized)
    assert isinstance(error_for(401, {}), Unauthorized)
    busy = error_for(429, {"Retry-After": "3"})
    assert isinstance(busy, Unavailable) and busy.retry_after == 3.0
    assert error_for(500, {}, b"boom").message == "boom"


def test_retry_after_as_an_http_date() -> None:
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0
    # asctime (RFC 9110's third date form) has no zone: HTTP dates are UTC.
    assert retry_after_seconds("Wed Oct 21 07:28:10 2015", now=1445412480.0) == 10.0
    assert retry_after_seconds("soon") is None
    assert retry_after_seconds(None) is None


# -- retries ----------------------------------------------------------------------------------


def _refusing(statuses: list[tuple[int, dict[str, str]]]) -> tuple[list[float], httpx.MockTransport]:
    """A transport answering the given refusals in turn, then 204."""
    times: list[float] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        times.append(time.monotonic())
        if len(times) <= len(statuses):
            status, headers = statuses[len(times) - 1]
            # not_ready: a refusal before any work, which even a plain append may repeat.
            return httpx.Response(
                status, headers=headers, json={"error": {"code": "not_ready", "message": "m"}}
            )
        return httpx.Response(204, headers={"Stream-Next-Offset": "0_1"})

    return times, httpx.MockTransport(handler)


async def test_503_and_429_are_retried_after_retry_after() -> None:
    times, mock = _refusing([(503, {"Retry-After": "1"}), (429, {"Retry-After": "1"})])
    async with Client("http://mock", transport=mock) as client:
        result = await client.stream("s", content_type="text/plain").append("x")
    assert result.next_offset == "0_1" and len(times) == 3
    assert times[1] - times[0] >= 1.0 and times[2] - times[1] >= 1.0


async def test_refusals_past_the_retries_raise_unavailable_with_retry_after() -> None:
    times, mock = _refusing([(503, {"Retry-After": "0"})] * 10)
    async with Client("http://mock", transport=mock, retries=2) as client:
        with pytest.raises(Unavailable) as caught:
            await client.stream("s", content_type="text/plain").append("x")
    assert len(times) == 3 and caught.value.retry_after == 0.0 and caught.value.status == 503


async def test_a_503_that_happened_is_not_repeated_for_a_plain_append() -> None:
    times: list[float] = []

    async def not_durable(request: httpx.Request) -> httpx.Response:
        times.append(time.monotonic())
        return httpx.Response(503, json={"error": {"code": "not_durable", "message": "done, not durable"}})

    async with Client("http://mock", transport=httpx.MockTransport(not_durable)) as client:
        with pytest.raises(Unavailable):
            await client.stream("s", content_type="text/plain").append("x")
    assert len(times) == 1


async def test_a_broken_connection_repeats_only_what_is_idempotent() -> None:
    calls: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        if len(calls) % 2 == 1:
            raise httpx.ReadError("connection reset", request=request)
        return httpx.Response(200, headers={"Stream-Next-Offset": "0_1", "Producer-Seq": "0"})

    async with Client("http://mock", transport=httpx.MockTransport(handler), retries=3) as client:
        stream = client.stream("s", content_type="text/plain")
        with pytest.raises(ConnectionFailed):
            await stream.append("plain")  # may have happened: not repeated
        assert calls == ["POST"]
        calls.clear()
        result = await stream.append(
            "idempotent", headers={"Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "0"}
        )
        assert result.producer_seq == 0 and calls == ["POST", "POST"]
        calls.clear()
        await stream.head()
        assert calls == ["HEAD", "HEAD"]


async def test_server_errors_are_retried_only_for_idempotent_requests() -> None:
    calls: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        if len(calls) == 1:
            return httpx.Response(502, text="bad gateway")
        return httpx.Response(200, headers={"Content-Type": "text/plain", "Stream-Next-Offset": "0_1"})

    async with Client("http://mock", transport=httpx.MockTransport(handler)) as client:
        stream = client.stream("s")
        await stream.head()
        assert calls == ["HEAD", "HEAD"]
        calls.clear()
        with pytest.raises(StreamError) as caught:
            await stream.append("x")  # a 500-class answer to a plain append may have appended
        assert caught.value.status == 502 and calls == ["POST"]


async def test_a_connection_never_opened_is_retried_for_any_method() -> None:
    calls: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(204, headers={"Stream-Next-Offset": "0_1"})

    async with Client("http://mock", transport=httpx.MockTransport(handler)) as client:
        await client.stream("s", content_type="text/plain").append("x")
    assert calls == ["POST", "POST"]


async def test_token_and_dynamic_headers_are_sent_on_each_request() -> None:
    seen: list[httpx.Headers] = []
    counter = itertools.count()

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, headers={"Content-Type": "text/plain", "Stream-Next-Offset": "0_0"})

    async def rotating() -> dict[str, str]:
        return {"X-Request": str(next(counter))}

    transport = HttpTransport(
        "http://mock", token="t0k", headers=rotating, transport=httpx.MockTransport(handler)
    )
    async with transport:
        await transport.request("HEAD", "/v1/stream/a")
        await transport.request("HEAD", "/v1/stream/a")
    assert [h["authorization"] for h in seen] == ["Bearer t0k", "Bearer t0k"]
    assert [h["x-request"] for h in seen] == ["0", "1"]


def _counting(status: int, code: str) -> tuple[list[str], httpx.MockTransport]:
    """A transport refusing every request with `status` and the server error `code`."""
    calls: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        return httpx.Response(
            status, headers={"Retry-After": "0"}, json={"error": {"code": code, "message": "m"}}
        )

    return calls, httpx.MockTransport(handler)


@pytest.mark.parametrize(
    "code", ["owner_unavailable", "not_durable", "storage_unavailable", "member_unavailable"]
)
async def test_a_plain_append_is_not_repeated_after_a_503_that_may_have_done_it(code: str) -> None:
    # owner_unavailable: the forwarding member answers it on any error of its hop to the owner,
    # also after the owner appended; repeating it would append twice.
    calls, mock = _counting(503, code)
    async with Client("http://mock", transport=mock, retries=3) as client:
        with pytest.raises(Unavailable):
            await client.stream("s", content_type="text/plain").append("x")
    assert calls == ["POST"]


@pytest.mark.parametrize(
    "code", ["not_ready", "shutting_down", "recovering", "stale_placement", "server_busy", ""]
)
async def test_a_plain_append_is_repeated_after_a_503_refused_before_any_work(code: str) -> None:
    calls, mock = _counting(503, code)
    async with Client("http://mock", transport=mock, retries=2) as client:
        with pytest.raises(Unavailable):
            await client.stream("s", content_type="text/plain").append("x")
    assert calls == ["POST"] * 3


async def test_a_redirect_is_not_a_success() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            301, headers={"Location": "https://elsewhere/", "Content-Type": "text/html"}, text="moved"
        )

    async with Client("http://mock", transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(StreamError) as caught:
            await client.stream("s", content_type="text/plain").append("x")
    assert caught.value.status == 301


async def test_credentials_go_only_to_the_base_urls_origin() -> None:
    seen: list[tuple[str, str | None, str | None]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.headers.get("authorization"), request.headers.get("x-tenant")))
        return httpx.Response(200, headers={"Content-Type": "text/plain", "Stream-Next-Offset": "0_0"})

    mock = httpx.MockTransport(handler)
    async with Client(
        "https://streams.example", token="SECRET", headers={"X-Tenant": "t"}, transport=mock
    ) as client:
        await client.stream("https://streams.example/v1/stream/x?sig=1").head()
        await client.stream("https://attacker.example/v1/stream/x?sig=1").head()
        await client.stream("http://streams.example/v1/stream/x").head()  # another scheme: another origin
    assert seen == [
        ("streams.example", "Bearer SECRET", "t"),
        ("attacker.example", None, None),
        ("streams.example", None, None),
    ]


async def test_a_delete_whose_answer_was_lost_succeeds_when_repeated(server: ServerProcess) -> None:
    class LoseFirstDeleteAnswer(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.AsyncHTTPTransport()
            self.lost = False

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            response = await self.inner.handle_async_request(request)
            if request.method == "DELETE" and not self.lost:
                self.lost = True
                await response.aread()
                raise httpx.ReadError("reset after the server answered", request=request)
            return response

        async def aclose(self) -> None:
            await self.inner.aclose()

    transport = LoseFirstDeleteAnswer()
    async with Client(server.url, transport=transport) as client:
        stream = client.stream(fresh())
        await stream.create(content_type="text/plain")
        await stream.delete()
        assert transport.lost and not await stream.exists()
        with pytest.raises(StreamNotFound):
            await stream.delete()  # no attempt was lost: a 404 is a 404


# -- asyncio, and the blocking facade ---------------------------------------------------------


def test_the_same_client_runs_under_asyncio(server: ServerProcess) -> None:
    async def main() -> tuple[list[object], bool]:
        async with Client(server.url, http2=True) as client:
            stream = client.stream(fresh())
            await stream.create(content_type="application/json")
            await stream.append({"loop": "asyncio"})
            seen: list[object] = []
            async with stream.read(live="sse") as reader:
                async for batch in reader:
                    seen += batch.messages or []
                    if len(seen) == 1:
                        await stream.close()
            return seen, reader.closed

    seen, closed = asyncio.run(main())
    assert seen == [{"loop": "asyncio"}] and closed


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_blocking_facade(server: ServerProcess, backend: str) -> None:
    with SyncClient(server.url, backend=backend) as client:
        stream = client.stream(fresh())
        assert stream.create(content_type="application/json").created
        stream.append({"n": 1})
        stream.append({"n": 2}, close=True)
        assert list(stream.messages()) == [{"n": 1}, {"n": 2}]
        assert stream.head().closed
        with pytest.raises(StreamClosed):
            stream.append({"n": 3})
        stream.delete()
        assert not stream.exists()
        produced = client.stream(fresh())
        produced.create(content_type="application/json")
        with produced.producer("script", linger=0.01) as producer:
            receipts = [producer.append({"n": n}) for n in range(5)]
            assert receipts[-1].wait().next_offset is not None
            producer.append({"n": 5})
        assert list(produced.messages()) == [{"n": n} for n in range(6)]  # close delivered the last
        bounded = client.stream(fresh())
        bounded.create(content_type="text/plain")
        with bounded.producer("bounded", linger=0.05, max_buffered_bytes=8) as producer:
            # Past max_buffered_bytes a blocking append waits for room instead of raising
            # ProducerFull: 20 appends of 6 bytes, at most one lingering batch held at a time.
            for n in range(20):
                producer.append(b"%06d" % n)
        assert b"".join(batch.data for batch in bounded.read()) == b"".join(b"%06d" % n for n in range(20))


def test_closing_the_blocking_client_closes_its_producers_and_may_be_repeated(server: ServerProcess) -> None:
    client = SyncClient(server.url)
    stream = client.stream(fresh())
    stream.create(content_type="text/plain")
    producer = stream.producer("left-open", linger=0.01)
    producer.append("x").wait()
    producer.append("y")  # queued: close() must deliver it, not wait forever on the producer's task
    finished = threading.Event()

    def close_then_say_so() -> None:
        client.close()
        finished.set()

    closer = threading.Thread(target=close_then_say_so, daemon=True)
    closer.start()
    assert finished.wait(10), "close() hung on a producer left open"
    client.close()  # a second close is a no-op
    producer.close()
    with SyncClient(server.url) as check:
        assert check.stream(stream.stream.path).read_all()[0].data == b"xy"


def test_a_script_that_never_closes_the_blocking_client_exits(server: ServerProcess) -> None:
    script = (
        "import sys\n"
        "from streamkeep.client.sync import Client\n"
        "c = Client(sys.argv[1])\n"
        "s = c.stream(sys.argv[2]); s.create(content_type='text/plain')\n"
        "p = s.producer('p', linger=0.01); p.append('queued at exit')\n"
    )
    name = fresh()
    done = subprocess.run(
        [sys.executable, "-c", script, server.url, name],
        timeout=30,
        capture_output=True,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr.decode()
    with SyncClient(server.url) as check:  # the exit hook closed the producer: its append landed
        assert check.stream(name).read_all()[0].data == b"queued at exit"
