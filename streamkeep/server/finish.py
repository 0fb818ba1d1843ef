"""The last step of every request: the headers every response carries, and its accounting."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from streamkeep.auth.tokens import Principal
from streamkeep.protocol import responses, routes
from streamkeep.protocol.cors import Cors
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.model import Request, Response
from streamkeep.telemetry.requests import RequestStats

log = logging.getLogger(__name__)


def failure(error: Exception, request: Request) -> Response:
    """The answer to a request that raised: its protocol error, or a logged 500."""
    if isinstance(error, ProtocolError):
        return responses.error(error)
    log.exception("%s %s failed", request.method, request.raw_path[:200])
    return responses.error(
        ProtocolError(500, "internal_error", "the server failed this request; it has been logged")
    )


class Finish:
    def __init__(self, cors: Cors, request_stats: RequestStats | None, *, ui_on: bool, auth_on: bool) -> None:
        self.cors = cors
        self.request_stats = request_stats
        self.ui_on = ui_on
        self.auth_on = auth_on

    def finish(
        self,
        response: Response,
        request: Request,
        kind: str,
        principal: Principal | None,
        started: float,
        *,
        relayed: bool = False,
    ) -> Response:
        """What every response carries (CORS, sandbox, Vary; a relayed one has them from its
        member) and the request's accounting."""
        if not relayed:
            response.headers.extend(self.cors.headers(request.headers))
            if kind != routes.UI or not self.ui_on:
                # Only the UI's own files may run script in this origin: a stream of text/html or
                # image/svg+xml opened directly renders in an opaque origin, away from the UI's token.
                response.headers.append(responses.SANDBOX)
            if self.auth_on:
                response.headers.append(("Vary", "Authorization"))
        if self.request_stats is not None:
            subject = principal.subject if principal is not None else None
            if response.stream is not None and not relayed:
                response.stream = self._counted(response.stream, response, request, kind, started, subject)
            else:
                self.request_stats.finish(
                    method=request.method,
                    route=kind,
                    status=response.status,
                    http_version=request.http_version,
                    started=started,
                    sent=len(response.body),  # a relayed stream's bytes are counted by its owner
                    client=request.client,
                    target=request.target,
                    subject=subject,
                )
        return response

    async def _counted(
        self,
        stream: AsyncIterator[bytes],
        response: Response,
        request: Request,
        kind: str,
        started: float,
        subject: str | None,
    ) -> AsyncIterator[bytes]:
        """A streaming body (`stream`, the response's own) that counts its bytes and is accounted
        for when it ends."""
        status, tally = response.status, response.tally
        sent = 0
        try:
            async for chunk in stream:
                sent += len(chunk)
                yield chunk
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
            assert self.request_stats is not None
            self.request_stats.finish(
                method=request.method,
                route=kind,
                status=status,
                http_version=request.http_version,
                started=started,
                sent=sent + (tally.pushed if tally is not None else 0),
                client=request.client,
                target=request.target,
                subject=subject,
            )


__all__ = ["Finish", "failure"]
