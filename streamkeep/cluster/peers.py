"""Calls between members: `POST /_cluster/<op>` with a CBOR body, signed with the cluster secret.

A fork whose source another member owns, a subscription following streams on other members and
the one `__registry__` of a cluster all need a word with another member. That word never passes
the front door: it goes straight to the member's address, signed like a forwarded request
(`Streamkeep-Forwarded`, forward.py), so a client that reaches `/_cluster/` through HAProxy gets
403. The body is a CBOR map both ways (message bytes travel as they are); a refusal comes back as
its status with `{"code", "message"}` and is raised again here as the same ProtocolError, so the
caller's client sees the owner's own answer (a fork of a missing source: 404 from the source's
member). A member that cannot be reached is `PeerUnavailable` (503, Retry-After).

Whether a member is taken for down is kept here, once for every feature: a member whose last call
failed unavailable (unreachable, or a 503 that is about the member, not one stream: see
MEMBER_DOWN_CODES; a feature that gives up waiting says so too) is
down until a call to it succeeds again (`Peers.down`). Calls a client waits for ask it first and
fail at once instead of waiting for a hung member again and again (cluster subscriptions, the
registry relay); a feature that watches a member waits on `went_down` and probes it.

Each part registers the operations it answers in `PeerOps` (forks: `fork.*`, subscriptions:
`sub.*`, the registry: `registry.*`); the service routes the request to them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import cbor2
import httpx
import trio

from streamkeep.cluster.forward import HEADER, forwarded_by, stamp_header
from streamkeep.cluster.placement import Member, Placement
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.model import Request, Response
from streamkeep.protocol.names import CLUSTER_PREFIX

# httpx logs every request at INFO: one line per call between members would drown the server's own.
logging.getLogger("httpx").setLevel(logging.WARNING)
CONTENT_TYPE = "application/cbor"

Handler = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class PeerUnavailable(ProtocolError):
    def __init__(self, member: Member, why: str) -> None:
        super().__init__(
            503,
            "member_unavailable",
            f"cluster member {member.id!r} is not reachable ({why}); retry shortly",
            [("Retry-After", "1")],
        )
        self.member = member


class PeerOps:
    """The operations this member answers for the others, by name."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self.calls = 0
        self.refused = 0

    def register(self, op: str, handler: Handler) -> None:
        """`handler(caller_member_id, payload) -> answer` (both CBOR maps)."""
        if op in self._handlers:
            raise ValueError(f"cluster operation {op!r} registered twice")
        self._handlers[op] = handler

    async def answer(
        self, request: Request, placement: Placement, secret: str, refusal: ProtocolError | None = None
    ) -> Response:
        """The answer to a member's call; `refusal` (a member still recovering) refuses any call."""
        caller = forwarded_by(request, secret, placement.members)
        if caller is None:
            raise ProtocolError(403, "members_only", f"{CLUSTER_PREFIX} is for calls between cluster members")
        try:
            if refusal is not None:
                raise refusal
            epoch = request.headers.get("streamkeep-placement-epoch")
            if epoch != str(placement.epoch):  # members with different maps must not act for each other
                raise ProtocolError(
                    503,
                    "stale_placement",
                    f"the caller runs placement epoch {str(epoch)[:20]}, this member {placement.epoch}",
                    [("Retry-After", "1")],
                )
            answer = await self._dispatch(caller, request)
        except ProtocolError as error:
            self.refused += 1
            body = cbor2.dumps({"code": error.code, "message": error.message})
            return Response(error.status, [("Content-Type", CONTENT_TYPE), *error.headers], body)
        self.calls += 1
        return Response(200, [("Content-Type", CONTENT_TYPE)], cbor2.dumps(answer))

    async def _dispatch(self, caller: str, request: Request) -> dict[str, Any]:
        if request.method != "POST":
            raise ProtocolError(405, "method_not_allowed", "cluster calls are POST", [("Allow", "POST")])
        op = request.raw_path[len(CLUSTER_PREFIX) :]
        handler = self._handlers.get(op)
        if handler is None:
            raise ProtocolError(404, "unknown_cluster_call", f"no cluster operation {op[:80]!r} here")
        try:
            payload = cbor2.loads(request.body) if request.body else {}
        except (cbor2.CBORDecodeError, ValueError) as error:
            raise ProtocolError(400, "bad_cluster_call", f"the body is not CBOR: {error}") from None
        if not isinstance(payload, dict):
            raise ProtocolError(400, "bad_cluster_call", "the body must be a CBOR map")
        return await handler(caller, payload)


