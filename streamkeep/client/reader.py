"""Reading a stream: catch-up, long-poll and SSE, as one async iterator of `Batch`es.

A `Reader` keeps its place (`offset`, `cursor`) itself, so a dropped connection, a server that ends
an SSE response (every 60 s by default, for CDN collapsing) or a long-poll that timed out is
resumed from the last `Stream-Next-Offset` it saw, and nothing is read twice or skipped: data that
arrived without its `control` event is dropped and read again from the last offset.

It is a class rather than an async generator so that leaving an `async for` early needs no
generator finalizer (trio and asyncio finalize abandoned generators differently); `aclose()` or
`async with` ends an open SSE response at once.
"""

from __future__ import annotations

import json as jsonlib
from collections import deque
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Self

import anyio
import httpx

from streamkeep.client import sse
from streamkeep.client.errors import BadRequest, ConnectionFailed, ProtocolError, StreamError
from streamkeep.client.http import HeaderMap, HttpTransport, Params

LiveMode = Literal[False, "long-poll", "sse", "auto"]
_Phase = Literal["catch-up", "long-poll", "sse", "done"]


@dataclass(frozen=True)
class Batch:
    """What one answer (or one SSE data+control pair) held.

    `data` is the bytes (base64 already decoded); `messages` the JSON values for a JSON stream
    (the array flattened one level, §9.1), else None. `status` is the HTTP status of the answer. `offset` is where the batch starts and
    `next_offset` where the next read starts; `up_to_date` says the reader had caught up with the
    stream then, `closed` that nothing will ever follow (EOF)."""

    data: bytes
    messages: list[Any] | None
    offset: str
    next_offset: str
    up_to_date: bool
    closed: bool
    cursor: str | None
    # The answer's HTTP status: 204 for a long-poll that timed out (or an empty EOF), else 200
    # (SSE batches included).
    status: int = 200


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def is_json_type(content_type: str | None) -> bool:
    return media_type(content_type) == "application/json"


def _flag(headers: httpx.Headers, name: str) -> bool:
    return str(headers.get(name, "")).strip().lower() == "true"


def _json_body(body: bytes) -> list[Any]:
    if not body.strip():
        return []
    try:
        value = jsonlib.loads(body)
    except ValueError as exc:
        raise ProtocolError(f"a JSON stream answered a body that is not JSON: {body[:200]!r}") from exc
    return value if isinstance(value, list) else [value]


class _SseConnection:
    """One open SSE response and what has been parsed of it."""

    def __init__(self, response: httpx.Response, stack: AsyncExitStack) -> None:
        self.response = response
        self.stack = stack
        self.chunks = response.aiter_bytes()
        self.parser = sse.SseParser()
        self.events: deque[sse.SseEvent] = deque()
        self.base64 = response.headers.get("stream-sse-data-encoding", "").strip().lower() == "base64"
        self.saw_control = False

    async def close(self) -> None:
        """Ends the body's iterator first (so no suspended generator is left for a finalizer),
        then the response."""
        try:
            closer = getattr(self.chunks, "aclose", None)
            if closer is not None:
                await closer()
        finally:
            await self.stack.aclose()

    async def next_event(self) -> sse.SseEvent | None:
        """The next event, or None when the server ended the response."""
        while not self.events:
            try:
                chunk = await self.chunks.__anext__()
            except StopAsyncIteration:
                return None
            self.events.extend(self.parser.feed(chunk))
        return self.events.popleft()


