"""The transport: one httpx connection pool, the headers every request carries, and retries.

Everything the client sends goes through `HttpTransport.request` (whole answers) or
`HttpTransport.stream` (SSE), so auth, per-request headers, error mapping and the retry rules live
in one place. Only a 2xx answer is a success: a 3xx (redirects are not followed: a stream's URL
does not move, and following one would resend the body elsewhere) is raised as an error, so an
append never counts a redirect page as written.

The retry rules, and why:

- 429 is a refusal before any work (streamkeep's auth gate answers it, code `quota`, before the
  request reaches a stream; proxies' rate limits likewise): any method may repeat it, after
  `Retry-After` when the server gives one.
- 503 is repeated for idempotent requests whatever its cause. A non-idempotent request (a POST
  without `Producer-Id`: a plain append) is repeated too, as HTTP means a 503 (the server could
  not handle it now: HAProxy with no server up, a server starting or stopping, and streamkeep's
  refusals before any work, `not_ready`, `shutting_down`, `recovering`, `stale_placement`,
  `server_busy`, `read_only`, `cold_backlog`), except where the server's code says it may have
  been done: `owner_unavailable` (cluster/forward.py answers it on ANY error of the forwarding
  hop, including a read timeout after the owner applied the append, so repeating it can append
  twice), `not_durable` (it WAS done), and `storage_unavailable` and
  `member_unavailable` (a write or a call that failed part way). The upstream client conformance
  suite checks that a plain append is repeated after a 503 without a code. Exactly once is the
  idempotent producer's job (its POSTs carry `Producer-Id` and are deduplicated).
- 500, 502 and 504 are repeated for idempotent requests only: a gateway's 502 during a failover
  is worth waiting out, but a plain append answered 500 may have been appended.
- A connection that could not be opened (connect error or timeout, no free connection) sent
  nothing, so any method may repeat it.
- A connection that broke after the request went out may or may not have done it: only idempotent
  requests are repeated (GET, HEAD, PUT, DELETE, and a POST carrying `Producer-Id`, which the
  server deduplicates). A DELETE repeated after an attempt that may have been done and answered
  404 is a success: the first attempt deleted the stream.

The bearer token and the configured headers go only to the base URL's origin (scheme, host,
port): a full URL (a signed link from elsewhere) naming another host gets neither, so a link
cannot make the client hand its credentials to a third party."""

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
# 503 codes that mean "refused before doing anything" (see the module docstring for where each
# comes from): the only 503s a non-idempotent request is repeated after.
# 503 codes after which a non-idempotent request may have been done (see the module docstring).
MAY_HAVE_BEEN_DONE_CODES = frozenset(
    ("owner_unavailable", "not_durable", "storage_unavailable", "member_unavailable")
)
# 2**30 * base_delay is past any max_delay; a larger exponent only risks float overflow.
_MAX_BACKOFF_EXPONENT = 30
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
        return random.uniform(
            0, min(self.max_delay, self.base_delay * (2 ** min(attempt, _MAX_BACKOFF_EXPONENT)))
        )


def is_idempotent(method: str, headers: HeaderMap) -> bool:
    """Whether repeating the request after a broken connection cannot do it twice."""
    if method.upper() in IDEMPOTENT_METHODS:
        return True
    return any(name.lower() == "producer-id" for name in headers)


def _may_retry_status(error: StreamError, idempotent: bool) -> bool:
    if error.status in IDEMPOTENT_RETRYABLE_STATUSES:
        return idempotent
    if error.status == 429:
        return True
    if error.status != 503:
        return False
    return idempotent or error.code not in MAY_HAVE_BEEN_DONE_CODES


def _may_have_been_done(error: StreamError) -> bool:
    """Whether a refused attempt that is being repeated may have done the request anyway."""
    if error.status == 429:
        return False
    return error.status != 503 or error.code in MAY_HAVE_BEEN_DONE_CODES


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    return (url.scheme, url.host, url.port)


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
        self.http2 = http2
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

    def is_own_origin(self, url: str) -> bool:
        """Whether `url` names the base URL's scheme, host and port (the server the token is for)."""
        return _origin(httpx.URL(url)) == _origin(httpx.URL(self.base_url))

    async def headers_for(
        self, extra: HeaderMap | None = None, *, target: str | None = None
    ) -> dict[str, str]:
        """The headers of one request: auth, the configured ones (called now when a function),
        then `extra`. With `target` naming another origin than the base URL's, auth and the
        configured headers are left out: they are this server's credentials."""
        out: dict[str, str] = {}
        own = target is None or self.is_own_origin(target)
        if self.token is not None and own:
            out["Authorization"] = f"Bearer {self.token}"
        source = self.extra_headers
        if source is not None and own:
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
        """Sends a request and returns its answer, body read, when its status is 2xx.

        A refusal raises the typed error of `errors.py` once the retries are spent (429/503 as
        `Unavailable`); a transport failure raises `ConnectionFailed`. `idempotent` overrides the
        guess from the method and headers."""
        policy = retry or self.retry
        target = self.url_for(url)
        attempt = 0
        # Whether an attempt already repeated may have been done (its answer lost or a failure).
        maybe_done = False
        while True:
            sent = await self.headers_for(headers, target=target)
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
                    maybe_done = maybe_done or not isinstance(exc, _NOT_SENT)
                    await anyio.sleep(policy.wait(attempt))
                    attempt += 1
                    continue
                raise ConnectionFailed(f"{method} failed: {type(exc).__name__}: {exc}", url=target) from exc
            if 200 <= response.status_code < 300:
                return response
            if response.status_code == 404 and maybe_done and method.upper() == "DELETE":
                # The attempt whose answer was lost deleted it: the caller's delete succeeded.
                return response
            error = error_for(
                response.status_code, response.headers, response.content, method=method, url=target
            )
            if attempt < policy.attempts and _may_retry_status(error, safe):
                maybe_done = maybe_done or _may_have_been_done(error)
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
            sent = await self.headers_for(headers, target=target)
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
                if not 200 <= response.status_code < 300:
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
