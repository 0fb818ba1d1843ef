"""streamkeep.client's readers against a real server: every kind of offset, catch-up, long-poll and
SSE (JSON flattened, binary in base64, text), EOF, and resumption after connections are cut in
the middle of an answer: nothing lost, nothing read twice."""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import trio

from ops.serverproc import ServerProcess, start
from streamkeep.client import Batch, Client, ProtocolError, RetryPolicy, Stream, StreamGone
from streamkeep.client.reader import LiveMode
from streamkeep.client.sse import SseParser, decode_data, parse_control
from tests.client_faults import CuttingProxy

_names = itertools.count()


def fresh() -> str:
    return f"reader/{next(_names)}-{time.monotonic_ns()}"


@pytest.fixture(params=["http/1.1", "h2c"])
async def client(request: pytest.FixtureRequest, server: ServerProcess) -> AsyncIterator[Client]:
    async with Client(server.url, http2=request.param == "h2c") as c:
        yield c


async def text_stream(client: Client, *parts: str) -> tuple[Stream, list[str]]:
    """A text stream holding `parts`, and the offset after each."""
    stream = client.stream(fresh())
    await stream.create(content_type="text/plain")
    offsets = [(await stream.append(part)).next_offset or "" for part in parts]
    return stream, offsets


async def collect(stream: Stream, *, until: int, live: LiveMode, offset: str = "-1") -> list[Any]:
    """Messages (or byte chunks) until `until` of them arrived, with a deadline."""
    out: list[Any] = []
    with trio.fail_after(20):
        async with stream.read(offset=offset, live=live) as reader:
            async for batch in reader:
                out += batch.messages if batch.messages is not None else ([batch.data] if batch.data else [])
                if len(out) >= until:
                    break
    return out


# -- offsets ----------------------------------------------------------------------------------


async def test_catch_up_from_every_kind_of_offset(client: Client) -> None:
    stream, (first, second, last) = await text_stream(client, "a", "b", "c")
    whole = await stream.read_all(offset="-1")
    assert b"".join(b.data for b in whole) == b"abc" and whole[0].offset == "-1"
    from_middle = await stream.read_all(offset=first)
    assert b"".join(b.data for b in from_middle) == b"bc" and from_middle[0].offset == first
    from_second = await stream.read_all(offset=second)
    assert b"".join(b.data for b in from_second) == b"c"
    at_tail = await stream.read_all(offset=last)
    assert [(b.data, b.up_to_date, b.next_offset) for b in at_tail] == [(b"", True, last)]
    now = await stream.read_all(offset="now")
    assert [(b.data, b.up_to_date, b.next_offset, b.closed) for b in now] == [(b"", True, last, False)]


async def test_now_on_a_json_stream_is_an_empty_batch_at_the_tail(client: Client) -> None:
    stream = client.stream(fresh())
    await stream.create(content_type="application/json")
    tail = (await stream.append({"old": True})).next_offset
    [batch] = await stream.read_all(offset="now")
    assert batch.messages == [] and batch.next_offset == tail and batch.up_to_date


@pytest.mark.parametrize("live", ["long-poll", "sse"])
async def test_live_from_now_sees_only_what_comes_after(client: Client, live: LiveMode) -> None:
    stream = client.stream(fresh())
    await stream.create(content_type="application/json")
    await stream.append({"old": True})
    got: list[Any] = []
    async with trio.open_nursery() as nursery:

        async def read() -> None:
            got.extend(await collect(stream, until=1, live=live, offset="now"))

        nursery.start_soon(read)
        await trio.sleep(0.3)
        await stream.append({"new": True})
    assert got == [{"new": True}]


