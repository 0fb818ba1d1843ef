"""What `--metrics-port` serves: `/metrics`, `/healthz` and `/readyz`, nothing else, without auth.

A port of its own keeps the metrics off the public listener (and its auth) altogether: bind it
where only Prometheus reaches. The lean edge serves it; this is the service it calls.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from streamkeep.protocol import responses, routes
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.model import Request, Response
from streamkeep.server import probes
from streamkeep.server.service import Service


class MetricsEndpoint:
    def __init__(self, service: Service, page: Callable[[], bytes]) -> None:
        self.service = service
        self.page = page
        self.options = service.options  # the edge reads its stall timeout
        self.cors = service.cors

    def begin(self, request: Request) -> Coroutine[Any, Any, Response]:
        """As Service.begin: the HTTP/2 edge asks this first (nothing here is answered at once)."""
        return self.handle(request)

    async def handle(self, request: Request) -> Response:
        route = (
            routes.classify(request)
            if not request.raw_path.startswith("/v1/")
            else routes.Route(routes.OTHER)
        )
        if route.kind == routes.METRICS:
            return probes.metrics(self.page)
        if route.kind == routes.HEALTH:
            return probes.alive()
        if route.kind == routes.READY:
            return await self.service.ready()
        return responses.error(
            ProtocolError(404, "not_found", "this port serves /metrics, /healthz and /readyz only")
        )
