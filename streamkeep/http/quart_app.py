"""quart-trio adapter: HTTP request -> `protocol.model.Request` -> the service -> HTTP response.

The whole data plane runs in one `before_request` hook, so Quart's router never rewrites stream
paths (no slash merging or redirects) and routing stays in the framework-free core.
"""

from __future__ import annotations

from urllib.parse import quote

import trio
from quart import Response as QuartResponse
from quart import request
from quart_trio import QuartTrio

from streamkeep.http.budget import BodyBudget
from streamkeep.http.edge import Handler, body_timed_out, rejection
from streamkeep.protocol.errors import ProtocolError, body_too_large
from streamkeep.protocol.model import Headers, Request, Response


class BodyRejected(Exception):
    def __init__(self, error: ProtocolError) -> None:
        self.error = error


def create_app(
    service: Handler, *, max_body_bytes: int, body_timeout: float, budget: BodyBudget
) -> QuartTrio:
    app = QuartTrio("streamkeep")
    # Our own limits replace Quart's: its 16 MiB cap and 60 s body/response timeouts would cut
    # large appends and every SSE or long-poll response.
    app.config.update(MAX_CONTENT_LENGTH=None, BODY_TIMEOUT=None, RESPONSE_TIMEOUT=None)

    @app.before_request
    async def data_plane() -> QuartResponse:
        charged: list[int] = [0]
        try:
            return await _handle(charged)
        finally:
            budget.release(charged[0])

    async def _handle(charged: list[int]) -> QuartResponse:
        try:
            with trio.fail_after(body_timeout):
                body = await _read_body(max_body_bytes, budget, charged)
        except trio.TooSlowError:
            return _refuse(body_timed_out(body_timeout))
        except BodyRejected as rejected:
            return _refuse(rejected.error)
        raw_path = request.scope.get("raw_path")
        core = Request(
            method=request.method,
            raw_path=raw_path.decode("latin-1") if raw_path else quote(request.path),
            query_string=request.scope.get("query_string", b"").decode("latin-1"),
            headers=Headers(list(request.headers.items())),
            body=body,
            scheme=request.scheme,
            http_version=request.http_version,
        )
        core.client = request.remote_addr or ""
        return _to_quart(await service.handle(core))

    def _refuse(error: ProtocolError) -> QuartResponse:
        response = rejection(service, error)
        response.headers.append(("Connection", "close"))
        return _to_quart(response)

    return app


async def _read_body(limit: int, budget: BodyBudget, charged: list[int]) -> bytes:
    if request.method in ("GET", "HEAD", "OPTIONS", "DELETE") and not request.content_length:
        return b""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyRejected(body_too_large(limit))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.body:
        size += len(chunk)
        if size > limit:
            raise BodyRejected(body_too_large(limit))
        try:
            budget.charge(len(chunk))
        except ProtocolError as error:
            raise BodyRejected(error) from None
        charged[0] += len(chunk)
        chunks.append(chunk)
    return b"".join(chunks)


def _to_quart(response: Response) -> QuartResponse:
    body = response.stream if response.stream is not None else response.body
    out = QuartResponse(body, status=response.status)
    del out.headers["Content-Type"]
    for name, value in response.headers:
        out.headers.add(name, value)
    if response.stream is not None:
        out.timeout = None
    elif response.status in (204, 304):
        del out.headers["Content-Length"]
    return out
