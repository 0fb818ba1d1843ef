"""The scenarios of the PyPI client's own test suite (`durable-streams` 0.1.0, its sdist's tests/)
that apply to streamkeep.client and that tests/test_client_*.py did not cover yet, against a real
server (issue 24: "the PyPI durable-streams test suite's scenarios that apply are covered by our
tests"). docs/testing.md maps every one of its scenarios to the test that covers it, or says why
it does not apply.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import httpx
import jwt
import pytest
import trio

from ops.serverproc import ServerProcess, start
from streamkeep.client import (
    BadRequest,
    Client,
    Conflict,
    PayloadTooLarge,
    RetryPolicy,
    StreamError,
    StreamGone,
    StreamNotFound,
    Unauthorized,
    Unavailable,
)
from streamkeep.client.errors import error_for
from streamkeep.client.reader import is_json_type, media_type
from tests.conftest import FAST

_names = itertools.count()
SECRET = "pypi-scenarios-secret-long-enough-for-hs256"


def fresh(prefix: str = "pypi") -> str:
    return f"{prefix}/{next(_names)}-{time.monotonic_ns()}"


class Recording(httpx.AsyncBaseTransport):
    """A real transport that remembers every request it sends."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.sent: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


# PyPI: TestDurableStreamConstructor.creates_handle_without_network_io,
# TestDurableStreamHead.head_throws_on_404 / head_updates_content_type_on_instance,
# TestIntegrationDurableStreamMethods.connect_validates_stream / connect_throws_on_missing.
async def test_a_handle_sends_nothing_and_head_learns_the_content_type(server: ServerProcess) -> None:
    recording = Recording()
    name = fresh()
    async with Client(server.url, transport=recording) as client:
        stream = client.stream(name)
        assert recording.sent == []  # a handle is only a name
        assert not await stream.exists()
        with pytest.raises(StreamNotFound):
            await stream.head()
        await client.stream(name).create(content_type="text/plain; charset=utf-8")
        other = client.stream(name)
        assert other.content_type is None
        info = await other.head()
        assert await other.exists()
    assert media_type(other.content_type) == "text/plain" and media_type(info.content_type) == "text/plain"
    assert [r.method for r in recording.sent] == ["HEAD", "HEAD", "PUT", "HEAD", "HEAD"]


# PyPI: TestDurableStreamAppend.append_throws_on_404, TestDurableStreamDelete.delete_throws_on_404,
# TestStreamBasicFunctionality.stream_throws_on_404, TestAstreamBasicFunctionality.astream_throws_on_404,
# TestIntegrationTopLevelFunctions.stream_function_throws_on_missing.
@pytest.mark.parametrize("live", [False, "long-poll", "sse"])
async def test_every_operation_on_a_missing_stream_is_stream_not_found(
    server: ServerProcess, live: bool | str
) -> None:
    async with Client(server.url, retries=RetryPolicy(attempts=1)) as client:
        stream = client.stream(fresh(), content_type="text/plain")
        with pytest.raises(StreamNotFound):
            await stream.append("x")
        with pytest.raises(StreamNotFound):
            await stream.delete()
        with trio.fail_after(10), pytest.raises(StreamNotFound):
            async with stream.read(offset="-1", live=live) as reader:  # type: ignore[arg-type]
                async for _ in reader:
                    pass


# PyPI: TestPerRequestResolutionInLiveMode (header functions called on each long-poll request),
# TestFunctionBasedHeaders (a sync function, mixed with static values),
# TestDurableStreamMergedHeadersParams (handle and call headers merged, the call's win),
# TestIntegrationHeaders.custom_headers_are_sent.
async def test_a_headers_function_is_called_for_every_poll_and_call_headers_win(
    server: ServerProcess,
) -> None:
    polls = itertools.count()
    recording = Recording()

    def headers() -> dict[str, str]:  # a plain function, called before every request
        return {"X-Poll": str(next(polls)), "X-Tag": "client"}

    async with Client(server.url, headers=headers, transport=recording) as client:
        stream = client.stream(fresh())
        await stream.create(content_type="text/plain")
        with trio.move_on_after(2.5):  # the server's long-poll timeout is 1 s: several polls
            async with stream.read(offset="now", live="long-poll") as reader:
                async for _ in reader:
                    pass
        await stream.append("tagged", headers={"X-Tag": "call"})
    gets = [r for r in recording.sent if r.method == "GET"]
    assert len(gets) >= 2 and all(r.url.params["live"] == "long-poll" for r in gets)
    values = [r.headers["x-poll"] for r in recording.sent]
    assert len(set(values)) == len(values), values  # resolved again for each request
    post = recording.sent[-1]
    assert post.method == "POST" and post.headers["x-tag"] == "call" and "x-poll" in post.headers


