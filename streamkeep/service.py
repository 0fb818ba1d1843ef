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
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import trio

from streamkeep import admin, routes
from streamkeep.actors.mailbox import NotNow
from streamkeep.actors.stream_actor import PendingAppend
from streamkeep.actors.supervisor import Supervisor
from streamkeep.auth.errors import AuthError
from streamkeep.auth.gate import Gate, auth_response
from streamkeep.auth.tokens import Principal
from streamkeep.cluster import peers
from streamkeep.cluster.forward import HEADER, STATS_SECONDS, Forwarder, as_the_client_sent, forwarded_by
from streamkeep.cluster.peers import PeerOps, Peers
from streamkeep.cluster.placement import Member, Placement
from streamkeep.compaction import Compactor
from streamkeep.health import Health
from streamkeep.live import Batch, LiveStream, ReadView
from streamkeep.protocol import offsets, responses, sse
from streamkeep.protocol.cors import Cors
from streamkeep.protocol.cursor import response_cursor
from streamkeep.protocol.errors import ProtocolError, bad_request, not_found
from streamkeep.protocol.model import Framed, PushTarget, Request, Response, Tally
from streamkeep.protocol.names import STREAM_PREFIX
from streamkeep.protocol.offsets import Offset
from streamkeep.protocol.stream import AppendSpec, CreateSpec
from streamkeep.registry import entries as registry_entries
from streamkeep.registry.keeper import RegistryKeeper
from streamkeep.storage import forks
from streamkeep.storage.errors import STORAGE_ERRORS, RetainedAway, as_protocol_error, below_floor
from streamkeep.subscriptions.manager import SubscriptionManager
from streamkeep.telemetry.requests import RequestStats
from streamkeep.ui import UiFiles

log = logging.getLogger(__name__)

CATCH_UP_CACHE = "public, max-age=60, stale-while-revalidate=300"
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def alive() -> Response:
    """`/healthz`: the liveness probe, on the main port and the metrics port alike."""
    return Response(200, [("Content-Type", "text/plain"), ("Cache-Control", "no-store")], b"ok")


def _member_stats(answer: Response | None) -> dict:
    """Another member's /stats as /stats?cluster=1 lists it: its own, or why it is missing."""
    if answer is None:
        return {"error": "unreachable: no answer"}
    if answer.status != 200 or not isinstance(answer.body, bytes):
        return {"error": f"answered {answer.status}"}
    return dict(json.loads(answer.body))


def stale_placement(why: str) -> ProtocolError:
    return ProtocolError(
        503, "stale_placement", f"{why}; retry once the cluster agrees on its members", [("Retry-After", "1")]
    )


def not_ready(reason: str) -> ProtocolError:
    return ProtocolError(503, "not_ready", f"the server is not ready yet: {reason}", [("Retry-After", "1")])


@dataclass(frozen=True)
class ServiceOptions:
    long_poll_timeout: float = 30.0
    sse_close_after: float = 60.0
    read_chunk_bytes: int = 1 << 20
    cors_origins: str = "*"
    cache_visibility: str = "public"
    sweep_interval: float = 10.0
    # Recent changes kept per stream for live readers to share (see streamkeep.live).
    live_window_bytes: int = 4 << 20
    # A streaming response (SSE) whose client takes no bytes for this long is disconnected.
    send_stall_timeout: float = 30.0