@pytest.mark.parametrize("live", ["long-poll", "sse"])
async def test_now_is_fixed_before_a_first_live_read_that_breaks(
    server: ServerProcess, live: LiveMode
) -> None:
    """An append lands while the first live request waits, then its connection breaks: the
    repeated request must start where the reader started, not at a later "now"."""
    name = fresh()

    class BreakFirstLiveRead(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.AsyncHTTPTransport()
            self.broke = False

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if not self.broke and request.url.params.get("live") is not None:
                self.broke = True
                async with httpx.AsyncClient() as side:
                    await side.post(
                        f"{server.url}/v1/stream/{name}",
                        content=b"meanwhile",
                        headers={"content-type": "text/plain"},
                    )
                raise httpx.ReadError("connection reset", request=request)
            return await self.inner.handle_async_request(request)

        async def aclose(self) -> None:
            await self.inner.aclose()

    transport = BreakFirstLiveRead()
    async with Client(server.url, transport=transport) as client:
        stream = client.stream(name)
        await stream.create(content_type="text/plain")
        await stream.append(b"before")
        assert await collect(stream, until=1, live=live, offset="now") == [b"meanwhile"]
    assert transport.broke


async def test_a_read_answer_without_a_next_offset_is_a_protocol_error() -> None:
    asked: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.params["offset"])
        if len(asked) > 3:  # a reader that asks again and again is stopped here, and fails below
            return httpx.Response(400, json={"error": {"code": "stop", "message": "asked again"}})
        return httpx.Response(200, headers={"Content-Type": "text/plain"}, content=b"page")

    async with Client("http://mock", transport=httpx.MockTransport(handler)) as client:
        with trio.fail_after(5), pytest.raises(ProtocolError):
            await client.stream("s", content_type="text/plain").read_all()
    assert asked == ["-1"]  # raised at once, not asked again and again


@pytest.mark.parametrize("live", ["long-poll", "sse", "auto"])
async def test_live_reader_resumes_from_a_middle_offset_and_ends_at_close(
    client: Client, live: LiveMode
) -> None:
    stream, (first, _, _) = await text_stream(client, "a", "b", "c")
    batches: list[Batch] = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:

            async def read() -> None:
                async with stream.read(offset=first, live=live) as reader:
                    async for batch in reader:
                        batches.append(batch)
                    assert reader.closed

            nursery.start_soon(read)
            await trio.sleep(0.3)
            await stream.append("d", close=True)
    assert b"".join(b.data for b in batches) == b"bcd"
    assert batches[-1].closed and batches[0].offset == first


# -- long-poll --------------------------------------------------------------------------------


async def test_long_poll_wakes_on_an_append_and_outlasts_a_timeout(client: Client) -> None:
    stream = client.stream(fresh())
    await stream.create(content_type="text/plain")
    arrived: list[float] = []
    async with trio.open_nursery() as nursery:

        async def read() -> None:
            async with stream.read(offset="-1", live="long-poll") as reader:
                async for batch in reader:
                    if batch.data:
                        arrived.append(time.monotonic())
                        assert batch.data == b"late"
                        return

        nursery.start_soon(read)
        await trio.sleep(1.5)  # past the server's 1 s long-poll timeout: a 204, and a new poll
        appended = time.monotonic()
        await stream.append("late")
    assert arrived and arrived[0] - appended < 0.9  # woken by the append, not by a timeout


async def test_a_long_poll_that_times_out_is_an_empty_204_batch(client: Client) -> None:
    stream = client.stream(fresh())
    await stream.create(content_type="text/plain")
    tail = (await stream.append("before")).next_offset
    with trio.fail_after(10):
        async with stream.read(offset="now", live="long-poll") as reader:
            batch = await reader.__anext__()  # the server's 1 s long-poll timeout
    assert (batch.status, batch.data, batch.up_to_date, batch.closed) == (204, b"", True, False)
    assert batch.next_offset == tail and batch.cursor  # a cursor to echo on the next poll
    [catch_up] = await stream.read_all(offset="-1")
    assert catch_up.status == 200 and catch_up.data == b"before"