class Reader:
    """An async iterator of `Batch`es from `offset` ("-1": the start, "now": the tail, or any
    offset a server returned).

    `live`: False reads what is there and stops once up to date; "long-poll" and "sse" catch up and
    then wait for more until the stream is closed; "auto" catches up with plain reads, then
    follows with SSE, or long-polls where the server refuses SSE. `json`: whether to parse
    messages; None decides from the stream's content type."""

    def __init__(
        self,
        transport: HttpTransport,
        url: str,
        *,
        offset: str = "-1",
        live: LiveMode = False,
        json: bool | None = None,
        cursor: str | None = None,
        content_type: str | None = None,
        params: Params | None = None,
        headers: HeaderMap | None = None,
    ) -> None:
        if live not in (False, "long-poll", "sse", "auto"):
            raise ValueError(f"live must be False, 'long-poll', 'sse' or 'auto', not {live!r}")
        self._transport = transport
        self._url = url
        self._offset = offset
        self._live: LiveMode = live
        self._json = json
        self._cursor = cursor
        self._content_type = content_type
        self._params = dict(params or {})
        self._headers = dict(headers or {})
        self._up_to_date = False
        self._closed = False
        self._announced_up_to_date = False
        self._failures = 0
        self._sse: _SseConnection | None = None
        self._phase: _Phase = "catch-up"
        if live == "sse" or (live in ("long-poll", "auto") and offset == "now"):
            # SSE straight away: one connection sends the history and then follows. From "now"
            # there is nothing to catch up with.
            self._phase = "sse" if live in ("sse", "auto") else "long-poll"

    @property
    def offset(self) -> str:
        """Where the next read starts: persist it to resume later with `read(offset=...)`."""
        return self._offset

    @property
    def cursor(self) -> str | None:
        return self._cursor

    @property
    def up_to_date(self) -> bool:
        return self._up_to_date

    @property
    def closed(self) -> bool:
        """The stream is closed and everything in it was read (EOF)."""
        return self._closed

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Batch:
        while True:
            if self._phase == "done":
                await self.aclose()
                raise StopAsyncIteration
            if self._offset == "now" and not await self._resolve_now():
                continue
            if self._phase == "sse":
                batch = await self._next_sse()
            else:
                batch = await self._next_plain()
            if batch is not None and self._should_yield(batch):
                return batch

    def messages(self) -> Messages:
        """The messages one by one: JSON values for a JSON stream, else each batch's bytes."""
        return Messages(self)

    async def aclose(self) -> None:
        """Ends an open SSE response; the reader can go on later from `offset`."""
        connection, self._sse = self._sse, None
        if connection is not None:
            await connection.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- what to hand out -------------------------------------------------------------------

    def _should_yield(self, batch: Batch) -> bool:
        """Every batch with data; an empty one only when it says something new: the reader has
        just caught up, or the stream ended."""
        if batch.data or batch.messages:
            self._announced_up_to_date = batch.up_to_date
            return True
        if batch.closed or (batch.up_to_date and not self._announced_up_to_date):
            self._announced_up_to_date = True
            return True
        return False

    def _advance(self, next_offset: str | None, cursor: str | None, up_to_date: bool, closed: bool) -> None:
        if next_offset:
            self._offset = next_offset
        if cursor:
            self._cursor = cursor
        self._up_to_date = up_to_date or closed
        self._closed = closed
        self._failures = 0
        if closed:
            self._phase = "done"
        elif up_to_date and self._phase == "catch-up":
            self._phase = self._live_phase()

    def _live_phase(self) -> _Phase:
        if self._live is False:
            return "done"
        if self._live == "long-poll":
            return "long-poll"
        return "sse"

    def _is_json(self, content_type: str | None) -> bool:
        if self._json is not None:
            return self._json
        return is_json_type(content_type)

    def _query(self, live: str | None) -> dict[str, str]:
        """Query parameters in lexicographic order of their names (PROTOCOL.md §10.1: better CDN
        hit rates), a signed link's own among them."""
        query = dict(self._params)
        query["offset"] = self._offset
        if live is not None:
            query["live"] = live
            if self._cursor:
                query["cursor"] = self._cursor
        return dict(sorted(query.items()))

    async def _pause_after_failure(self, exc: Exception) -> None:
        """Backs off before resuming; past the transport's retry budget the failure is raised."""
        policy = self._transport.retry
        if self._failures >= policy.attempts:
            raise ConnectionFailed(
                f"reading {self._url} failed {self._failures + 1} times in a row: {type(exc).__name__}: {exc}",
                url=self._transport.url_for(self._url),
            ) from exc
        await anyio.sleep(policy.wait(self._failures))
        self._failures += 1

    async def _resolve_now(self) -> bool:
        """Turns "now" into the tail's concrete offset (HEAD) before the first read: a first
        long-poll or SSE connection that broke and were repeated with "now" would start at the
        tail of that later moment and skip what was appended in between. False after a failure
        (paused; the caller tries again)."""
        try:
            head = await self._transport.request(
                "HEAD", self._url, params=self._params or None, headers=self._headers
            )
        except ConnectionFailed as exc:
            await self._pause_after_failure(exc)
            return False
        next_offset = head.headers.get("stream-next-offset")
        if not next_offset:
            raise ProtocolError(
                "HEAD answered without Stream-Next-Offset: offset=now cannot be resolved",
                url=str(head.url),
            )
        if self._content_type is None:
            self._content_type = head.headers.get("content-type")
        self._offset = next_offset
        return True

    # -- catch-up and long-poll ------------------------------------------------------------

    async def _next_plain(self) -> Batch | None:
        live = "long-poll" if self._phase == "long-poll" else None
        start = self._offset
        try:
            response = await self._transport.request(
                "GET",
                self._url,
                params=self._query(live),
                headers=self._headers,
                timeouts=self._transport.live_timeout_config() if live else None,
            )
        except ConnectionFailed as exc:
            # The transport retried already; a long-poll reader keeps going a while longer.
            await self._pause_after_failure(exc)
            return None
        headers = response.headers
        content_type = headers.get("content-type") or self._content_type
        if content_type and response.status_code == 200:
            self._content_type = content_type
        next_offset = headers.get("stream-next-offset")
        if not next_offset:
            # Without it the reader cannot move on: it would ask for the same offset forever.
            raise ProtocolError(
                f"a read answered {response.status_code} without Stream-Next-Offset",
                url=str(response.url),
            )
        up_to_date = "stream-up-to-date" in headers
        closed = _flag(headers, "stream-closed")
        cursor = headers.get("stream-cursor")
        if response.status_code == 204:  # a long-poll that timed out, or EOF
            self._advance(next_offset, cursor, True, closed)
            return Batch(b"", None, start, self._offset, True, closed, self._cursor, status=204)
        body = response.content
        messages = _json_body(body) if self._is_json(content_type) else None
        data = body if messages is None or messages else b""
        self._advance(next_offset, cursor, up_to_date, closed)
        return Batch(
            data,
            messages,
            start,
            self._offset,
            self._up_to_date,
            closed,
            self._cursor,
            status=response.status_code,
        )

    # -- SSE --------------------------------------------------------------------------------

    async def _open_sse(self) -> _SseConnection | None:
        """Opens the SSE response at the current offset; None when "auto" falls back to
        long-poll because the server refused SSE."""
        if self._json is None and self._content_type is None:
            # SSE answers are text/event-stream: the stream's own type comes from a HEAD.
            head = await self._transport.request(
                "HEAD", self._url, params=self._params or None, headers=self._headers
            )
            self._content_type = head.headers.get("content-type")
        stack = AsyncExitStack()
        try:
            response = await stack.enter_async_context(
                self._transport.stream("GET", self._url, params=self._query("sse"), headers=self._headers)
            )
        except BadRequest:
            await stack.aclose()
            if self._live == "auto":
                self._phase = "long-poll"
                return None
            raise
        except BaseException:
            await stack.aclose()
            raise
        if media_type(response.headers.get("content-type")) != "text/event-stream":
            await stack.aclose()
            if self._live == "auto":
                self._phase = "long-poll"
                return None
            raise StreamError(
                f"live=sse answered {response.headers.get('content-type')!r}, not text/event-stream",
                status=response.status_code,
                url=str(response.url),
            )
        return _SseConnection(response, stack)

    async def _next_sse(self) -> Batch | None:
        try:
            if self._sse is None:
                self._sse = await self._open_sse()
                if self._sse is None:
                    return None
            return await self._read_sse_batch(self._sse)
        except (httpx.TransportError, ConnectionFailed) as exc:
            await self.aclose()
            await self._pause_after_failure(exc)
            return None

    async def _read_sse_batch(self, connection: _SseConnection) -> Batch | None:
        """Reads events up to the next `control` and makes their batch; None when the server
        ended the response (the next call reconnects from the last control's offset)."""
        start = self._offset
        json_mode = self._is_json(self._content_type)
        parts: list[bytes] = []
        messages: list[Any] | None = [] if json_mode else None
        while True:
            event = await connection.next_event()
            if event is None:
                saw_control = connection.saw_control
                await self.aclose()
                if not saw_control:  # ended with nothing said: not a busy loop of reconnects
                    await self._pause_after_failure(ConnectionError("the SSE response ended at once"))
                return None
            if event.event == "data":
                if messages is not None:
                    messages.extend(sse.json_messages(event.data))
                    parts.append(event.data.encode("utf-8"))
                else:
                    parts.append(sse.decode_data(event.data, base64_mode=connection.base64))
            elif event.event == "control":
                control = sse.parse_control(event.data)
                connection.saw_control = True
                self._advance(control.next_offset, control.cursor, control.up_to_date, control.closed)
                if self._phase == "done":
                    await self.aclose()
                if messages is not None:
                    data = parts[0] if len(parts) == 1 else self._render_json(messages)
                else:
                    data = b"".join(parts)
                return Batch(
                    data, messages, start, self._offset, self._up_to_date, self._closed, self._cursor
                )

    @staticmethod
    def _render_json(messages: list[Any]) -> bytes:
        if not messages:
            return b""
        return jsonlib.dumps(messages, separators=(",", ":")).encode()


class Messages:
    """The messages of a `Reader`, one at a time (see `Reader.messages`)."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self._pending: deque[Any] = deque()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Any:
        while not self._pending:
            batch = await self.reader.__anext__()
            if batch.messages is not None:
                self._pending.extend(batch.messages)
            elif batch.data:
                self._pending.append(batch.data)
        return self._pending.popleft()

    async def aclose(self) -> None:
        await self.reader.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.reader.aclose()


__all__ = ["Batch", "LiveMode", "Messages", "Reader", "is_json_type", "media_type"]
