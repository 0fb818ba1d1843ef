"""The control API under `/v1/stream/__ds/` (§6-7): create, read and delete subscriptions, their
explicit streams, the JWKS, and the fenced wake endpoints (callback, claim, ack, release).

Every change happens under the subscription's lock inside `store.change`: it is saved before the
answer, and a change that cannot be saved is undone and answered like any storage trouble
(507 `storage_full`, 503 `storage_unavailable`, with Retry-After).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from urllib.parse import unquote

import trio

from streamkeep.auth.tokens import Principal
from streamkeep.protocol import offsets
from streamkeep.protocol.errors import ProtocolError, bad_request
from streamkeep.protocol.model import Request, Response
from streamkeep.subscriptions.config import (
    CONTROL_PREFIX,
    WAKE_ACTIONS,
    SubscriptionConfig,
    check_id,
    normalize_streams,
    refuse_wake_stream,
)
from streamkeep.subscriptions.delivery import Delivery, token_ttl
from streamkeep.subscriptions.faults import Faults
from streamkeep.subscriptions.links import Links
from streamkeep.subscriptions.remote import Remote
from streamkeep.subscriptions.signing import Keys
from streamkeep.subscriptions.state import Owner, Subscription, Wake
from streamkeep.subscriptions.store import Store
from streamkeep.subscriptions.urls import check_webhook_url


def _error(error: ProtocolError, **extra: object) -> Response:
    body = {"error": {"code": error.code, "message": error.message, **extra}}
    return Response(
        error.status, [("Content-Type", "application/json"), *error.headers], json.dumps(body).encode()
    )


def _json(status: int, body: object) -> Response:
    return Response(
        status,
        [("Content-Type", "application/json"), ("Cache-Control", "no-store")],
        json.dumps(body).encode(),
    )


def _fenced() -> ProtocolError:
    return ProtocolError(409, "FENCED", "this wake is over: its generation or wake id is stale")


def _forbidden(message: str) -> ProtocolError:
    return ProtocolError(403, "FORBIDDEN", message)


def _not_found(sub_id: str) -> ProtocolError:
    return ProtocolError(404, "SUBSCRIPTION_NOT_FOUND", f"no subscription {sub_id!r}")


# With auth on, subscriptions one token subject may own (each is walked at every publish).
MAX_SUBSCRIPTIONS_PER_OWNER = 100


class _Creating:
    """One creation of an id at a time (two PUTs of one id cannot both win), and any number of
    different ids at once: in a cluster a creation waits for the other members (up to 5 s), and
    a hung member must not queue every other creation behind it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[trio.Lock, list[int]]] = {}  # id -> (lock, [users])

    @asynccontextmanager
    async def of(self, sub_id: str) -> AsyncIterator[None]:
        lock, users = self._locks.setdefault(sub_id, (trio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._locks[sub_id]


class ControlApi:
    def __init__(
        self,
        subs: dict[str, Subscription],
        links: Links,
        store: Store,
        keys: Keys,
        delivery: Delivery,
        faults: Faults,
        *,
        allow_loopback: bool,
        now: Callable[[], float],
    ) -> None:
        self.subs = subs
        self.links = links
        self.store = store
        self.keys = keys
        self.delivery = delivery
        self.faults = faults
        self.allow_loopback = allow_loopback
        self.now = now
        self._creating = _Creating()  # one creation of an id at a time
        self.remote: Remote | None = None  # in a cluster: the other members' streams

    async def handle(self, request: Request) -> Response:
        rest = request.raw_path[len(CONTROL_PREFIX) :]
        try:
            if rest == "jwks.json" and request.method == "GET":
                body = json.dumps(self.keys.jwks()).encode()
                return Response(
                    200,
                    [("Content-Type", "application/jwk-set+json"), ("Cache-Control", "public, max-age=300")],
                    body,
                )
            parts = rest.split("/", 2)
            if parts[0] != "subscriptions" or len(parts) < 2:
                raise ProtocolError(404, "NOT_FOUND", "no such control endpoint under __ds/")
            sub_id = unquote(parts[1])
            check_id(sub_id)
            action = parts[2] if len(parts) > 2 else ""
            return await self._dispatch(request, sub_id, action)
        except ProtocolError as error:
            return _error(error)

    async def _dispatch(self, request: Request, sub_id: str, action: str) -> Response:
        method = request.method
        if action not in WAKE_ACTIONS and not (action == "" and method == "PUT"):
            self._check_owner(request.principal, sub_id)
        if action == "":
            if method == "PUT":
                return await self._put(request, sub_id)
            if method == "GET":
                return await self._read(self._get(sub_id))
            if method == "DELETE":
                return await self._delete(self._get(sub_id))
        elif action == "streams" and method == "POST":
            return await self._add_streams(request, self._get(sub_id))
        elif action.startswith("streams/") and method == "DELETE":
            return await self._remove_stream(self._get(sub_id), unquote(action[len("streams/") :]))
        elif action in WAKE_ACTIONS and method == "POST":
            # The token is checked before the subscription is looked up, so the public wake
            # endpoints answer the same 401 whether or not an id exists.
            self._authorized_id(request, sub_id, WAKE_ACTIONS[action])
            return await getattr(self, f"_{action}")(request, self._get(sub_id))
        elif action == "claim" and method == "POST":
            return await self._claim(request, self._get(sub_id))
        raise ProtocolError(405, "METHOD_NOT_ALLOWED", f"{method} is not supported on this control path")

    def _check_owner(self, principal: Principal | None, sub_id: str) -> None:
        """With auth on, a subscription is its creator's and the admins': to anyone else it does
        not exist (404). The creator is the same token subject holding at least the grants the
        subscription was created with, so a narrow token of the same user (a browser's read token
        for one stream) cannot list, delete or claim what a broader one set up."""
        sub = self.subs.get(sub_id)
        if principal is None or sub is None or principal.grants.admin:
            return
        owner = sub.owner
        if (
            owner is None
            or owner.subject is None
            or owner.subject != principal.subject
            or not set(owner.grants.to_list()) <= set(principal.grants.to_list())
        ):
            raise _not_found(sub_id)

    def _owner(self, principal: Principal | None, config: SubscriptionConfig) -> Owner | None:
        """The owner a new subscription records, after checking that its creator may read every
        stream it names and append to its wake stream."""
        if principal is None or principal.grants.admin:
            return None
        grants = principal.grants
        if principal.subject is None:
            raise _forbidden("a subscription belongs to its creator: this token has no sub claim to own it")
        if not any(kind in ("read", "write") for kind, _, _ in (e.partition(":") for e in grants.to_list())):
            raise _forbidden("this token grants reading no stream, so a subscription would follow nothing")
        owned = sum(
            1 for sub in self.subs.values() if sub.owner is not None and sub.owner.subject == principal.subject
        )
        if owned >= MAX_SUBSCRIPTIONS_PER_OWNER:
            raise _forbidden(
                f"{principal.subject!r} owns {owned} subscriptions, the most one subject may; delete some "
                "or ask an admin"
            )
        for path in config.streams:
            if not grants.allows("read", path):
                raise _forbidden(f"this token does not grant read on {path!r}")
        if config.wake_stream is not None and not grants.allows("append", config.wake_stream):
            raise _forbidden(f"pull-wake appends to {config.wake_stream!r}: this token does not grant append on it")
        return Owner(principal.subject, grants)

    def _get(self, sub_id: str) -> Subscription:
        sub = self.subs.get(sub_id)
        if sub is None or sub.deleted:
            raise _not_found(sub_id)
        return sub

    def _view(self, sub: Subscription) -> dict:
        config = sub.config
        webhook = None
        if config.type == "webhook":
            webhook = {
                "url": config.webhook_url,
                "signing": {
                    "alg": "ed25519",
                    "kid": self.keys.kid,
                    "jwks_url": f"{sub.base_url}{CONTROL_PREFIX}jwks.json",
                },
            }
        return {
            "id": sub.id,
            "subscription_id": sub.id,
            "type": config.type,
            "pattern": config.pattern,
            "streams": self.links.view(sub),
            "webhook": webhook,
            "wake_stream": config.wake_stream,
            "lease_ttl_ms": config.lease_ttl_ms,
            "created_at": sub.created_at,
            "status": sub.status,
            "description": config.description,
        }

    # ---- subscriptions -----------------------------------------------------------------------

    async def _put(self, request: Request, sub_id: str) -> Response:
        config = SubscriptionConfig.parse(request.body)
        if config.webhook_url is not None:
            check_webhook_url(config.webhook_url, allow_loopback=self.allow_loopback)
        owner = self._owner(request.principal, config)
        async with self._creating.of(sub_id):
            existing = self.subs.get(sub_id)
            if existing is not None and not existing.deleted:
                try:
                    self._check_owner(request.principal, sub_id)
                except ProtocolError:
                    raise ProtocolError(
                        409, "SUBSCRIPTION_EXISTS", f"subscription id {sub_id!r} is taken; choose another"
                    ) from None
                if existing.config.hash != config.hash:
                    raise ProtocolError(
                        409,
                        "SUBSCRIPTION_EXISTS",
                        f"subscription {sub_id!r} exists with another configuration",
                    )
                return await self._read(existing)
            host = request.headers.get("host") or "localhost"
            created = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
            sub = Subscription(sub_id, config, created, f"{request.scheme}://{host}", owner=owner)
            if self.remote is not None:
                # Before the backfill: it links the other members' matching streams at their tails.
                await self.remote.announce(sub)
            self.links.backfill(sub)
            try:
                await self.store.save(sub)  # saved first: a refused save leaves no trace in memory
            except BaseException:
                if self.remote is not None:
                    self.remote.forget(sub)  # nor on the other members
                raise
            self.subs[sub_id] = sub
            self.delivery.start(sub)
        return _json(201, self._view(sub))

    async def _read(self, sub: Subscription) -> Response:
        async with sub.lock:
            if sub.deleted:
                raise _not_found(sub.id)
            self.links.absorb(sub)  # deleted streams are not shown, new ones are
            return _json(200, self._view(sub))

    async def _delete(self, sub: Subscription) -> Response:
        async with sub.lock:
            if not sub.deleted:
                await self.store.forget(sub)
                sub.deleted = True  # a tombstone: in-flight callbacks, acks and releases now fail
                sub.wake = None
                if self.subs.get(sub.id) is sub:
                    del self.subs[sub.id]
                self.faults.forget(sub)
                if self.remote is not None:
                    self.remote.forget(sub)
        sub.poke()
        return Response(204)

    async def _add_streams(self, request: Request, sub: Subscription) -> Response:
        try:
            raw = json.loads(request.body or b"null")
        except (ValueError, RecursionError):
            raise bad_request("INVALID_JSON", 'the body must be {"streams": [...]}') from None
        paths = normalize_streams(raw.get("streams") if isinstance(raw, dict) else None)
        refuse_wake_stream(sub.config.wake_stream, paths)
        principal = request.principal
        if principal is not None:
            for path in paths:
                if not principal.grants.allows("read", path):
                    raise _forbidden(f"this token does not grant read on {path!r}")
        if self.remote is not None:
            await self.remote.announce(sub, paths)  # their members' tails, and later changes
        async with sub.lock:
            if sub.deleted:
                raise _not_found(sub.id)
            self.links.absorb(sub)
            async with self.store.change(sub):
                for path in paths:
                    self.links.add_explicit(sub, path)
        sub.poke()
        return Response(204)

    async def _remove_stream(self, sub: Subscription, path: str) -> Response:
        async with sub.lock:
            if sub.deleted:
                raise _not_found(sub.id)
            self.links.absorb(sub)
            async with self.store.change(sub):
                self.links.remove_explicit(sub, path)
        return Response(204)

    # ---- wakes -------------------------------------------------------------------------------

    def _authorized(self, request: Request, sub: Subscription, kind: str) -> dict:
        return self._authorized_id(request, sub.id, kind)

    def _authorized_id(self, request: Request, sub_id: str, kind: str) -> dict:
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
        return _json(200, {"ok": True, "next_wake": next_wake})

    def _judge(
        self, request: Request, sub: Subscription, kind: str, body: dict
    ) -> tuple[Wake, list[tuple[str, offsets.Offset]]]:
        """The current wake a callback or ack names, and its acks; raises if it is fenced."""
        if sub.deleted:
            raise _fenced()
        claims = self._authorized(request, sub, kind)
        wake = self._check_current(sub, claims, body)
        return wake, self._parse_acks(body)

    async def _callback(self, request: Request, sub: Subscription) -> Response:
        return await self._finish(request, sub, "callback")

    async def _ack(self, request: Request, sub: Subscription) -> Response:
        return await self._finish(request, sub, "claim")

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

    async def _claim(self, request: Request, sub: Subscription) -> Response:
        if sub.config.type != "pull-wake":
            raise bad_request("NOT_PULL_WAKE", "only pull-wake subscriptions are claimed")
        body = self._wake_body(request)
        worker = body.get("worker")
        if not isinstance(worker, str) or not worker:
            raise bad_request("INVALID_WORKER", 'claim needs {"worker": name}')
        async with sub.lock:
            if sub.deleted:
                raise _not_found(sub.id)
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
                raise _not_found(sub.id)
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
            return _error(
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
        return _json(
            200,
            {
                "wake_id": wake.wake_id,
                "generation": wake.generation,
                "token": token,
                "streams": self.links.view(sub, wake),
                "lease_ttl_ms": sub.config.lease_ttl_ms,
            },
        )
