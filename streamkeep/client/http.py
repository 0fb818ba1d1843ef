"""The transport: one httpx connection pool, the headers every request carries, and retries.

Everything the client sends goes through `HttpTransport.request` (whole answers) or
`HttpTransport.stream` (SSE), so auth, per-request headers, error mapping and the retry rules live
in one place. The retry rules, and why:

- 429 and 503 are refusals: the server did not do the request, so any method may repeat it, after
  `Retry-After` when the server gives one. The exception is a 503 whose code is `not_durable`
  (streamkeep: "it was done, but could not be made durable"): a non-idempotent request is not
  repeated then, since it happened.
- 500, 502 and 504 are repeated for idempotent requests only: a gateway's 502 during a failover
  is worth waiting out, but a plain append answered 500 may have been appended (at most once;
  an idempotent producer's appends, which carry `Producer-Id`, are idempotent and repeated).
- A connection that could not be opened (connect error or timeout, no free connection) sent
  nothing, so any method may repeat it.
- A connection that broke after the request went out may or may not have done it: only idempotent
  requests are repeated (GET, HEAD, PUT, DELETE, and a POST carrying `Producer-Id`, which the
  server deduplicates).
"""

from __future__ import annotations

import inspect
import random
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import anyio
import httpx

from streamkeep.client.errors import ConnectionFailed, StreamError, Unavailable, error_for

HeaderMap = Mapping[str, str]
# Static headers, or a function called before every request (e.g. a token that rotates), which
# may be a coroutine function.
HeadersSource = HeaderMap | Callable[[], HeaderMap | Awaitable[HeaderMap]]
Params = Mapping[str, str]

