"""Catch-up reads (`GET /v1/stream/<name>?offset=...`) and the data response every read answers with.

The actor says what to read (`actors.reads.read`); this turns the read into the protocol's answer:
its offsets, ETag, caching and the body, or a 304 when the client's copy is current.
"""

from __future__ import annotations

from streamkeep.actors import reads
from streamkeep.actors.reads import ReadView
from streamkeep.actors.supervisor import Supervisor
from streamkeep.protocol import offsets, responses
from streamkeep.protocol.model import Request, Response
from streamkeep.protocol.offsets import Offset

CATCH_UP_CACHE = "public, max-age=60, stale-while-revalidate=300"


class Reads:
    def __init__(self, supervisor: Supervisor, chunk_bytes: int, cache_visibility: str) -> None:
        self.supervisor = supervisor
        self.chunk_bytes = chunk_bytes
        self._catch_up_cache = CATCH_UP_CACHE.replace("public", cache_visibility)
        self._entry_cache = f"{cache_visibility}, no-cache"

    async def view(self, name: str, start: Offset | str) -> ReadView:
        return await reads.read(self.supervisor, name, start, self.chunk_bytes)

    async def catch_up(self, name: str, start: Offset | str, request: Request) -> Response:
        view = await self.view(name, start)
        meta = view.view.meta
        if start == offsets.NOW:
            headers = responses.stream_headers(meta, view.view.tail)
            headers += [("Stream-Up-To-Date", "true"), ("Cache-Control", responses.NO_STORE)]
            return Response(200, headers, b"[]" if meta.json_mode else b"")
        return self.data_response(view, start, request, cursor=None)

    def data_response(
        self,
        view: ReadView,
        start: Offset | str,
        request: Request,
        *,
        cursor: str | None,
        body: bytes | None = None,
        up_to_date: bool | None = None,
    ) -> Response:
        meta = view.view.meta
        if up_to_date is None:
            up_to_date = view.at_tail
        closed_at_end = meta.closed and up_to_date
        tag = responses.etag(
            meta, start, view.next_position, closed_at_end, view.start if start == "-1" else 0
        )
        headers = [
            ("Content-Type", meta.content_type),
            ("Stream-Next-Offset", offsets.encode(view.next_position, meta.incarnation)),
            ("ETag", tag),
            ("Cache-Control", self._cache_control(start)),
        ]
        if up_to_date:
            headers.append(("Stream-Up-To-Date", "true"))
        if closed_at_end:
            headers.append(("Stream-Closed", "true"))
        elif cursor is not None:
            headers.append(("Stream-Cursor", cursor))
        if responses.if_none_match_hits(request.headers.get("if-none-match"), tag):
            return Response(304, [h for h in headers if h[0] != "Content-Type"])
        return Response(200, headers, responses.body_for(meta, view.messages) if body is None else body)

    def _cache_control(self, start: Offset | str) -> str:
        """A read at a token of this incarnation may be cached: its URL names this incarnation. A
        read at `-1` or at a token without one has the same URL for every stream ever created at
        this path, so a cache must revalidate it (the ETag names the stream id) before reuse."""
        if isinstance(start, Offset) and start.incarnation != offsets.ANY_INCARNATION:
            return self._catch_up_cache
        return self._entry_cache


__all__ = ["CATCH_UP_CACHE", "Reads"]
