"""The request path between the HTTP edge and the actors, with no HTTP library in it.

`Service.handle` takes a `Request` through the same steps every time: authenticate (the gate),
classify (`protocol/routes.py`), place (in a cluster: forward to the stream's owner), authorize,
dispatch to the handler of the request's kind, finish (`server/finish.py`). An append whose
stream's actor is idle skips the awaits: `begin` answers it in the caller's task.

A `Service` gets all its parts when it is built. The parts that exist only once recovery finished
(the registry, compaction, subscriptions) come together in `serve_streams`; until then streams,
subscriptions and the admin API answer 503 while the probes answer.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from streamkeep.actors.mailbox import NotNow
from streamkeep.actors.messages import DELETE, HEAD, Append, Create
from streamkeep.actors.replies import PendingAppend
from streamkeep.actors.supervisor import Supervisor
from streamkeep.auth.errors import AuthError
from streamkeep.auth.gate import Gate, auth_response
from streamkeep.auth.tokens import Principal
from streamkeep.cluster.forward import HEADER
from streamkeep.cluster.placement import Member
from streamkeep.compaction import Compactor
from streamkeep.health import Health
from streamkeep.protocol import offsets, responses, routes
from streamkeep.protocol.cors import Cors
from streamkeep.protocol.errors import ProtocolError, bad_request
from streamkeep.protocol.model import Request, Response
from streamkeep.protocol.names import CLUSTER_PREFIX, STREAM_PREFIX
from streamkeep.protocol.stream import AppendSpec, CreateSpec
from streamkeep.registry import entries as registry_entries
from streamkeep.registry.keeper import RegistryKeeper
from streamkeep.server import admin, probes
from streamkeep.server.fanout import Spawn
from streamkeep.server.finish import Finish, failure
from streamkeep.server.forwarding import FrontDoor
from streamkeep.server.live import LiveReads, credential_deadline
from streamkeep.server.probes import ReadinessCheck, Sections, Stats
from streamkeep.server.reads import Reads
from streamkeep.subscriptions.manager import SubscriptionManager
from streamkeep.telemetry.requests import RequestStats
from streamkeep.ui import UiFiles

Handler = Callable[[Request, routes.Route], Awaitable[Response]]


def not_ready(reason: str) -> ProtocolError:
    return ProtocolError(503, "not_ready", f"the server is not ready yet: {reason}", [("Retry-After", "1")])


@dataclass(frozen=True)
class ServiceOptions:
    long_poll_timeout: float = 30.0
    sse_close_after: float = 60.0
    read_chunk_bytes: int = 1 << 20
    cors_origins: str = "*"
    cache_visibility: str = "public"
    # Recent changes kept per stream for live readers to share (see server/fanout.py).
    live_window_bytes: int = 4 << 20
    # A streaming response (SSE) whose client takes no bytes for this long is disconnected.
    send_stall_timeout: float = 30.0


@dataclass(frozen=True)
class Recovered:
    """The parts that exist once recovery finished; each None where it is off."""

    # The keeper of `__registry__` (None: --no-registry, or another member keeps it).
    registry: RegistryKeeper | None = None
    compactor: Compactor | None = None  # disk storage only
    subscriptions: SubscriptionManager | None = None


class Service:
    def __init__(
        self,
        supervisor: Supervisor,
        options: ServiceOptions | None = None,
        *,
        gate: Gate | None = None,
        request_stats: RequestStats | None = None,
        ui: UiFiles | None = None,
        cluster: FrontDoor | None = None,
        readiness: ReadinessCheck | None = None,
        metrics_page: Callable[[], bytes] | None = None,
        spawn: Spawn | None = None,
        health: Health | None = None,
        sections: Sections | None = None,
        recovering: str | None = None,
    ) -> None:
        """`gate` None: auth off; `request_stats` None: no request metrics or access log; `ui`
        None: no stream browser; `cluster` None: alone; `metrics_page` None: /metrics is 404 (off,
        or on its own port); `spawn` runs live fan-out's push loops (None: subscribers wake and
        send themselves); `sections`: the other parts' /stats sections, by name, filled in by
        whoever starts them. `recovering`: why streams cannot be served yet, until
        `serve_streams`; None: served at once, with no recovered parts."""
        self.supervisor = supervisor
        self.options = options = ServiceOptions() if options is None else options
        self.gate = gate
        self.request_stats = request_stats
        self.ui = ui
        self.cluster = cluster
        self.readiness = readiness
        self.metrics_page = metrics_page
        self.health = Health() if health is None else health
        self.cors = Cors(options.cors_origins)
        self.requests_by_http_version: Counter[str] = Counter()
        self.appends = 0  # acknowledged appends (a producer's duplicate counts: it was answered)
        self.appended_bytes = 0
        self.reads = Reads(supervisor, options.read_chunk_bytes, options.cache_visibility)
        self.live = LiveReads(
            supervisor,
            self.reads,
            long_poll_timeout=options.long_poll_timeout,
            sse_close_after=options.sse_close_after,
            window_bytes=options.live_window_bytes,
            spawn=spawn,
        )
        self.stats = Stats(
            supervisor,
            self.requests_by_http_version,
            self.live,
            self.health,
            {} if sections is None else sections,
        )
        self._finish = Finish(self.cors, request_stats, ui_on=ui is not None, auth_on=gate is not None).finish
        # Why streams cannot be served yet (recovery running), or None once they can.
        self.not_ready = recovering
        self.registry: RegistryKeeper | None = None
        self.compactor: Compactor | None = None
        self.subscriptions: SubscriptionManager | None = None
        self._handlers = self._dispatch_table()

    def serve_streams(self, recovered: Recovered) -> None:
        """Recovery finished: streams are served from now on, with these parts."""
        self.registry = recovered.registry
        self.compactor = recovered.compactor
        self.subscriptions = recovered.subscriptions
        self.not_ready = None

    def begin_shutdown(self) -> None:
        """Ends live reads cleanly: long-polls answer 204, SSE streams finish their last event."""
        self.live.stop()

    # ---- the pipeline ---------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        answer = self.begin(request)
        return answer if isinstance(answer, Response) else await answer

    def begin(self, request: Request) -> Response | Coroutine[Any, Any, Response]:
        """The response, when it can be given without waiting (an append whose stream's actor is
        idle and whose commit is done: memory storage, or a producer's duplicate), else the
        coroutine that gives it. The HTTP/2 edge runs a task only for the latter; a task per
        request was ~20 % of an in-memory append over h2c."""
        started = time.perf_counter()
        self.requests_by_http_version[request.http_version] += 1
        if self.gate is not None:
            return self._handle(request, started)  # authentication may wait (a JWKS fetch)
        route: routes.Route | None = None
        try:
            route = routes.classify(request)
            if self.cluster is not None:
                owner = self.cluster.owner_elsewhere(route, request)
                if owner is not None:
                    return self._forward(request, route, owner, started)
            if (route.kind != routes.APPEND and route.kind != routes.CLOSE) or self.not_ready is not None:
                return self._handle(request, started, route)
            if self.registry is not None:
                registry_entries.refuse_writes(route)
            assert route.name is not None
            spec = AppendSpec.from_request(request.headers, request.body)
            try:
                pending = self.supervisor.call_now(route.name, Append(spec))
            except NotNow:
                return self._handle(request, started, route)
            if not pending.commit.done:
                return self._answer_append(request, route, started, pending)
            response = self._appended(pending, request)
        except Exception as error:
            response = failure(error, request)
        return self._finish(response, request, routes.OTHER if route is None else route.kind, None, started)

    async def _handle(self, request: Request, started: float, route: routes.Route | None = None) -> Response:
        kind = routes.OTHER if route is None else route.kind
        principal: Principal | None = None
        try:
            if route is None:
                # Calls between members carry the cluster signature, not a client's token.
                internal = request.raw_path.startswith(CLUSTER_PREFIX)
                if self.gate is not None and not internal:
                    principal = await self.gate.authenticate(request)
                route = routes.classify(request)
                kind = route.kind
                if self.gate is not None and not internal:
                    self.gate.authorize(principal, route, request)
                    request.principal = principal
                if self.cluster is not None:
                    owner = self.cluster.owner_elsewhere(route, request)
                    if owner is not None:
                        return await self._forward(request, route, owner, started, principal)
            response = await self._dispatch(request, route)
        except AuthError as err:
            response = auth_response(err)
            if kind == routes.OTHER:  # refused before it was classified: label it all the same
                try:
                    kind = routes.classify(request).kind
                except ProtocolError:
                    pass
        except Exception as error:
            response = failure(error, request)
        return self._finish(response, request, kind, principal, started)

    async def _forward(
        self,
        request: Request,
        route: routes.Route,
        owner: Member,
        started: float,
        principal: Principal | None = None,
    ) -> Response:
        assert self.cluster is not None and self.cluster.forwarder is not None
        try:
            response = await self.cluster.forwarder.forward(request, owner)
        except Exception as error:
            return self._finish(failure(error, request), request, route.kind, principal, started)
        # The owner's answer carries its own CORS and safety headers already.
        return self._finish(response, request, route.kind, principal, started, relayed=True)

    async def _answer_append(
        self, request: Request, route: routes.Route, started: float, pending: PendingAppend
    ) -> Response:
        try:
            await pending.commit.settled()
            response = self._appended(pending, request)
        except Exception as error:
            response = failure(error, request)
        return self._finish(response, request, route.kind, None, started)

    async def _dispatch(self, request: Request, route: routes.Route) -> Response:
        if route.name is not None:
            if self.not_ready is not None:
                raise not_ready(self.not_ready)
            if self.registry is not None:
                registry_entries.refuse_writes(route)  # only the server writes `__registry__`
        handler = self._handlers.get(route.kind)
        if handler is None:
            raise ProtocolError(
                404, "not_found", f"no such endpoint; streams live under {STREAM_PREFIX}<name>"
            )
        return await handler(request, route)

    def _dispatch_table(self) -> dict[str, Handler]:
        """Each kind's handler; a part that is off leaves its kinds out (404)."""
        table: dict[str, Handler] = {
            routes.APPEND: self._append,
            routes.CLOSE: self._append,
            routes.READ: self._read,
            routes.LIVE_READ: self._read,
            routes.HEAD: self._head,
            routes.CREATE: self._create,
            routes.FORK: self._create,
            routes.DELETE: self._delete,
            routes.COMPACT: self._compact,
            routes.ADMIN_STREAM: self._admin_stream,
            routes.PREFLIGHT: self._preflight,
            routes.HEALTH: self._alive,
            routes.READY: self._ready,
            routes.STATS: self._stats,
            routes.ADMIN_STREAMS: self._admin_streams,
            routes.SUBSCRIPTION: self._subscriptions,
        }
        if self.cluster is not None:
            table[routes.INTERNAL] = self._from_member
        if self.metrics_page is not None:
            table[routes.METRICS] = self._metrics
        if self.ui is not None:
            table[routes.UI] = self._ui
        return table

    def _refuse_until_ready(self) -> None:
        if self.not_ready is not None:
            raise not_ready(self.not_ready)

    # ---- streams --------------------------------------------------------------------

    async def _create(self, request: Request, route: routes.Route) -> Response:
        assert route.name is not None
        spec = CreateSpec.from_request(request.headers, request.body)
        status, view = await self.supervisor.call(route.name, Create(spec), must_exist=False)
        host = request.headers.get("host") or "localhost"
        location = f"{request.scheme}://{host}{request.raw_path}"
        return responses.created(status, view.meta, view.tail, location)

    async def _append(self, request: Request, route: routes.Route) -> Response:
        assert route.name is not None
        spec = AppendSpec.from_request(request.headers, request.body)
        pending = await self.supervisor.call(route.name, Append(spec))
        await pending.commit.settled()  # outside the actor: it sequences the next append meanwhile
        return self._appended(pending, request)

    def _appended(self, pending: PendingAppend, request: Request) -> Response:
        """The answer to an append whose commit is done."""
        outcome = pending.result()
        if outcome.status < 300:
            self.appends += 1
            self.appended_bytes += len(request.body)
        return Response(outcome.status, outcome.headers(pending.incarnation))

    async def _head(self, request: Request, route: routes.Route) -> Response:
        assert route.name is not None
        view = await self.supervisor.call(route.name, HEAD)
        return responses.head(view.meta, view.tail, view.floor)

    async def _delete(self, request: Request, route: routes.Route) -> Response:
        assert route.name is not None
        await self.supervisor.call(route.name, DELETE)
        return Response(204)

    async def _read(self, request: Request, route: routes.Route) -> Response:
        name = route.name
        assert name is not None
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
            until = credential_deadline(request)
            return await self.live.sse(
                name, start if start is not None else "-1", cursor, request.push, until
            )
        if live == "long-poll":
            assert start is not None
            return await self.live.long_poll(name, start, cursor, request)
        return await self.reads.catch_up(name, start if start is not None else "-1", request)

    async def _compact(self, request: Request, route: routes.Route) -> Response:
        assert route.name is not None
        if self.compactor is None:
            raise ProtocolError(
                409, "compaction_needs_disk", "compaction needs disk storage (--storage disk)"
            )
        drop = request.query("drop_invalid")
        progress = self.compactor.start(route.name, drop_invalid=bool(drop) and drop[0] in ("1", "true"))
        headers = [("Content-Type", "application/x-ndjson"), ("Cache-Control", "no-store")]
        return Response(200, headers, stream=self.compactor.lines(progress))

    # ---- the admin API and subscriptions --------------------------------------------

    async def _admin_stream(self, request: Request, route: routes.Route) -> Response:
        assert route.name is not None
        readable = admin.readable_by(self.gate, request)
        readers = self.live.readers_by_stream()[route.name]
        return admin.stream(
            self.supervisor.storage, route.name, request, readable, readers, self.subscriptions
        )

    async def _admin_streams(self, request: Request, route: routes.Route) -> Response:
        self._refuse_until_ready()
        readable = admin.readable_by(self.gate, request)
        appended = (self.appends, self.appended_bytes)
        mine = admin.streams(
            self.supervisor.storage, request, readable, self.live.readers_by_stream(), appended
        )
        cluster = self.cluster
        if cluster is not None and cluster.forwarder is not None and HEADER not in request.headers:
            return await cluster.cluster_streams(request, mine)
        return mine

    async def _subscriptions(self, request: Request, route: routes.Route) -> Response:
        self._refuse_until_ready()
        if self.subscriptions is None:
            raise ProtocolError(404, "reserved_path", "paths under /v1/stream/__ds/ are reserved")
        return await self.subscriptions.handle(request)

    async def _from_member(self, request: Request, route: routes.Route) -> Response:
        assert self.cluster is not None
        refusal = None if self.not_ready is None else not_ready(self.not_ready)
        return await self.cluster.answer_member(request, refusal)

    async def _ui(self, request: Request, route: routes.Route) -> Response:
        assert self.ui is not None
        return self.ui.serve(request)

    # ---- probes ---------------------------------------------------------------------

    async def _preflight(self, request: Request, route: routes.Route) -> Response:
        return responses.preflight()

    async def _alive(self, request: Request, route: routes.Route) -> Response:
        return probes.alive()

    async def _ready(self, request: Request, route: routes.Route) -> Response:
        return await self.ready()

    async def ready(self) -> Response:
        """`/readyz`, also on the metrics port."""
        return await probes.ready(self.not_ready, self.readiness)

    async def _metrics(self, request: Request, route: routes.Route) -> Response:
        assert self.metrics_page is not None
        return probes.metrics(self.metrics_page)

    async def _stats(self, request: Request, route: routes.Route) -> Response:
        cluster = self.cluster
        cluster_wide = request.query("cluster")[:1] in (["1"], ["true"])
        if (
            cluster_wide
            and cluster is not None
            and cluster.forwarder is not None
            and HEADER not in request.headers
        ):
            return await cluster.cluster_stats(
                request, self._own_stats
            )  # a member asking gets this member's own
        return responses.json_response(200, self._own_stats())

    def _own_stats(self) -> dict[str, object]:
        return self.stats.body(self.not_ready is None)


__all__ = ["Recovered", "Service", "ServiceOptions", "not_ready"]