# PyPI: TestIntegrationBinaryData.append_and_read_binary, TestStreamIterators.iter_bytes_returns_chunks,
# TestResponseMetadata.exposes_start_offset / exposes_status_code, TestIntegrationStreamBasics.
# stream_offset_tracking.
@pytest.mark.parametrize("live", [False, "long-poll", "sse"])
async def test_every_byte_value_round_trips_in_every_read_mode(
    server: ServerProcess, live: bool | str
) -> None:
    data = bytes(range(256)) * 8
    async with Client(server.url) as client:
        stream = client.stream(fresh())
        await stream.create(content_type="application/octet-stream")
        first = await stream.append(data[:1000])
        await stream.append(data[1000:])
        got, batches = b"", []
        with trio.fail_after(10):
            async with stream.read(offset="-1", live=live) as reader:  # type: ignore[arg-type]
                async for batch in reader:
                    batches.append(batch)
                    got += batch.data
                    if batch.up_to_date:
                        break
        assert got == data
        assert batches[0].offset == "-1" and batches[0].status == 200
        for before, after in itertools.pairwise(batches):
            assert after.offset == before.next_offset  # each batch starts where the last ended
        [rest] = await stream.read_all(offset=first.next_offset or "")
        assert rest.offset == first.next_offset and rest.data == data[1000:]


# PyPI: TestJsonFlatten (flattens arrays one level, nested arrays not flattened, single values
# wrapped, mixed types), TestIntegrationStreamBasics.read_json_stream, TestIntegrationIteration.iter_json.
@pytest.mark.parametrize("live", [False, "sse"])
async def test_json_arrays_flatten_one_level_and_single_values_are_one_message(
    server: ServerProcess, live: bool | str
) -> None:
    async with Client(server.url) as client:
        stream = client.stream(fresh())
        await stream.create(content_type="application/json")
        for raw in (b"[[1,2],[3]]", b"7", b'"s"', b'[{"a":1},2,"x",null,true]', b'{"o":[]}'):
            await stream.append(raw)
        messages = []
        with trio.fail_after(10):
            async with stream.read(offset="-1", live=live) as reader:  # type: ignore[arg-type]
                async for batch in reader:
                    messages += batch.messages or []
                    if batch.up_to_date:
                        break
    assert messages == [[1, 2], [3], 7, "s", {"a": 1}, 2, "x", None, True, {"o": []}]


# PyPI: TestNormalizeContentType, TestIsJsonContentType (charset, parameters, case, none).
async def test_content_types_are_compared_by_media_type(server: ServerProcess) -> None:
    assert media_type(" Application/JSON ; charset=utf-8") == "application/json"
    assert is_json_type("application/json; charset=utf-8") and is_json_type("APPLICATION/JSON")
    assert not is_json_type("text/plain") and not is_json_type(None) and not is_json_type("")
    async with Client(server.url) as client:
        stream = client.stream(fresh())
        await stream.create(content_type="application/json; charset=utf-8")
        await stream.append({"typed": True})  # a JSON stream: one message
        assert [m async for m in stream.messages()] == [{"typed": True}]


# PyPI: TestErrorFromStatus (400, 404, 409 default, 410, 413, 429, 503, unknown status),
# TestFetchError (status and body kept).
async def test_refusals_of_a_real_server_are_typed(server: ServerProcess) -> None:
    async with Client(server.url, retries=RetryPolicy(attempts=0)) as client:
        stream = client.stream(fresh())
        await stream.create(content_type="text/plain")
        with pytest.raises(BadRequest) as bad:
            await stream.read_all(offset="not-an-offset")
        assert bad.value.status == 400 and bad.value.body
        with pytest.raises(PayloadTooLarge):  # the test server takes 1 MiB bodies at most
            await stream.append(b"x" * (2 << 20))
    for status, kind in ((404, StreamNotFound), (410, StreamGone), (413, PayloadTooLarge)):
        assert type(error_for(status, {})) is kind
    assert type(error_for(409, {}, method="POST")) is Conflict
    assert type(error_for(503, {})) is Unavailable and error_for(503, {}).retry_after is None  # type: ignore[attr-defined]
    teapot = error_for(418, {}, b"short and stout")
    assert type(teapot) is StreamError and teapot.status == 418 and teapot.body == b"short and stout"


@pytest.fixture(scope="module")
def auth_server() -> Iterator[ServerProcess]:
    process = start(*FAST, "--auth-jwt-secret", SECRET)
    yield process
    process.stop()


def token(scope: str) -> str:
    return jwt.encode({"sub": "pypi", "scope": scope, "exp": int(time.time()) + 600}, SECRET, "HS256")


# PyPI: TestFirstRequestSemantics.rejects_on_401_auth_failure / rejects_on_403_forbidden,
# TestAuthHeaders.includes_token_auth_header, TestDurableStreamAuth.
async def test_401_and_403_are_unauthorized_at_once(auth_server: ServerProcess) -> None:
    name = fresh("team")
    async with Client(auth_server.url, token=token("admin")) as admin:
        await admin.stream(name).create(content_type="text/plain")
        await admin.stream(name).append("secret")
    recording = Recording()
    async with Client(auth_server.url, transport=recording) as anonymous:
        with pytest.raises(Unauthorized) as missing:
            await anonymous.stream(name).read_all()
        assert missing.value.status == 401
        with trio.fail_after(10), pytest.raises(Unauthorized):
            async with anonymous.stream(name).read(live="sse") as reader:
                async for _ in reader:
                    pass
    assert len(recording.sent) == 2  # refused at the first request, never retried
    async with Client(auth_server.url, token=token("read:team/**")) as reader_only:
        [batch] = await reader_only.stream(name).read_all()
        assert batch.data == b"secret"
        with pytest.raises(Unauthorized) as forbidden:
            await reader_only.stream(name, content_type="text/plain").append("more")
        assert forbidden.value.status == 403