class Service:
    def __init__(self, supervisor: Supervisor, options: ServiceOptions) -> None:
        self.supervisor = supervisor
        self.options = options
        self.shutting_down = False
        self._catch_up_cache = CATCH_UP_CACHE.replace("public", options.cache_visibility)
        self._entry_cache = f"{options.cache_visibility}, no-cache"
        self.requests_by_http_version: Counter[str] = Counter()
        self.cors = Cors(options.cors_origins)
        # Auth (None: off), request metrics and the access log (None: off), set up by the server.
        self.gate: Gate | None = None
        self.request_stats: RequestStats | None = RequestStats()
        # Why streams cannot be served yet (recovery running), or None once they can; and the
        # readiness check behind /readyz (None: ready when `not_ready` is None).
        self.not_ready: str | None = None
        self.readiness: Callable[[], Awaitable[str | None]] | None = None
        # The Prometheus exposition served at /metrics (None: 404, metrics off or on their own port).
        self.metrics_page: Callable[[], bytes] | None = None
        self.live_readers: Counter[str] = Counter()  # live readers now, by mode
        self.compactor: Compactor | None = None  # disk storage only
        self.appends = 0  # acknowledged appends (a producer's duplicate counts: it was answered)
        self.appended_bytes = 0
        self.subscriptions: SubscriptionManager | None = None
        # The keeper of `__registry__` (None: --no-registry, the name is then an ordinary stream).
        self.registry: RegistryKeeper | None = None
        # The stream browser's files at /ui/ (None: off, 404), set up by the server.
        self.ui: UiFiles | None = None
        # In a cluster: who owns which stream, and which member this process is (None: alone).
        self.placement: Placement | None = None
        self.member_id = ""
        self.cluster_secret = ""
        self.forwarder: Forwarder | None = None  # None: refuse strangers' streams instead (421)
        # Calls to the other members (forks of their streams, subscriptions, the registry), and
        # the operations this member answers for them; None without a cluster secret.
        self.peers: Peers | None = None
        self.peer_ops = PeerOps()
        self.client_http_versions: Counter[str] = Counter()  # what clients spoke to the front door
        self._live: dict[tuple[str, int], LiveStream] = {}
        # Where live fan-out runs its push loops; without one, subscribers wake and send themselves.
        self.nursery: trio.Nursery | None = None
        # Background work started for the service (the TTL sweep), and the other parts'
        # /stats sections (storage, cold tier, subscriptions), registered by the server.
        self.health = Health()
        self.stats_sources: dict[str, Callable[[], dict]] = {}
        # How live readers got their data: one "shared" read served every reader of a change, "alone"
        # reads were a reader's own (catching up), "cached" re-polls needed no read at all.
        self.live_reads: Counter[str] = Counter()

    # ---- lifecycle ------------------------------------------------------------------

    def begin_shutdown(self) -> None:
        """Ends live reads cleanly: long-polls answer 204, SSE streams finish their last event."""
        self.shutting_down = True
        for live in self._live.values():
            live.wake_all()

    async def sweep_expired(self) -> None:
        """Deletes streams whose TTL or expiry passed, even if nobody asks for them again."""
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
                    await trio.lowlevel.checkpoint()  # a call may not yield (Supervisor.call)

    # ---- routing --------------------------------------------------------------------

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
            if self.placement is not None:
                owner = self._owner_elsewhere(route, request)
                if owner is not None:
                    return self._forward(request, route, owner, started)
            if (route.kind != routes.APPEND and route.kind != routes.CLOSE) or self.not_ready is not None:
                return self._handle(request, started, route)
            if self.registry is not None:
                registry_entries.refuse_writes(route)
            assert route.name is not None
            spec = AppendSpec.from_request(request.headers, request.body)
            try:
                pending = self.supervisor.call_now(route.name, "append", spec)
            except NotNow:
                return self._handle(request, started, route)
            if not pending.commit.done:
                return self._answer_append(request, route, started, pending)
            response = self._appended(pending, request)
        except Exception as error:
            response = self._failure(error, request)
        return self._finish(response, request, routes.OTHER if route is None else route.kind, None, started)

    async def _handle(self, request: Request, started: float, route: routes.Route | None = None) -> Response:
        kind = routes.OTHER if route is None else route.kind
        principal: Principal | None = None
        try:
            if route is None:
                # Calls between members carry the cluster signature, not a client's token.
                internal = request.raw_path.startswith(peers.PREFIX)
                if self.gate is not None and not internal:
                    principal = await self.gate.authenticate(request)
                route = routes.classify(request)
                kind = route.kind
                if self.gate is not None and not internal:
                    self.gate.authorize(principal, route, request)
                    request.principal = principal
                if self.placement is not None:
                    owner = self._owner_elsewhere(route, request)
                    if owner is not None:
                        return await self._forward(request, route, owner, started, principal)
            response = await self._route(request, route)
        except AuthError as err:
            response = auth_response(err)
            if kind == routes.OTHER:  # refused before it was classified: label it all the same
                try:
                    kind = routes.classify(request).kind
                except ProtocolError:
                    pass
        except Exception as error:
            response = self._failure(error, request)
        return self._finish(response, request, kind, principal, started)

    def _owner_elsewhere(self, route: routes.Route, request: Request) -> Member | None:
        """In a cluster, the member to forward to if another one owns the stream (None: it is ours).

        Refuses what must not be served here: a request routed under another placement epoch, or
        forwarded to us by a member that thinks we own a stream we do not (maps that disagree must
        never make two owners), and, without a cluster secret to forward with, a stranger's stream."""
        placement = self.placement
        assert placement is not None
        by = forwarded_by(request, self.cluster_secret, placement.members)
        as_the_client_sent(request, by)
        if by is None:
            version = request.headers.get("streamkeep-client-http-version")
            if version is not None:  # set by the front door (haproxy.py); a few known values only
                self.client_http_versions[version if version in ("1.0", "1.1", "2.0", "3.0") else "other"] += 1
        if route.name is None:
            return None
        epoch = request.headers.get("streamkeep-placement-epoch")
        if epoch is not None and epoch != str(placement.epoch):
            raise stale_placement(f"the request was routed by placement epoch {epoch[:20]}, this member runs {placement.epoch}")
        owner = placement.owner(route.name)
        if owner.id != self.member_id:
            if by is not None:
                raise stale_placement(f"member {by!r} forwarded a stream that member {owner.id!r} owns")
            if self.forwarder is None:
                raise ProtocolError(
                    421,
                    "not_owner",
                    f"stream {route.name[:200]!r} belongs to cluster member {owner.id!r}, this is "
                    f"{self.member_id!r}; send it through the load balancer",
                    [("Streamkeep-Owner", owner.id)],
                )
            return owner
        if (
            self.peers is None
            and route.fork_source is not None
            and placement.owner(route.fork_source).id != self.member_id
        ):
            raise ProtocolError(
                409,
                "fork_across_members",
                f"the fork source {route.fork_source[:200]!r} lives on cluster member "
                f"{placement.owner(route.fork_source).id!r}; forks across members need a cluster secret",
            )
        return None

    async def _forward(
        self, request: Request, route: routes.Route, owner: Member, started: float, principal: Principal | None = None
    ) -> Response:
        assert self.forwarder is not None
        try:
            response = await self.forwarder.forward(request, owner)
        except Exception as error:
            response = self._failure(error, request)
            return self._finish(response, request, route.kind, principal, started)
        # The owner's answer carries its own CORS and safety headers already.
        return self._finish(response, request, route.kind, principal, started, relayed=True)

    async def _answer_append(
        self, request: Request, route: routes.Route, started: float, pending: PendingAppend
    ) -> Response:
        try:
            await pending.commit.settled()
            response = self._appended(pending, request)
        except Exception as error:
            response = self._failure(error, request)
        return self._finish(response, request, route.kind, None, started)

    def _failure(self, error: Exception, request: Request) -> Response:
        if isinstance(error, ProtocolError):
            return responses.error(error)
        log.exception("%s %s failed", request.method, request.raw_path[:200])
        return responses.error(
            ProtocolError(500, "internal_error", "the server failed this request; it has been logged")
        )

    def _finish(
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
            if kind != routes.UI or self.ui is None:
                # Only the UI's own files may run script in this origin: a stream of text/html or
                # image/svg+xml opened directly renders in an opaque origin, away from the UI's token.
                response.headers.append(responses.SANDBOX)
            if self.gate is not None:
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

    async def _route(self, request: Request, route: routes.Route) -> Response:
        kind = route.kind
        name = route.name
        if name is not None:
            if self.not_ready is not None:
                raise not_ready(self.not_ready)
            if self.registry is not None:
                registry_entries.refuse_writes(route)  # only the server writes `__registry__`
            if kind == routes.APPEND or kind == routes.CLOSE:
                return await self._append(name, request)
            if kind == routes.READ or kind == routes.LIVE_READ:
                return await self._read(name, request)
            if kind == routes.HEAD:
                view = await self.supervisor.call(name, "head")
                return responses.head(view.meta, view.tail, view.floor)
            if kind == routes.CREATE or kind == routes.FORK:
                return await self._create(name, request)
            if kind == routes.DELETE:
                await self.supervisor.call(name, "delete")
                return Response(204)
            if kind == routes.COMPACT:
                return self._compact(name, request)
            if kind == routes.ADMIN_STREAM:
                return admin.stream(self, name, request)
        if kind == routes.INTERNAL and self.placement is not None:
            refusal = None if self.not_ready is None else not_ready(self.not_ready)
            return await self.peer_ops.answer(request, self.placement, self.cluster_secret, refusal)
        if kind == routes.PREFLIGHT:
            return responses.preflight()
        if kind == routes.HEALTH:
            return alive()
        if kind == routes.READY:
            return await self._ready()
        if kind == routes.METRICS and self.metrics_page is not None:
            return Response(
                200,
                [("Content-Type", METRICS_CONTENT_TYPE), ("Cache-Control", "no-store")],
                self.metrics_page(),
            )
        if kind == routes.STATS:
            cluster = request.query("cluster")[:1] in (["1"], ["true"])
            if cluster and self.forwarder is not None and HEADER not in request.headers:
                return await self._cluster_stats(request)  # a member asking gets this member's own
            return self._stats()
        if kind == routes.ADMIN_STREAMS:
            if self.not_ready is not None:
                raise not_ready(self.not_ready)
            if self.forwarder is not None and self.placement is not None and HEADER not in request.headers:
                return await self._cluster_streams(request)
            return admin.streams(self, request)
        if kind == routes.UI and self.ui is not None:
            return self.ui.serve(request)
        if kind == routes.SUBSCRIPTION:
            if self.not_ready is not None:
                raise not_ready(self.not_ready)
            if self.subscriptions is None:
                raise ProtocolError(404, "reserved_path", "paths under /v1/stream/__ds/ are reserved")
            return await self.subscriptions.handle(request)
        raise ProtocolError(404, "not_found", f"no such endpoint; streams live under {STREAM_PREFIX}<name>")

    def _compact(self, name: str, request: Request) -> Response:
        if self.compactor is None:
            raise ProtocolError(409, "compaction_needs_disk", "compaction needs disk storage (--storage disk)")
        drop = request.query("drop_invalid")
        progress = self.compactor.start(name, drop_invalid=bool(drop) and drop[0] in ("1", "true"))
        headers = [("Content-Type", "application/x-ndjson"), ("Cache-Control", "no-store")]
        return Response(200, headers, stream=self.compactor.lines(progress))

    async def _ready(self) -> Response:
        reason = self.not_ready
        if reason is None and self.readiness is not None:
            reason = await self.readiness()
        if reason is not None:
            body = json.dumps({"ready": False, "reason": reason}).encode()
            headers = [("Content-Type", "application/json"), ("Cache-Control", "no-store"), ("Retry-After", "1")]
            return Response(503, headers, body)
        return Response(
            200,
            [("Content-Type", "application/json"), ("Cache-Control", "no-store")],
            b'{"ready": true}',
        )

    def _stats(self) -> Response:
        body = self.stats()
        return Response(
            200,
            [("Content-Type", "application/json"), ("Cache-Control", "no-store")],
            json.dumps(body).encode(),
        )

    async def _cluster_stats(self, request: Request) -> Response:
        """`/stats?cluster=1`: every member's /stats side by side, and their sum of the counts that
        add up; a member that does not answer is listed as unreachable."""
        assert self.forwarder is not None and self.placement is not None
        others = [m for m in self.placement.members if m.id != self.member_id]
        answers = await self.forwarder.gather(request, others, STATS_SECONDS)
        views = {member: _member_stats(answer) for member, answer in answers.items()}
        views[self.member_id] = self.stats()
        totals = {
            key: sum(view.get(key, 0) for view in views.values() if isinstance(view.get(key), int))
            for key in ("streams", "stored_bytes", "actors_active", "live_readers")
        }
        body = {"members": views, "totals": totals, "reachable": sum("error" not in v for v in views.values())}
        return Response(200, [("Content-Type", "application/json"), ("Cache-Control", "no-store")], json.dumps(body).encode())

    async def _cluster_streams(self, request: Request) -> Response:
        """The stream browser's list in a cluster: every member's own list (each filtered by the
        caller's token on that member), merged by name; a member that does not answer is named."""
        assert self.forwarder is not None and self.placement is not None
        mine = json.loads(admin.streams(self, request).body)
        others = [m for m in self.placement.members if m.id != self.member_id]
        answers = await self.forwarder.gather(request, others)
        return admin.merged(self.member_id, mine, answers, admin.parse_limit(request))

    def cluster_stats(self) -> dict[str, object]:
        """This member's place in its cluster, for /stats (each member reports its own streams)."""
        placement = self.placement
        assert placement is not None
        return {
            "member": self.member_id,
            "epoch": placement.epoch,
            "members": {m.id: {"address": m.address, "slots": placement.slots_of(m.id)} for m in placement.members},
            "forwarding": self.forwarder is not None,
            "forwarded_requests": 0 if self.forwarder is None else self.forwarder.forwarded,
            "requests_by_client_http_version": dict(self.client_http_versions),
            "calls_to_members": None if self.peers is None else self.peers.stats(),
            "calls_from_members": {"answered": self.peer_ops.calls, "refused": self.peer_ops.refused},
        }

    def live_readers_by_stream(self) -> Counter[str]:
        """Live readers (long-poll, SSE) now, by stream name, for the admin API."""
        counts: Counter[str] = Counter()
        for (name, _), live in self._live.items():
            counts[name] += live.readers
        return counts

    def stats(self) -> dict[str, object]:
        storage = self.supervisor.storage
        body: dict[str, object] = {
            "ready": self.not_ready is None,
            "streams": len(storage.names()),
            "stored_bytes": storage.budget.total_bytes,
            "actors_active": self.supervisor.active,
            "actors_spawned": self.supervisor.spawned,
            "requests_by_http_version": dict(self.requests_by_http_version),
            "live_streams": len(self._live),
            "live_readers": sum(live.readers for live in self._live.values()),
            "live_readers_by_mode": dict(self.live_readers),
            "live_reads": dict(
                self.live_reads,
                pushed=self.live_reads["pushed"] + sum(live.pushes for live in self._live.values()),
            ),
            "background": self.health.stats(),
        }
        for section, source in self.stats_sources.items():
            body[section] = source()
        return body

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
        await pending.commit.settled()  # outside the actor: it sequences the next append meanwhile
        return self._appended(pending, request)

    def _appended(self, pending: PendingAppend, request: Request) -> Response:
        """The answer to an append whose commit is done."""
        outcome = pending.result()
        if outcome.status < 300:
            self.appends += 1
            self.appended_bytes += len(request.body)
        return Response(outcome.status, outcome.headers(pending.incarnation))

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
            until = _credential_deadline(request)
            return await self._sse(name, start if start is not None else "-1", cursor, request.push, until)
        if live == "long-poll":
            assert start is not None
            return await self._long_poll(name, start, cursor, request)
        return await self._catch_up(name, start if start is not None else "-1", request)

    async def _read_view(self, name: str, start: Offset | str, *, touch: bool = True) -> ReadView:
        # A read from -1 whose bytes retention drops under it starts again at the new floor (it
        # asked for the earliest data, not for an offset): the floor only rises, so this ends.
        for attempt in range(8):
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
            except RetainedAway:
                if start == "-1" and attempt < 7:
                    continue
                # Dropped under the read (maybe in a fork's source): where this stream can resume.
                floor = forks.readable_from(self.supervisor.storage, plan.log)
                raise below_floor(floor, view.meta.incarnation) from None
            except STORAGE_ERRORS as error:
                raise as_protocol_error(error, name) from None
            return ReadView(view, plan.start, result.messages, result.next_position, plan.changed)
        raise AssertionError("unreachable")  # the last attempt returns or raises

    async def _catch_up(self, name: str, start: Offset | str, request: Request) -> Response:
        view = await self._read_view(name, start)
        meta = view.view.meta
        if start == offsets.NOW:
            headers = responses.stream_headers(meta, view.view.tail)
            headers += [("Stream-Up-To-Date", "true"), ("Cache-Control", responses.NO_STORE)]
            return Response(200, headers, b"[]" if meta.json_mode else b"")
        return self._data_response(view, start, request, cursor=None)

    def _data_response(
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
        tag = responses.etag(meta, start, view.next_position, closed_at_end, view.start if start == "-1" else 0)
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

    def _join_live(self, name: str, incarnation: int) -> LiveStream:
        """The shared state of one incarnation's live readers, kept while any reader is live. Keyed
        by incarnation too: a stream deleted and created again shares nothing with its predecessor."""
        key = (name, incarnation)
        live = self._live.get(key)
        if live is None:
            live = self._live[key] = LiveStream(
                lambda position: self._shared_read(name, offsets.Offset(incarnation, position)),
                self.options.live_window_bytes,
                None if self.nursery is None else self.nursery.start_soon,
            )
        live.readers += 1
        return live

    def _leave_live(self, key: tuple[str, int], live: LiveStream) -> None:
        live.readers -= 1
        if live.readers == 0 and self._live.get(key) is live:
            del self._live[key]
            self.live_reads["pushed"] += live.pushes

    async def _shared_read(self, name: str, start: Offset) -> ReadView:
        self.live_reads["shared"] += 1
        return await self._read_view(name, start)

    async def _alone_read(self, name: str, start: Offset | str) -> ReadView:
        self.live_reads["alone"] += 1
        return await self._read_view(name, start)

    async def _next_view(self, reader: _LiveReader, position: int) -> tuple[ReadView, Batch | None]:
        batch = await reader.live.batch_at(position)
        if batch is not None:
            return batch.view, batch
        view = await self._alone_read(reader.name, offsets.Offset(reader.incarnation, position))
        reader.live.observe(view)
        return view, None

    async def _long_poll(
        self, name: str, start: Offset | str, cursor: str | None, request: Request
    ) -> Response:
        known = None
        if isinstance(start, Offset) and start.incarnation != offsets.ANY_INCARNATION:
            known = self._live.get((name, start.incarnation))
        batch = known.kept(start.position) if known is not None else None
        cached = known.unchanged_at(start.position) if known is not None and batch is None else None
        if batch is not None:
            view = batch.view
        elif cached is not None:
            view = cached  # a re-poll at the tail: nothing new, no need to ask the actor
            self.live_reads["cached"] += 1
        else:
            view = await self._alone_read(name, start)
        with _LiveReader(self, name, view.view.meta.incarnation, "long-poll") as reader:
            live_now = reader.live
            reader.live.observe(view)
            position = view.start
            deadline = trio.current_time() + self.options.long_poll_timeout
            until = _credential_deadline(request)
            if until is not None:  # a wait never outlives the token that allowed it
                deadline = min(deadline, until)
            while not view.messages:
                meta = view.view.meta
                if meta.closed or self.shutting_down or trio.current_time() >= deadline:
                    headers = [
                        ("Stream-Next-Offset", offsets.encode(view.view.tail, meta.incarnation)),
                        ("Stream-Up-To-Date", "true"),
                        ("Cache-Control", responses.NO_STORE),
                    ]
                    if meta.closed:
                        headers.append(("Stream-Closed", "true"))
                    else:
                        headers.append(("Stream-Cursor", response_cursor(cursor)))
                    return Response(204, headers)
                if not await reader.live.wait_beyond(position, deadline) or self.shutting_down:
                    continue  # timed out or stopping: answered at the top of the loop
                try:
                    view, batch = await self._next_view(reader, position)
                except ProtocolError as error:
                    # The re-read carries this incarnation's token, which the client may never have
                    # sent (offset=now or -1). Past a tail it reached, it can only fail because the
                    # stream was deleted, expired or replaced during the wait: the stream waited on
                    # is gone, a 404, not a 400/410 about an offset the client did not ask for.
                    if error.code in ("offset_out_of_range", "offset_of_deleted_stream"):
                        raise not_found(name) from None
                    raise
        body = None
        up_to_date = None
        if batch is not None:  # a shared read, maybe kept a while: at the tail only if nothing came since
            meta = view.view.meta
            body = batch.encoded("body", lambda: responses.body_for(meta, view.messages))
            up_to_date = live_now.at_tail(view)
        return self._data_response(
            view, start, request, cursor=response_cursor(cursor), body=body, up_to_date=up_to_date
        )

    async def _sse(
        self,
        name: str,
        start: Offset | str,
        cursor: str | None,
        push: PushTarget | None,
        until: float | None = None,
    ) -> Response:
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
        tally = Tally()
        events = self._sse_events(name, first, cursor, base64_mode, push, tally, until)
        return Response(200, headers, stream=events, tally=tally)

    async def _sse_events(
        self,
        name: str,
        view: ReadView,
        cursor: str | None,
        base64_mode: bool,
        push: PushTarget | None,
        tally: Tally,
        until: float | None = None,
    ) -> AsyncIterator[bytes]:
        close_at = trio.current_time() + self.options.sse_close_after
        if until is not None:  # the stream ends when the token or link that opened it expires
            close_at = min(close_at, until)
        batch: Batch | None = None
        try:
            with _LiveReader(self, name, view.view.meta.incarnation, "sse") as reader:
                live = reader.live
                live.observe(view)
                sent_control = False
                while True:
                    meta = view.view.meta
                    closed_at_end = meta.closed and view.at_tail
                    if view.messages:
                        yield _sse_batch(view, batch, cursor, base64_mode, live)
                        sent_control = True
                    elif not sent_control or closed_at_end:
                        yield sse.control(
                            offsets.encode(view.next_position, meta.incarnation),
                            cursor=response_cursor(cursor),
                            up_to_date=True,
                            closed=closed_at_end,
                        )
                        sent_control = True
                    if closed_at_end:
                        return
                    position = view.next_position
                    if view.at_tail:
                        if self.shutting_down or trio.current_time() >= close_at:
                            return
                        deadline = min(close_at, trio.current_time() + self.options.long_poll_timeout)
                        if push is not None and live.can_push:
                            # Asleep while changes are written straight to this subscriber's socket.
                            parked = await live.park(
                                position, push, _push_frame(push, cursor, base64_mode, live), deadline
                            )
                            tally.pushed += parked.sent
                            if parked.leftover:
                                yield Framed(parked.leftover)
                            if parked.finished:
                                return
                            position, changed = parked.position, parked.woke
                        else:
                            changed = await live.wait_beyond(position, deadline)
                        if self.shutting_down or trio.current_time() >= close_at:
                            return
                        # A quiet spell gets a fresh control event: a keep-alive with a new cursor.
                        sent_control = changed
                    try:
                        view, batch = await self._next_view(reader, position)
                    except ProtocolError:
                        return  # deleted, replaced or expired meanwhile: end; a reconnect gets the answer
        except ProtocolError:
            # Deleted between the first read and here (its actor gone, so no live reader can
            # join): end the stream; the reconnect gets the answer (torture sim seed 4140).
            return


def _credential_deadline(request: Request) -> float | None:
    """When (trio clock) the credential behind `request` expires, if it does: live reads end
    then, and the client's reconnect needs a fresh one."""
    principal = request.principal
    expires_at = getattr(principal, "expires_at", None)
    if expires_at is None:
        return None
    return trio.current_time() + (expires_at - time.time())


class _LiveReader:
    """One live reader: keeps the stream's actor awake and its incarnation's `LiveStream` alive
    while it lasts.

    A slotted class rather than @contextmanager: 10,000 SSE subscribers each hold one for as long
    as they are connected, and a generator-based context manager costs ten times the memory.
    """

    __slots__ = ("awake", "incarnation", "live", "mode", "name", "service")

    def __init__(self, service: Service, name: str, incarnation: int, mode: str) -> None:
        self.service = service
        self.name = name
        self.incarnation = incarnation
        self.mode = mode

    def __enter__(self) -> _LiveReader:
        self.awake = self.service.supervisor.live_reader(self.name)
        self.awake.__enter__()
        self.live = self.service._join_live(self.name, self.incarnation)
        self.service.live_readers[self.mode] += 1
        return self

    def __exit__(self, *_: object) -> None:
        self.awake.__exit__()
        self.service._leave_live((self.name, self.incarnation), self.live)
        self.service.live_readers[self.mode] -= 1


def _sse_bytes(view: ReadView, fresh_cursor: str, base64_mode: bool, up_to_date: bool) -> bytes:
    """The events for one read: its data (if any) and the control event after it."""
    meta = view.view.meta
    control = sse.control(
        offsets.encode(view.next_position, meta.incarnation),
        cursor=fresh_cursor,
        up_to_date=up_to_date,
        closed=meta.closed and view.at_tail,
    )
    if not view.messages:
        return control
    payload = sse.data_payload(view.messages, json_mode=meta.json_mode, base64_mode=base64_mode)
    return sse.event("data", payload) + control


def _sse_batch(
    view: ReadView, batch: Batch | None, cursor: str | None, base64_mode: bool, live: LiveStream
) -> bytes:
    """A read's events; built once per batch for all readers that share a cursor. A kept batch
    may be long past: `upToDate` is what holds now (§5.8), so it is part of the key."""
    fresh = response_cursor(cursor)
    if batch is None:
        return _sse_bytes(view, fresh, base64_mode, view.at_tail)
    now = live.at_tail(view)
    return batch.encoded(("sse", base64_mode, fresh, now), lambda: _sse_bytes(view, fresh, base64_mode, now))


def _push_frame(
    push: PushTarget, cursor: str | None, base64_mode: bool, live: LiveStream
) -> Callable[[Batch], bytes]:
    """A parked subscriber's bytes for a batch: the same object for every subscriber that shares
    the edge's framing, a cursor and whether the batch still ends at the tail."""

    def frame(batch: Batch) -> bytes:
        fresh = response_cursor(cursor)
        now = live.at_tail(batch.view)
        return batch.encoded(
            ("push", push.kind, base64_mode, fresh, now),
            lambda: push.frame(_sse_bytes(batch.view, fresh, base64_mode, now)),
        )

    return frame


__all__ = ["Service", "ServiceOptions"]
