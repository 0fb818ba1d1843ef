"""The request path between the HTTP edge and the actors, with no HTTP framework in it.

`Service.handle` takes a `Request`, routes it, turns it into a message for the stream's actor, and
builds the `Response` from the actor's answer. Live reads (long-poll, SSE) wait here, outside the
actor, on the event the actor fires at each change.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import trio

from streamkeep.actors.stream_actor import StreamView
from streamkeep.actors.supervisor import Supervisor
from streamkeep.protocol import offsets, responses, sse
from streamkeep.protocol.cursor import response_cursor
from streamkeep.protocol.errors import ProtocolError, bad_request
from streamkeep.protocol.model import Request, Response
from streamkeep.protocol.names import STREAM_PREFIX, parse_stream_name
from streamkeep.protocol.stream import AppendSpec, CreateSpec
from streamkeep.storage import forks
from streamkeep.storage.base import StorageUnavailable
from streamkeep.subscriptions.manager import CONTROL_PREFIX, SubscriptionManager

log = logging.getLogger(__name__)

CATCH_UP_CACHE = "public, max-age=60, stale-while-revalidate=300"
STREAM_METHODS = "GET, HEAD, PUT, POST, DELETE, OPTIONS"


@dataclass(frozen=True)
class ReadView:
    view: StreamView
    start: int
    messages: list[bytes]
    next_position: int
    # Fires at the stream's next published change: what live readers wait on.
    changed: trio.Event

    @property
    def at_tail(self) -> bool:
        return self.next_position >= self.view.tail


@dataclass(frozen=True)
class ServiceOptions:
    long_poll_timeout: float = 30.0
    sse_close_after: float = 60.0
    read_chunk_bytes: int = 1 << 20
    cors_origin: str = "*"
    cache_visibility: str = "public"
    sweep_interval: float = 10.0


class Service:
    def __init__(self, supervisor: Supervisor, options: ServiceOptions) -> None:
        self.supervisor = supervisor
        self.options = options
        self.shutting_down = False
        self._shutdown = trio.Event()
        self._catch_up_cache = CATCH_UP_CACHE.replace("public", options.cache_visibility)
        self.requests_by_http_version: Counter[str] = Counter()
        self.subscriptions: SubscriptionManager | None = None

    # ---- lifecycle ------------------------------------------------------------------

    def begin_shutdown(self) -> None:
        """Ends live reads cleanly: long-polls answer 204, SSE streams finish their last event."""
        self.shutting_down = True
        self._shutdown.set()

    async def sweep_expired(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Deletes streams whose TTL or expiry passed, even if nobody asks for them again."""
        task_status.started()
        while True:
            await trio.sleep(self.options.sweep_interval)
            now = time.time()
            for name in self.supervisor.storage.names():
                stream_log = self.supervisor.storage.open(name)
                if stream_log is not None and stream_log.meta.expired(now):
                    try:
                        await self.supervisor.call(name, "head")
                    except ProtocolError:
                        pass

    # ---- routing --------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        self.requests_by_http_version[request.http_version] += 1
        try:
            response = await self._route(request)
        except ProtocolError as err:
            response = responses.error(err)
        except Exception:
            log.exception("%s %s failed", request.method, request.raw_path[:200])
            response = responses.error(
                ProtocolError(500, "internal_error", "the server failed this request; it has been logged")
            )
        response.headers.extend(responses.common_headers(self.options.cors_origin))
        return response

    async def _route(self, request: Request) -> Response:
        method = request.method
        if method == "OPTIONS":
            return responses.preflight()
        path = request.raw_path
        if path == "/healthz" and method in ("GET", "HEAD"):
            return Response(200, [("Content-Type", "text/plain"), ("Cache-Control", "no-store")], b"ok")
        if path == "/stats" and method == "GET":
            return self._stats()
        if path.startswith(CONTROL_PREFIX):
            if self.subscriptions is None:
                raise ProtocolError(404, "reserved_path", "paths under /v1/stream/__ds/ are reserved")
            return await self.subscriptions.handle(request)
        if not path.startswith(STREAM_PREFIX):
            raise ProtocolError(
                404, "not_found", f"no such endpoint; streams live under {STREAM_PREFIX}<name>"
            )
        name = parse_stream_name(path)
        if method == "PUT":
            return await self._create(name, request)
        if method == "POST":
            return await self._append(name, request)
        if method == "GET":
            return await self._read(name, request)
        if method == "HEAD":
            view = await self.supervisor.call(name, "head")
            return responses.head(view.meta, view.tail)
        if method == "DELETE":
            await self.supervisor.call(name, "delete")
            return Response(204)
        raise ProtocolError(
            405, "method_not_allowed", f"{method[:20]} is not a stream operation", [("Allow", STREAM_METHODS)]
        )

    def _stats(self) -> Response:
        storage = self.supervisor.storage
        body = {
            "streams": len(storage.names()),
            "stored_bytes": storage.budget.total_bytes,
            "actors_active": self.supervisor.active,
            "actors_spawned": self.supervisor.spawned,
            "requests_by_http_version": dict(self.requests_by_http_version),
        }
        return Response(
            200,
            [("Content-Type", "application/json"), ("Cache-Control", "no-store")],
            json.dumps(body).encode(),
        )

    # ---- writes ---------------------------------------------------------------------

    async def _create(self, name: str, request: Request) -> Response:
        spec = CreateSpec.from_request(request.headers, request.body)
        status, view = await self.supervisor.call(name, "create", spec, must_exist=False)
        host = request.headers.get("host") or "localhost"
        location = f"{request.scheme}://{host}{request.raw_path}"
        return responses.created(status, view.meta, view.tail, location)

    async def _append(self, name: str, request: Request) -> Response:
        spec = AppendSpec.from_request(request.headers, request.body)
        pending = await self.supervisor.call(name, "append", spec)
        outcome = await pending.wait()  # outside the actor: it sequences the next append meanwhile
        return Response(outcome.status, outcome.headers())

    # ---- reads ----------------------------------------------------------------------

    async def _read(self, name: str, request: Request) -> Response:
        start = offsets.parse_query_offset(request.query("offset"))
        live_values = request.query("live")
        live = live_values[0] if live_values else None
        cursor_values = request.query("cursor")
        cursor = cursor_values[0] if cursor_values else None
        if live not in (None, "long-poll", "sse"):
            raise bad_request("invalid_live", "live must be long-poll or sse")
        if live is not None and start is None:
            raise bad_request("missing_offset", f"live={live} needs an offset; use offset=-1 or offset=now")
        if live == "sse":
            return await self._sse(name, start if start is not None else "-1", cursor)
        if live == "long-poll":
            assert start is not None
            return await self._long_poll(name, start, cursor, request)
        return await self._catch_up(name, start if start is not None else "-1", request)

    async def _read_view(self, name: str, start: int | str, *, touch: bool = True) -> ReadView:
        plan = await self.supervisor.call(name, "read", start, touch)
        view = plan.view
        if plan.start >= view.tail:
            return ReadView(view, plan.start, [], view.tail, plan.changed)
        # Published bytes never change, so they are read here, outside the actor.
        try:
            result = await forks.read_range(
                self.supervisor.storage,
                plan.log,
                plan.start,
                self.options.read_chunk_bytes,
                whole_messages=view.meta.json_mode,
            )
        except StorageUnavailable as error:
            raise ProtocolError(
                error.status, "storage_unavailable", str(error), [("Retry-After", "1")]
            ) from None
        return ReadView(view, plan.start, result.messages, result.next_position, plan.changed)

    async def _catch_up(self, name: str, start: int | str, request: Request) -> Response:
        view = await self._read_view(name, start)
        meta = view.view.meta
        if start == offsets.NOW:
            headers = responses.stream_headers(meta, view.view.tail)
            headers += [("Stream-Up-To-Date", "true"), ("Cache-Control", responses.NO_STORE)]
            return Response(200, headers, b"[]" if meta.json_mode else b"")
        return self._data_response(view, start, request, cursor=None)

    def _data_response(
        self, view: ReadView, start: int | str, request: Request, *, cursor: str | None
    ) -> Response:
        meta = view.view.meta
        up_to_date = view.at_tail
        closed_at_end = meta.closed and up_to_date
        tag = responses.etag(meta, start, view.next_position, closed_at_end)
        headers = [
            ("Content-Type", meta.content_type),
            ("Stream-Next-Offset", offsets.encode(view.next_position)),
            ("ETag", tag),
            ("Cache-Control", self._catch_up_cache),
        ]
        if up_to_date:
            headers.append(("Stream-Up-To-Date", "true"))
        if closed_at_end:
            headers.append(("Stream-Closed", "true"))
        elif cursor is not None:
            headers.append(("Stream-Cursor", cursor))
        if responses.if_none_match_hits(request.headers.get("if-none-match"), tag):
            return Response(304, [h for h in headers if h[0] != "Content-Type"])
        return Response(200, headers, responses.body_for(meta, view.messages))

    async def _long_poll(self, name: str, start: int | str, cursor: str | None, request: Request) -> Response:
        with self.supervisor.live_reader(name):
            view = await self._read_view(name, start)
            position = view.start
            deadline = trio.current_time() + self.options.long_poll_timeout
            while not view.messages:
                meta = view.view.meta
                if meta.closed or self.shutting_down or trio.current_time() >= deadline:
                    headers = [
                        ("Stream-Next-Offset", offsets.encode(view.view.tail)),
                        ("Stream-Up-To-Date", "true"),
                        ("Cache-Control", responses.NO_STORE),
                    ]
                    if meta.closed:
                        headers.append(("Stream-Closed", "true"))
                    else:
                        headers.append(("Stream-Cursor", response_cursor(cursor)))
                    return Response(204, headers)
                await self._wait_for_change(view, deadline)
                view = await self._read_view(name, position)
        return self._data_response(view, start, request, cursor=response_cursor(cursor))

    async def _wait_for_change(self, view: ReadView, deadline: float) -> None:
        with trio.move_on_at(deadline):
            if not self.shutting_down:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_wait_then_cancel, view.changed, nursery.cancel_scope)
                    nursery.start_soon(_wait_then_cancel, self._shutdown, nursery.cancel_scope)

    async def _sse(self, name: str, start: int | str, cursor: str | None) -> Response:
        first = await self._read_view(name, start)  # errors become plain HTTP errors, not events
        meta = first.view.meta
        base64_mode = responses.sse_uses_base64(meta)
        headers = [
            ("Content-Type", "text/event-stream"),
            ("Cache-Control", "no-cache"),
            ("X-Accel-Buffering", "no"),
        ]
        if base64_mode:
            headers.append(("Stream-SSE-Data-Encoding", "base64"))
        return Response(200, headers, stream=self._sse_events(name, first, cursor, base64_mode))

    async def _sse_events(
        self, name: str, view: ReadView, cursor: str | None, base64_mode: bool
    ) -> AsyncIterator[bytes]:
        close_at = trio.current_time() + self.options.sse_close_after
        with self.supervisor.live_reader(name):
            position = view.start
            sent_control = False
            while True:
                meta = view.view.meta
                closed_at_end = meta.closed and view.at_tail
                next_token = offsets.encode(view.next_position)
                if view.messages:
                    payload = sse.data_payload(
                        view.messages, json_mode=meta.json_mode, base64_mode=base64_mode
                    )
                    yield sse.event("data", payload) + sse.control(
                        next_token,
                        cursor=response_cursor(cursor),
                        up_to_date=view.at_tail,
                        closed=closed_at_end,
                    )
                    sent_control = True
                elif not sent_control or closed_at_end:
                    yield sse.control(
                        next_token, cursor=response_cursor(cursor), up_to_date=True, closed=closed_at_end
                    )
                    sent_control = True
                if closed_at_end:
                    return
                position = view.next_position
                if view.at_tail:
                    deadline = min(close_at, trio.current_time() + self.options.long_poll_timeout)
                    if self.shutting_down or trio.current_time() >= close_at:
                        return
                    await self._wait_for_change(view, deadline)
                    if self.shutting_down or trio.current_time() >= close_at:
                        return
                    # A quiet spell gets a fresh control event: a keep-alive with a new cursor.
                    sent_control = view.changed.is_set()
                try:
                    view = await self._read_view(name, position)
                except ProtocolError:
                    return  # deleted or expired meanwhile: end the stream; a reconnect gets the 404


async def _wait_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


__all__ = ["Service", "ServiceOptions"]
