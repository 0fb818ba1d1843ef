"""`Client`: the entry point, one connection pool to one server and handles to its streams."""

from __future__ import annotations

import ssl
from types import TracebackType
from typing import Self

import httpx

from streamkeep.client.http import HeadersSource, HttpTransport, RetryPolicy
from streamkeep.client.stream import STREAM_PREFIX, Stream, stream_path


class Client:
    """A Durable Streams client for the server at `base_url`.

    `token` is sent as `Authorization: Bearer`; `headers` are sent on every request (a dict, or a
    function, possibly async, called before each request: a token that rotates). `http2=True`
    speaks HTTP/2 (h2c by prior knowledge on http://). `retries` bounds the retries of refused
    (429/503) and failed requests; `timeout` is httpx's per-phase timeout in seconds, and
    `live_timeout` the read timeout of long-polls and SSE (longer than the server's waits).

        async with Client("http://127.0.0.1:4437") as client:
            stream = client.stream("chat/room-1")
            ...
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        headers: HeadersSource | None = None,
        http2: bool = False,
        timeout: float = 30.0,
        live_timeout: float = 90.0,
        retries: int | RetryPolicy = 5,
        verify: ssl.SSLContext | str | bool = True,
        stream_prefix: str = STREAM_PREFIX,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        policy = retries if isinstance(retries, RetryPolicy) else RetryPolicy(attempts=retries)
        self.stream_prefix = stream_prefix
        self.transport = HttpTransport(
            base_url,
            token=token,
            headers=headers,
            http2=http2,
            timeout=timeout,
            live_timeout=live_timeout,
            retry=policy,
            verify=verify,
            transport=transport,
        )

    @property
    def base_url(self) -> str:
        return self.transport.base_url

    def stream(self, name_or_path: str, *, content_type: str | None = None) -> Stream:
        """A handle on a stream: a name (`chat/room-1`, under `/v1/stream/`), a path, or a full
        URL such as a signed link. Nothing is sent until an operation is called."""
        return Stream(
            self.transport, stream_path(name_or_path, self.stream_prefix), content_type=content_type
        )

    async def aclose(self) -> None:
        await self.transport.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()


__all__ = ["Client"]
