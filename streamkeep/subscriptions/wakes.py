"""The workers' side of a subscription (§7): the fenced wake endpoints, callback (webhook), claim,
ack and release (pull-wake), and the lease a claim holds.

They are called with the subscription's own wake tokens, never the server's JWTs: every call
proves it holds the current wake (its generation and wake id), and a stale one is fenced (409).
Every change happens under the subscription's lock inside `store.change`, saved before the answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from streamkeep.protocol import offsets
from streamkeep.protocol.errors import ProtocolError, bad_request
from streamkeep.protocol.model import Request, Response
from streamkeep.protocol.names import WAKE_ACTIONS
from streamkeep.protocol.responses import error, json_response
from streamkeep.subscriptions.config import not_found
from streamkeep.subscriptions.delivery import token_ttl
from streamkeep.subscriptions.links import Links
from streamkeep.subscriptions.remote import Remote
from streamkeep.subscriptions.signing import Keys
from streamkeep.subscriptions.state import Subscription, Wake
from streamkeep.subscriptions.store import Store


def _fenced() -> ProtocolError:
    return ProtocolError(409, "FENCED", "this wake is over: its generation or wake id is stale")


class Wakes:
    """The wake endpoints of every subscription; `ControlApi` routes to them."""

    def __init__(self, links: Links, store: Store, keys: Keys, *, now: Callable[[], float]) -> None:
        self.links = links
        self.store = store
        self.keys = keys
        self.now = now
        self.remote: Remote | None = None  # in a cluster: the other members' streams

    async def answer(self, action: str, request: Request, sub: Subscription) -> Response:
        """The answer of wake endpoint `action` (callback, ack or release), its token authorized."""
        if action == "release":
            return await self._release(request, sub)
        return await self._finish(request, sub, WAKE_ACTIONS[action])

    def _authorized(self, request: Request, sub: Subscription, kind: str) -> dict:
        return self.authorize(request, sub.id, kind)

    def authorize(self, request: Request, sub_id: str, kind: str) -> dict:
        """The claims of the `kind` wake token the call carries for `sub_id`; 401 without one."""
        header = request.headers.get("authorization") or ""
        scheme, _, token = header.partition(" ")
        claims = self.keys.check_token(token.strip(), sub_id, kind) if scheme.lower() == "bearer" else None
        if claims is None:
            raise ProtocolError(
                401, "UNAUTHORIZED", f"a valid {kind} token is required (Authorization: Bearer ...)"
            )
        return claims

    @staticmethod
    def _wake_body(request: Request) -> dict:
        try:
            body = json.loads(request.body or b"null")
        except (ValueError, RecursionError):
            raise bad_request("INVALID_JSON", "the body must be a JSON object") from None
        if not isinstance(body, dict):
            raise bad_request("INVALID_JSON", "the body must be a JSON object")
        return body

    @staticmethod
    def _check_current(sub: Subscription, claims: dict, body: dict) -> Wake:
        wake = sub.wake
        if (
            wake is None
            or claims.get("g") != wake.generation
            or claims.get("w") != wake.wake_id
            or body.get("generation") != wake.generation
            or body.get("wake_id") != wake.wake_id
        ):
            raise _fenced()
        return wake

    @staticmethod
    def _parse_acks(body: dict) -> list[tuple[str, offsets.Offset]]:
        acks = body.get("acks", [])
        if not isinstance(acks, list):
            raise bad_request("INVALID_ACKS", "acks must be a list of {stream, offset}")
        out = []
        for ack in acks:
            if (
                not isinstance(ack, dict)
                or not isinstance(ack.get("stream"), str)
                or not isinstance(ack.get("offset"), str)
            ):
                raise bad_request("INVALID_ACKS", 'each ack is {"stream": path, "offset": offset}')
            out.append((ack["stream"], offsets.decode(ack["offset"])))
        return out

    async def _finish(self, request: Request, sub: Subscription, kind: str) -> Response:
        """Callback (webhook) and ack (pull-wake): apply acks; `done` ends the wake, else the
        call is a heartbeat that extends the lease."""
        body = self._wake_body(request)
        if self.remote is not None:
            # An ack may be past the tail its member last told us of: ask before judging it, and
            # before taking the lock (a member that does not answer stalls this call, not the
            # subscription). The checks come first, so a fenced call is answered 409 as ever.
            _, acks = self._judge(request, sub, kind, body)
            if acks:
                await self.remote.refresh(sub, [(path, offset.position) for path, offset in acks])
        async with sub.lock:
            wake, acks = self._judge(request, sub, kind, body)
            self.links.absorb(sub)
            next_wake = False
            async with self.store.change(sub):
                self.links.apply_acks(sub, acks, wake)
                if body.get("done") is True:
                    sub.wake = None
                    next_wake = bool(self.links.pending(sub))
                else:
                    wake.lease_until = self.now() + sub.config.lease_ttl_ms / 1000
        sub.poke()
        return json_response(200, {"ok": True, "next_wake": next_wake})

    def _judge(
        self, request: Request, sub: Subscription, kind: str, body: dict
    ) -> tuple[Wake, list[tuple[str, offsets.Offset]]]:
        """The current wake a callback or ack names, and its acks; raises if it is fenced."""
        if sub.deleted:
            raise _fenced()
        claims = self._authorized(request, sub, kind)
        wake = self._check_current(sub, claims, body)
        return wake, self._parse_acks(body)

    async def _release(self, request: Request, sub: Subscription) -> Response:
        body = self._wake_body(request)
        async with sub.lock:
            if sub.deleted:
                raise _fenced()
            claims = self._authorized(request, sub, "claim")
            self._check_current(sub, claims, body)
            async with self.store.change(sub, links=False):
                sub.wake = None
        sub.poke()  # pending work gets a new wake event
        return Response(204)

    async def claim(self, request: Request, sub: Subscription) -> Response:
        if sub.config.type != "pull-wake":
            raise bad_request("NOT_PULL_WAKE", "only pull-wake subscriptions are claimed")
        body = self._wake_body(request)
        worker = body.get("worker")
        if not isinstance(worker, str) or not worker:
            raise bad_request("INVALID_WORKER", 'claim needs {"worker": name}')
        async with sub.lock:
            if sub.deleted:
                raise not_found(sub.id)
            self.links.absorb(sub)
            if self.remote is None or not self._idle(sub):
                return await self._grant(sub, worker)
        # Another member's stream may have taken an append it has not reported yet: a client that
        # appended and then claims must find that work (read your writes). Asked without the lock:
        # a member that does not answer (5 s at most, at once refused when known to be failing)
        # stalls this claim only, not the subscription's acks, callbacks or driver. What changed
        # meanwhile is judged afresh below, as for a claim that came now.
        await self.remote.catch_up(sub)
        async with sub.lock:
            if sub.deleted:
                raise not_found(sub.id)
            self.links.absorb(sub)
            return await self._grant(sub, worker)

    def _leased(self, wake: Wake | None, now: float) -> bool:
        return (
            wake is not None
            and wake.holder is not None
            and wake.lease_until is not None
            and now < wake.lease_until
        )

    def _idle(self, sub: Subscription) -> bool:
        """Whether a claim now would issue a new wake and find no work (holding `sub.lock`)."""
        wake = sub.wake
        if self._leased(wake, self.now()):
            return False
        issuing = wake is None or wake.holder is not None
        return issuing and not self.links.pending(sub)

    async def _grant(self, sub: Subscription, worker: str) -> Response:
        """A claim's answer (holding `sub.lock`, its links absorbed)."""
        now = self.now()
        wake = sub.wake
        if self._leased(wake, now):
            assert wake is not None
            return error(
                ProtocolError(409, "ALREADY_CLAIMED", "another worker holds the lease"),
                current_holder=wake.holder,
                generation=wake.generation,
            )
        async with self.store.change(sub, links=False):
            if wake is None or wake.holder is not None:  # none issued yet, or an expired claim
                if not self.links.pending(sub):
                    raise ProtocolError(
                        409, "NO_PENDING_WORK", "nothing to claim: every linked stream is acked"
                    )
                wake = sub.issue(self.links.snapshot(sub), now)
            wake.holder = worker
            wake.lease_until = now + sub.config.lease_ttl_ms / 1000
        token = self.keys.token(sub.id, wake.generation, wake.wake_id, "claim", token_ttl(sub))
        return json_response(
            200,
            {
                "wake_id": wake.wake_id,
                "generation": wake.generation,
                "token": token,
                "streams": self.links.view(sub, wake),
                "lease_ttl_ms": sub.config.lease_ttl_ms,
            },
        )