IDEMPOTENT_METHODS = frozenset(("GET", "HEAD", "PUT", "DELETE", "OPTIONS"))
RETRYABLE_STATUSES = frozenset((429, 503))
# Server and gateway failures (a proxy's 502 or 504 during a failover): repeated only for
# idempotent requests, since a 500 may come after the change was made.
IDEMPOTENT_RETRYABLE_STATUSES = frozenset((500, 502, 504))
# Failures where the request never left: safe to repeat whatever the method.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry. `attempts` counts retries after the first try (0: none).

    Waits grow exponentially from `base_delay` up to `max_delay` with full jitter, so many clients
    refused together do not return together; a server's `Retry-After` replaces the computed wait
    (capped at `max_retry_after`, plus a little jitter)."""

    attempts: int = 5
    base_delay: float = 0.05
    max_delay: float = 5.0
    max_retry_after: float = 60.0

    def wait(self, attempt: int, retry_after: float | None = None) -> float:
        """The pause before retry number `attempt` (0 for the first retry)."""
        if retry_after is not None:
            return min(retry_after, self.max_retry_after) + random.uniform(0, self.base_delay)
        return random.uniform(0, min(self.max_delay, self.base_delay * (2**attempt)))


def is_idempotent(method: str, headers: HeaderMap) -> bool:
    """Whether repeating the request after a broken connection cannot do it twice."""
    if method.upper() in IDEMPOTENT_METHODS:
        return True
    return any(name.lower() == "producer-id" for name in headers)


def _may_retry_status(error: StreamError, idempotent: bool) -> bool:
    if error.status in IDEMPOTENT_RETRYABLE_STATUSES:
        return idempotent
    if error.status not in RETRYABLE_STATUSES:
        return False
    return idempotent or error.code != "not_durable"


def _may_retry_exception(error: httpx.TransportError, idempotent: bool) -> bool:
    return idempotent or isinstance(error, _NOT_SENT)


class HttpTransport:
    """One pool of connections to one server, shared by every stream, reader and producer of a
    `Client`. `http2=True` speaks HTTP/2: by prior knowledge (h2c) on `http://`, through ALPN on
    `https://`. Use it as an async context manager, or call `aclose()`."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        headers: HeadersSource | None = None,
        http2: bool = False,
        timeout: float = 30.0,
        live_timeout: float = 90.0,
        retry: RetryPolicy | None = None,
        verify: ssl.SSLContext | str | bool = True,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 100,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.extra_headers = headers
        self.timeout = timeout
        # Long-polls and SSE wait on the server (30 s and 60 s by default): their reads get longer.
        self.live_timeout = live_timeout
        self.retry = retry or RetryPolicy()
        prior_knowledge = http2 and self.base_url.startswith("http://")
        self._client = httpx.AsyncClient(
            http1=not prior_knowledge,
            http2=http2,
            timeout=timeout,
            verify=verify,
            transport=transport,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            follow_redirects=False,
        )

    @property
    def client(self) -> httpx.AsyncClient:
        """The underlying httpx client (for tests and for what this module does not cover)."""
        return self._client

    def url_for(self, path: str) -> str:
        """An absolute URL: `path` as given when it is one, else joined to the base URL."""
        if path.startswith(("http://", "https://")):
            return path
        return f"{self.base_url}/{path.lstrip('/')}"

    async def headers_for(self, extra: HeaderMap | None = None) -> dict[str, str]:
        """The headers of one request: auth, the configured ones (called now when a function),
        then `extra`."""
        out: dict[str, str] = {}
        if self.token is not None:
            out["Authorization"] = f"Bearer {self.token}"
        source = self.extra_headers
        if source is not None:
            resolved = source() if callable(source) else source
            if inspect.isawaitable(resolved):
                resolved = await resolved
            out.update(resolved)
        if extra:
            out.update(extra)
        return out

    def live_timeout_config(self) -> httpx.Timeout:
        return httpx.Timeout(self.timeout, read=self.live_timeout)

    async def request(
        self,
        method: str,
        url: str,
        *,
        params: Params | None = None,
        headers: HeaderMap | None = None,
        content: bytes | None = None,
        idempotent: bool | None = None,
        timeouts: httpx.Timeout | float | None = None,
        retry: RetryPolicy | None = None,
    ) -> httpx.Response:
        """Sends a request and returns its answer, body read, when its status is below 400.

        A refusal raises the typed error of `errors.py` once the retries are spent (429/503 as
        `Unavailable`); a transport failure raises `ConnectionFailed`. `idempotent` overrides the
        guess from the method and headers."""
        policy = retry or self.retry
        target = self.url_for(url)
        attempt = 0
        while True:
            sent = await self.headers_for(headers)
            safe = is_idempotent(method, sent) if idempotent is None else idempotent
            try:
                response = await self._client.request(
                    method,
                    target,
                    params=params,
                    headers=sent,
                    content=content,
                    timeout=self.timeout if timeouts is None else timeouts,
                )
            except httpx.TransportError as exc:
                if attempt < policy.attempts and _may_retry_exception(exc, safe):
                    await anyio.sleep(policy.wait(attempt))
                    attempt += 1
                    continue
                raise ConnectionFailed(f"{method} failed: {type(exc).__name__}: {exc}", url=target) from exc
            if response.status_code < 400:
                return response
            error = error_for(
                response.status_code, response.headers, response.content, method=method, url=target
            )
            if attempt < policy.attempts and _may_retry_status(error, safe):
                retry_after = error.retry_after if isinstance(error, Unavailable) else None
                await anyio.sleep(policy.wait(attempt, retry_after))
                attempt += 1
                continue
            raise error

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        url: str,
        *,
        params: Params | None = None,
        headers: HeaderMap | None = None,
        timeouts: httpx.Timeout | float | None = None,
        retry: RetryPolicy | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """An answer whose body is read as it arrives (SSE). Opening it follows `request`'s rules
        (the method must be idempotent: it is repeated after a broken connection); once open, a
        broken body surfaces as httpx's exception and the reader decides."""
        policy = retry or self.retry
        target = self.url_for(url)
        attempt = 0
        while True:
            sent = await self.headers_for(headers)
            request = self._client.build_request(
                method,
                target,
                params=params,
                headers=sent,
                timeout=self.live_timeout_config() if timeouts is None else timeouts,
            )
            try:
                response = await self._client.send(request, stream=True)
            except httpx.TransportError as exc:
                if attempt < policy.attempts:
                    await anyio.sleep(policy.wait(attempt))
                    attempt += 1
                    continue
                raise ConnectionFailed(f"{method} failed: {type(exc).__name__}: {exc}", url=target) from exc
            try:
                if response.status_code >= 400:
                    try:
                        body = await response.aread()
                    except httpx.TransportError:
                        body = b""
                    error = error_for(response.status_code, response.headers, body, method=method, url=target)
                    if attempt < policy.attempts and _may_retry_status(error, True):
                        retry_after = error.retry_after if isinstance(error, Unavailable) else None
                        await response.aclose()
                        await anyio.sleep(policy.wait(attempt, retry_after))
                        attempt += 1
                        continue
                    raise error
                yield response
                return
            finally:
                await response.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()


__all__ = ["HeaderMap", "HeadersSource", "HttpTransport", "Params", "RetryPolicy", "is_idempotent"]