# Refusals that say the member as a whole cannot serve now (still recovering, another placement
# epoch, too busy), as opposed to a 503 about one stream (its disk, its cold tier): only these take
# the member for down for every feature.
MEMBER_DOWN_CODES = frozenset({"not_ready", "stale_placement", "member_unavailable", "server_busy"})


class DownMembers:
    """The members taken for down, and why: the first cause stands until a call answers."""

    def __init__(self) -> None:
        self._why: dict[str, str] = {}
        self._went_down: dict[str, trio.Event] = {}

    def why(self, member_id: str) -> str | None:
        """Why `member_id` is taken for down, or None while it answers."""
        return self._why.get(member_id)

    def mark(self, member_id: str, why: str) -> None:
        if member_id not in self._why:
            self._why[member_id] = why
            event = self._went_down.pop(member_id, None)
            if event is not None:
                event.set()

    def answered(self, member_id: str) -> None:
        self._why.pop(member_id, None)

    async def went_down(self, member_id: str) -> None:
        """Returns once `member_id` is taken for down (at once if it is)."""
        while member_id not in self._why:
            await self._went_down.setdefault(member_id, trio.Event()).wait()


class Peers:
    """This member's calls to the others (one connection pool)."""

    # A client's fork create or inherited read waits on a call: a hung member costs it 10 s, not more.
    def __init__(self, placement: Placement, member: str, secret: str, timeout: float = 10.0) -> None:
        self.placement = placement
        self.member = member
        self.secret = secret
        self.calls = 0
        self.failures = 0
        self.down = DownMembers()
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=2.0, read=timeout, write=timeout, pool=5.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=32),
            follow_redirects=False,
            trust_env=False,
        )

    def member_of(self, member_id: str) -> Member:
        for member in self.placement.members:
            if member.id == member_id:
                return member
        raise KeyError(member_id)

    def others(self) -> list[Member]:
        return [m for m in self.placement.members if m.id != self.member]

    def elsewhere(self, name: str) -> Member | None:
        """The member owning stream `name` if it is not this one."""
        owner = self.placement.owner(name)
        return None if owner.id == self.member else owner

    async def call(self, member: Member, op: str, payload: dict[str, Any]) -> dict[str, Any]:
        target = CLUSTER_PREFIX + op
        headers = {
            HEADER: stamp_header(self.secret, self.member, "POST", target),
            "content-type": CONTENT_TYPE,
            "streamkeep-placement-epoch": str(self.placement.epoch),
        }
        self.calls += 1
        try:
            answer = await self._client.post(
                f"http://{member.address}{target}", content=cbor2.dumps(payload), headers=headers
            )
        except httpx.HTTPError as error:
            self.failures += 1
            unavailable = PeerUnavailable(member, type(error).__name__)
            self.down.mark(member.id, unavailable.message)
            raise unavailable from None
        try:
            body = cbor2.loads(answer.content) if answer.content else {}
        except (cbor2.CBORDecodeError, ValueError):
            body = None
        if answer.status_code == 200 and isinstance(body, dict):
            self.down.answered(member.id)
            return body
        if isinstance(body, dict) and isinstance(body.get("code"), str):
            retry = answer.headers.get("retry-after")
            refusal = ProtocolError(
                answer.status_code,
                body["code"],
                str(body.get("message", "")),
                [("Retry-After", retry)] if retry else [],
            )
            if refusal.status == 503 and refusal.code in MEMBER_DOWN_CODES:
                self.down.mark(member.id, refusal.message)
            raise refusal
        self.failures += 1
        unavailable = PeerUnavailable(member, f"answered {answer.status_code} without a cluster body")
        self.down.mark(member.id, unavailable.message)
        raise unavailable

    async def aclose(self) -> None:
        await self._client.aclose()

    def stats(self) -> dict[str, int]:
        return {"calls": self.calls, "failures": self.failures}