async def test_auto_falls_back_to_long_poll_where_sse_is_refused() -> None:
    asked: list[str | None] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        live = request.url.params.get("live")
        asked.append(live)
        if live == "sse":
            return httpx.Response(400, json={"error": {"code": "no_sse", "message": "no SSE here"}})
        offset = request.url.params["offset"]
        headers = {"Content-Type": "text/plain", "Stream-Up-To-Date": "true", "Stream-Cursor": "7"}
        if offset == "-1":
            return httpx.Response(200, headers={**headers, "Stream-Next-Offset": "1"}, content=b"a")
        return httpx.Response(
            200, headers={**headers, "Stream-Next-Offset": "2", "Stream-Closed": "true"}, content=b"b"
        )

    async with Client("http://mock", transport=httpx.MockTransport(handler)) as client:
        batches = [b async for b in client.stream("s", content_type="text/plain").read(live="auto")]
    assert [b.data for b in batches] == [b"a", b"b"] and batches[-1].closed
    assert asked == [None, "sse", "long-poll"]


async def test_messages_of_a_byte_stream_are_its_chunks(client: Client) -> None:
    stream, _ = await text_stream(client, "ab", "cd")
    chunks = [chunk async for chunk in stream.messages()]
    assert b"".join(chunks) == b"abcd" and all(isinstance(c, bytes) for c in chunks)


# -- SSE framing ------------------------------------------------------------------------------


async def test_sse_json_arrays_are_flattened_and_multiline_json_rejoined(client: Client) -> None:
    stream = client.stream(fresh())
    await stream.create(content_type="application/json")
    await stream.append(b'[{"a": 1}, [2, 3]]')
    await stream.append(b'{\n  "multi": "line\\nvalue"\n}')
    await stream.append(["x", {"y": None}])
    assert await collect(stream, until=4, live="sse") == [
        {"a": 1},
        [2, 3],
        {"multi": "line\nvalue"},
        ["x", {"y": None}],
    ]


async def test_sse_binary_is_base64_decoded(client: Client) -> None:
    payload = bytes(range(256)) + b"\r\n\n\r\x00"
    stream = client.stream(fresh())
    await stream.create(content_type="application/octet-stream")
    await stream.append(payload)
    await stream.append(b"\xff" * 70000)  # base64 longer than one line
    wanted = payload + b"\xff" * 70000
    got = b""
    with trio.fail_after(20):
        async with stream.read(live="sse") as reader:
            async for batch in reader:
                got += batch.data
                if len(got) >= len(wanted):
                    break
    assert got == wanted


async def test_sse_text_keeps_unicode(client: Client) -> None:
    stream = client.stream(fresh())
    await stream.create(content_type="text/plain; charset=utf-8")
    await stream.append("héllo ✓ \u2028 wörld")
    assert b"".join(await collect(stream, until=1, live="sse")).decode() == "héllo ✓ \u2028 wörld"


def test_sse_parser_takes_any_chunking_and_line_ending() -> None:
    wire = b'event: data\r\ndata: [1,\r\ndata: 2]\r\n\r\n: keep-alive\n\nevent:control\rdata:{"streamNextOffset":"0_9","upToDate":true}\r\r'
    for size in (1, 2, 3, 7, len(wire)):
        parser = SseParser()
        events = []
        for i in range(0, len(wire), size):
            events += parser.feed(wire[i : i + size])
        assert [(e.event, e.data) for e in events] == [
            ("data", "[1,\n2]"),
            ("control", '{"streamNextOffset":"0_9","upToDate":true}'),
        ]
    with pytest.raises(ProtocolError):
        parse_control("{not json")
    with pytest.raises(ProtocolError):
        decode_data("AQI", base64_mode=True)  # not a multiple of 4
    control = parse_control('{"streamNextOffset":"0_9","streamClosed":true}')
    assert control.closed and control.up_to_date and control.cursor is None
    assert decode_data("AQID\nBA==", base64_mode=True) == b"\x01\x02\x03\x04"
    parser = SseParser()
    assert parser.feed("data: é\n".encode()[:7]) == []  # half of a UTF-8 character
    assert [e.data for e in parser.feed("data: é\n\n".encode()[7:])] == ["é"]


