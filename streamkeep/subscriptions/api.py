"""The control API under `/v1/stream/__ds/` (§6): the owners' side of subscriptions (create, read
and delete them and their explicit streams) and the JWKS; the wake endpoints it routes to
`wakes.py`, the workers' side.

Every change happens under the subscription's lock inside `store.change`: it is saved before the
answer, and a change that cannot be saved is undone and answered like any storage trouble
(507 `storage_full`, 503 `storage_unavailable`, with Retry-After).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from urllib.parse import unquote

import trio

from streamkeep.auth.tokens import Principal
from streamkeep.protocol.errors import ProtocolError, bad_request
from streamkeep.protocol.model import Request, Response
from streamkeep.protocol.names import CONTROL_PREFIX, WAKE_ACTIONS
from streamkeep.protocol.responses import error, json_response
from streamkeep.subscriptions.config import (
    SubscriptionConfig,
    check_id,
    normalize_streams,
    not_found,
    refuse_wake_stream,
)
from streamkeep.subscriptions.delivery import Delivery
from streamkeep.subscriptions.faults import Faults
from streamkeep.subscriptions.links import Links
from streamkeep.subscriptions.remote import Remote
from streamkeep.subscriptions.signing import Keys
from streamkeep.subscriptions.state import Owner, Subscription
from streamkeep.subscriptions.store import Store
from streamkeep.subscriptions.urls import check_webhook_url
from streamkeep.subscriptions.wakes import Wakes


def _forbidden(message: str) -> ProtocolError:
    return ProtocolError(403, "FORBIDDEN", message)


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
        wakes: Wakes,
        *,
        allow_loopback: bool,
    ) -> None:
        self.subs = subs
        self.links = links
        self.store = store
        self.keys = keys
        self.delivery = delivery
        self.faults = faults
        self.wakes = wakes
        self.allow_loopback = allow_loopback
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
        except ProtocolError as refusal:
            return error(refusal)

    async def _dispatch(self, request: Request, sub_id: str, action: str) -> Response:
        method = request.method
        if action not in WAKE_ACTIONS and not (action == "" and method == "PUT"):
            self.check_owner(request.principal, sub_id)
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
            self.wakes.authorize(request, sub_id, WAKE_ACTIONS[action])
            return await self.wakes.answer(action, request, self._get(sub_id))
        elif action == "claim" and method == "POST":
            return await self.wakes.claim(request, self._get(sub_id))
        raise ProtocolError(405, "METHOD_NOT_ALLOWED", f"{method} is not supported on this control path")

    def check_owner(self, principal: Principal | None, sub_id: str) -> None:
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
            raise not_found(sub_id)

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
            1
            for sub in self.subs.values()
            if sub.owner is not None and sub.owner.subject == principal.subject
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
            raise _forbidden(
                f"pull-wake appends to {config.wake_stream!r}: this token does not grant append on it"
            )
        return Owner(principal.subject, grants)

    def _get(self, sub_id: str) -> Subscription:
        sub = self.subs.get(sub_id)
        if sub is None or sub.deleted:
            raise not_found(sub_id)
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
                    self.check_owner(request.principal, sub_id)
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
        return json_response(201, self._view(sub))

    async def _read(self, sub: Subscription) -> Response:
        async with sub.lock:
            if sub.deleted:
                raise not_found(sub.id)
            self.links.absorb(sub)  # deleted streams are not shown, new ones are
            return json_response(200, self._view(sub))

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
                raise not_found(sub.id)
            self.links.absorb(sub)
            async with self.store.change(sub):
                for path in paths:
                    self.links.add_explicit(sub, path)
        sub.poke()
        return Response(204)

    async def _remove_stream(self, sub: Subscription, path: str) -> Response:
        async with sub.lock:
            if sub.deleted:
                raise not_found(sub.id)
            self.links.absorb(sub)
            async with self.store.change(sub):
                self.links.remove_explicit(sub, path)
        return Response(204)