# -- resuming after cut connections -----------------------------------------------------------


@pytest.fixture
def proxy_for(server: ServerProcess) -> Iterator[Any]:
    proxies: list[CuttingProxy] = []

    def make(cut_after: int, cuts: int) -> CuttingProxy:
        proxies.append(CuttingProxy(server.url, cut_after=cut_after, cuts=cuts))
        return proxies[-1]

    yield make
    for proxy in proxies:
        proxy.close()


@pytest.mark.parametrize("live", [False, "long-poll", "sse"])
async def test_a_reader_resumes_after_cut_connections_without_loss_or_repeats(
    server: ServerProcess, proxy_for: Any, live: LiveMode
) -> None:
    async with Client(server.url) as writer:
        stream = writer.stream(fresh())
        await stream.create(content_type="application/json")
        for n in range(40):
            await stream.append({"n": n, "pad": "x" * 50})
        await stream.close()
    proxy = proxy_for(cut_after=700, cuts=3)
    # One connection at a time, so that each cut lands in the middle of an answer.
    async with Client(proxy.url, retries=RetryPolicy(attempts=6, base_delay=0.01)) as client:
        reader_stream = client.stream(stream.path, content_type="application/json")
        seen = [m["n"] async for m in reader_stream.messages(live=live)]
    assert seen == list(range(40))
    assert proxy.cut == 3


async def test_sse_resumes_from_the_last_control_offset_with_data_arriving(
    server: ServerProcess, proxy_for: Any
) -> None:
    proxy = proxy_for(cut_after=400, cuts=4)
    async with (
        Client(server.url) as writer,
        Client(proxy.url, retries=RetryPolicy(attempts=8, base_delay=0.01)) as reader_client,
    ):
        stream = writer.stream(fresh())
        await stream.create(content_type="application/json")
        seen: list[int] = []

        async def read() -> None:
            messages = reader_client.stream(stream.path, content_type="application/json").messages(live="sse")
            async for message in messages:
                seen.append(message["n"])

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                for n in range(30):
                    await stream.append({"n": n, "pad": "y" * 40})
                    await trio.sleep(0.01)
                await stream.close()
    assert seen == list(range(30)) and proxy.cut >= 1


# -- 410 with the earliest offset -------------------------------------------------------------


@pytest.fixture(scope="module")
def retaining_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data = tmp_path_factory.mktemp("retention")
    process = start(
        "--storage", "disk", "--data-dir", str(data), "--segment-max-messages", "2",
        "--retention-max-bytes", "20", "--retention-interval", "0.2",
    )  # fmt: skip
    yield process
    process.stop()


async def test_a_dropped_offset_is_stream_gone_with_where_to_resume(retaining_server: ServerProcess) -> None:
    async with Client(retaining_server.url) as client:
        stream = client.stream(fresh())
        await stream.create(content_type="text/plain")
        first = (await stream.append("0000;")).next_offset or ""
        for n in range(1, 20):
            await stream.append(f"{n:04d};")
        with trio.fail_after(10):
            while True:
                try:
                    await stream.read_all(offset=first)
                except StreamGone as gone:
                    error = gone
                    break
                await trio.sleep(0.1)
        assert error.status == 410 and error.earliest_offset is not None
        assert error.earliest_offset > first
        rest = await stream.read_all(offset=error.earliest_offset)
        text = b"".join(b.data for b in rest).decode()
        assert text.endswith("0019;") and "0000;" not in text
        head = await stream.head()  # retention may have moved on since, never back
        assert head.earliest_offset is not None and head.earliest_offset >= error.earliest_offset
