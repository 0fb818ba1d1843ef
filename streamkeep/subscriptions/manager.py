"""Subscriptions: state, delivery (webhook or pull-wake), leases and fencing (PROTOCOL.md §6-7).

Each subscription's changes happen under its own lock, and one driver task per subscription
issues wakes: when a linked stream's tail passes its acked offset and no wake is in flight or
leased, it bumps the generation and either POSTs a signed webhook or appends a wake event to the
wake stream. Callbacks, claims, acks and releases are fenced by token, generation and wake id.
With a state directory (disk storage), every change is saved before it is answered, so a crash
between a wake and its ack replays the wake: nothing acknowledged is redone, nothing unacked lost.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import unquote

import cbor2
import httpx
import trio

from streamkeep.actors.supervisor import Supervisor
from streamkeep.protocol import offsets
from streamkeep.protocol.errors import ProtocolError, bad_request
from streamkeep.protocol.model import Headers, Request, Response
from streamkeep.protocol.stream import AppendSpec
from streamkeep.storage import files
from streamkeep.subscriptions.config import SubscriptionConfig, check_id, normalize_streams
from streamkeep.subscriptions.signing import Keys
from streamkeep.subscriptions.urls import check_resolved, check_webhook_url

log = logging.getLogger(__name__)

CONTROL_PREFIX = "/v1/stream/__ds/"
RETRY_MIN_S = 1.0
RETRY_MAX_S = 60.0
RETRY_JITTER = 0.2
WEBHOOK_TIMEOUT_S = 10.0


@dataclass
class Link:
    acked: int
    explicit: bool = False
    glob: bool = False


@dataclass
class Wake:
    wake_id: str
    generation: int
    snapshot: dict[str, int]  # stream path -> tail position when the wake was issued
    holder: str | None = None
    lease_until: float | None = None  # wall-clock seconds


@dataclass
class Subscription:
    id: str
    config: SubscriptionConfig
    created_at: str
    base_url: str
    links: dict[str, Link] = field(default_factory=dict)
    generation: int = 0
    wake: Wake | None = None
    status: str = "active"
    attempts: int = 0
    next_attempt_at: float | None = None
    deleted: bool = False
    lock: trio.Lock = field(default_factory=trio.Lock, repr=False)
    kick: trio.Event = field(default_factory=trio.Event, repr=False)

    def poke(self) -> None:
        self.kick.set()

    def to_state(self) -> dict:
        return {
            "id": self.id,
            "config": self.config.to_json(),
            "created_at": self.created_at,
            "base_url": self.base_url,
            "links": {p: [link.acked, link.explicit, link.glob] for p, link in self.links.items()},
            "generation": self.generation,
            "wake": None
            if self.wake is None
            else [
                self.wake.wake_id,
                self.wake.generation,
                self.wake.snapshot,
                self.wake.holder,
                self.wake.lease_until,
            ],
            "status": self.status,
            "attempts": self.attempts,
            "next_attempt_at": self.next_attempt_at,
        }

    @classmethod
    def from_state(cls, raw: dict) -> Subscription:
        sub = cls(raw["id"], SubscriptionConfig.from_json(raw["config"]), raw["created_at"], raw["base_url"])
        sub.links = {p: Link(*v) for p, v in raw["links"].items()}
        sub.generation = raw["generation"]
        sub.status = raw["status"]
        sub.attempts = raw["attempts"]
        sub.next_attempt_at = raw["next_attempt_at"]
        # A wake in flight at a crash is over: its holder's lease is void, and pending work is
        # woken again with a new generation (acks never moved past what was acknowledged).
        return sub


def _error(status: int, code: str, message: str, **extra: object) -> Response:
    body = {"error": {"code": code, "message": message, **extra}}
    return Response(status, [("Content-Type", "application/json")], json.dumps(body).encode())


def _json(status: int, body: object) -> Response:
    return Response(
        status,
        [("Content-Type", "application/json"), ("Cache-Control", "no-store")],
        json.dumps(body).encode(),
    )


def _fenced() -> ProtocolError:
    return ProtocolError(409, "FENCED", "this wake is over: its generation or wake id is stale")


class SubscriptionManager:
    def __init__(
        self,
        supervisor: Supervisor,
        keys: Keys,
        *,
        state_dir: Path | None,
        allow_loopback_webhooks: bool,
    ) -> None:
        self.supervisor = supervisor
        self.keys = keys
        self.state_dir = state_dir
        self.allow_loopback = allow_loopback_webhooks
        self.subs: dict[str, Subscription] = {}
        self._nursery: trio.Nursery | None = None
        self._http: httpx.AsyncClient | None = None
        self.now: Callable[[], float] = time.time

    # ---- lifecycle ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with httpx.AsyncClient(timeout=WEBHOOK_TIMEOUT_S, follow_redirects=False) as client:
            self._http = client
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for sub in await trio.to_thread.run_sync(self._load):
                    self.subs[sub.id] = sub
                    nursery.start_soon(self._drive, sub)
                self.supervisor.listeners.append(self.stream_changed)
                task_status.started()
                await trio.sleep_forever()

    def _load(self) -> list[Subscription]:
        if self.state_dir is None:
            return []
        self.state_dir.mkdir(parents=True, exist_ok=True)
        loaded = []
        for path in sorted(self.state_dir.glob("*.cbor")):
            try:
                loaded.append(Subscription.from_state(cbor2.loads(path.read_bytes())))
            except Exception as error:  # a damaged file must not stop the server
                log.error("subscriptions: cannot load %s: %s", path, error)
        if loaded:
            log.info("subscriptions: recovered %d", len(loaded))
        return loaded

    async def _save(self, sub: Subscription) -> None:
        if self.state_dir is None:
            return
        data = cbor2.dumps(sub.to_state())
        await trio.to_thread.run_sync(files.replace, files.OS, self.state_dir, f"{sub.id}.cbor", data)

    async def _forget(self, sub: Subscription) -> None:
        if self.state_dir is not None:
            await trio.to_thread.run_sync(_unlink, self.state_dir / f"{sub.id}.cbor")

    # ---- streams --------------------------------------------------------------------------

    def _tail(self, path: str) -> int | None:
        stream_log = self.supervisor.storage.open(path)
        if stream_log is None or stream_log.meta.soft_deleted:
            return None
        return stream_log.published_tail

    def _incarnation(self, path: str) -> int:
        stream_log = self.supervisor.storage.open(path)
        return offsets.ANY_INCARNATION if stream_log is None else stream_log.meta.incarnation

    def _start_of(self, path: str) -> int:
        stream_log = self.supervisor.storage.open(path)
        return 0 if stream_log is None else stream_log.meta.fork_base

    def stream_changed(self, path: str) -> None:
        """Called at every publish, create and delete of a stream (from its actor)."""
        for sub in self.subs.values():
            link = sub.links.get(path)
            if link is None and sub.config.matches(path) and self._tail(path) is not None:
                # A stream that appeared after the subscription: everything in it is new.
                sub.links[path] = Link(self._start_of(path), glob=True)
                link = sub.links[path]
            if link is not None:
                sub.poke()

    def _pending(self, sub: Subscription) -> list[str]:
        out = []
        for path, link in sub.links.items():
            tail = self._tail(path)
            if tail is not None and tail > link.acked:
                out.append(path)
        return out

    def _streams_json(self, sub: Subscription, snapshot: dict[str, int] | None = None) -> list[dict]:
        items = []
        for path in sorted(sub.links):
            link = sub.links[path]
            incarnation = self._incarnation(path)
            item = {
                "path": path,
                "link_type": "explicit" if link.explicit else "glob",
                "acked_offset": offsets.encode(link.acked, incarnation),
            }
            if snapshot is not None:
                tail = snapshot.get(path, link.acked)
                item["tail_offset"] = offsets.encode(tail, incarnation)
                item["has_pending"] = tail > link.acked
            items.append(item)
        return items

    # ---- the driver: wakes, leases, retries ------------------------------------------------

    async def _drive(self, sub: Subscription) -> None:
        while not sub.deleted:
            async with sub.lock:
                deadline = await self._step(sub)
            sub.kick = trio.Event()
            if sub.deleted:
                return
            with trio.move_on_at(trio.current_time() + max(0.0, deadline - self.now())):
                await sub.kick.wait()

    async def _step(self, sub: Subscription) -> float:
        """One look at a subscription (under its lock); returns when to look again at the latest."""
        now = self.now()
        wake = sub.wake
        if wake is not None and wake.lease_until is not None and now >= wake.lease_until:
            log.info("subscription %s: lease of wake %s expired", sub.id, wake.wake_id)
            sub.wake = wake = None
            await self._save(sub)
        if wake is None and self._pending(sub):
            if sub.next_attempt_at is not None and now < sub.next_attempt_at:
                return sub.next_attempt_at
            wake = await self._issue(sub, now)
            if sub.config.type == "webhook":
                assert self._nursery is not None
                self._nursery.start_soon(self._deliver, sub, wake)
            else:
                await self._announce(sub, wake)
        deadlines = [now + 60.0]
        if sub.wake is not None and sub.wake.lease_until is not None:
            deadlines.append(sub.wake.lease_until)
        if sub.next_attempt_at is not None:
            deadlines.append(sub.next_attempt_at)
        return min(deadlines)

    async def _issue(self, sub: Subscription, now: float) -> Wake:
        sub.generation += 1
        snapshot = {p: t for p in sub.links if (t := self._tail(p)) is not None}
        lease = now + sub.config.lease_ttl_ms / 1000 if sub.config.type == "webhook" else None
        sub.wake = Wake("w_" + secrets.token_urlsafe(12), sub.generation, snapshot, lease_until=lease)
        await self._save(sub)
        return sub.wake

    async def _announce(self, sub: Subscription, wake: Wake) -> None:
        """Pull-wake: append a wake event to the subscription's wake stream."""
        stream = next((p for p in sorted(wake.snapshot) if wake.snapshot[p] > sub.links[p].acked), None)
        event = {
            "type": "wake",
            "subscription_id": sub.id,
            "stream": stream,
            "generation": wake.generation,
            "ts": int(self.now() * 1000),
        }
        spec = AppendSpec.from_request(
            Headers([("Content-Type", "application/json")]), json.dumps(event).encode()
        )
        wake_stream = sub.config.wake_stream or ""
        try:
            pending = await self.supervisor.call(wake_stream, "append", spec)
            await pending.wait()
        except ProtocolError as error:
            log.warning(
                "subscription %s: cannot write to wake stream %r: %s", sub.id, wake_stream, error.message
            )

    async def _deliver(self, sub: Subscription, wake: Wake) -> None:
        """Webhook: POST the signed wake; {"done": true} acks its snapshot at once."""
        assert self._http is not None
        body = json.dumps(
            {
                "subscription_id": sub.id,
                "wake_id": wake.wake_id,
                "generation": wake.generation,
                "streams": self._streams_json(sub, wake.snapshot),
                "callback_url": f"{sub.base_url}{CONTROL_PREFIX}subscriptions/{sub.id}/callback",
                "callback_token": self.keys.token(
                    sub.id,
                    wake.generation,
                    wake.wake_id,
                    "callback",
                    sub.config.lease_ttl_ms / 1000 * 4 + 300,
                ),
            }
        ).encode()
        headers = {"Content-Type": "application/json", "Webhook-Signature": self.keys.signature_header(body)}
        done = ok = False
        try:
            url = sub.config.webhook_url or ""
            await check_resolved(url, allow_loopback=self.allow_loopback)
            response = await self._http.post(url, content=body, headers=headers)
            ok = 200 <= response.status_code < 300
            if ok:
                try:
                    done = json.loads(response.content or b"{}").get("done") is True
                except (ValueError, AttributeError):
                    done = False
            else:
                log.warning("subscription %s: webhook answered %d", sub.id, response.status_code)
        except (httpx.HTTPError, ProtocolError) as error:
            log.warning("subscription %s: webhook failed: %s", sub.id, error)
        async with sub.lock:
            if sub.deleted or sub.wake is None or sub.wake.wake_id != wake.wake_id:
                return  # fenced meanwhile (a callback finished it, or its lease expired)
            if not ok:
                sub.attempts += 1
                backoff = min(RETRY_MAX_S, RETRY_MIN_S * 2 ** (sub.attempts - 1))
                backoff *= 1 + random.uniform(-RETRY_JITTER, RETRY_JITTER)
                sub.next_attempt_at = self.now() + backoff
                sub.status = "failed"
                sub.wake = None
            else:
                sub.attempts, sub.next_attempt_at, sub.status = 0, None, "active"
                if done:
                    self._apply_acks(sub, [(p, t) for p, t in wake.snapshot.items()])
                    sub.wake = None
            await self._save(sub)
        sub.poke()

    def _apply_acks(self, sub: Subscription, acks: list[tuple[str, int]]) -> None:
        for path, position in acks:
            link = sub.links.get(path)
            if link is None:
                raise bad_request("UNKNOWN_STREAM", f"{path!r} is not linked to this subscription")
            tail = self._tail(path)
            if tail is not None and position > tail:
                raise bad_request("OFFSET_OUT_OF_RANGE", f"ack for {path!r} is past the stream's tail")
            link.acked = max(link.acked, position)

    # ---- the control API -------------------------------------------------------------------

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
            return _error(error.status, error.code, error.message)

    async def _dispatch(self, request: Request, sub_id: str, action: str) -> Response:
        method = request.method
        if action == "":
            if method == "PUT":
                return await self._put(request, sub_id)
            if method == "GET":
                return _json(200, self._view(self._get(sub_id)))
            if method == "DELETE":
                return await self._delete(sub_id)
        elif action == "streams" and method == "POST":
            return await self._add_streams(request, sub_id)
        elif action.startswith("streams/") and method == "DELETE":
            return await self._remove_stream(sub_id, unquote(action[len("streams/") :]))
        elif action in ("callback", "ack", "release", "claim") and method == "POST":
            return await getattr(self, f"_{action}")(request, self._get(sub_id))
        raise ProtocolError(405, "METHOD_NOT_ALLOWED", f"{method} is not supported on this control path")

    def _get(self, sub_id: str) -> Subscription:
        sub = self.subs.get(sub_id)
        if sub is None or sub.deleted:
            raise ProtocolError(404, "SUBSCRIPTION_NOT_FOUND", f"no subscription {sub_id!r}")
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
            "streams": self._streams_json(sub),
            "webhook": webhook,
            "wake_stream": config.wake_stream,
            "lease_ttl_ms": config.lease_ttl_ms,
            "created_at": sub.created_at,
            "status": sub.status,
            "description": config.description,
        }

    async def _put(self, request: Request, sub_id: str) -> Response:
        config = SubscriptionConfig.parse(request.body)
        if config.webhook_url is not None:
            check_webhook_url(config.webhook_url, allow_loopback=self.allow_loopback)
        existing = self.subs.get(sub_id)
        if existing is not None and not existing.deleted:
            if existing.config.hash != config.hash:
                raise ProtocolError(
                    409, "SUBSCRIPTION_EXISTS", f"subscription {sub_id!r} exists with another configuration"
                )
            return _json(200, self._view(existing))
        host = request.headers.get("host") or "localhost"
        created = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        sub = Subscription(sub_id, config, created, f"{request.scheme}://{host}")
        # Existing matches are linked at their tail: creating a subscription replays nothing (§6.2).
        for path in self.supervisor.storage.names():
            if config.matches(path) and (tail := self._tail(path)) is not None:
                sub.links[path] = Link(tail, glob=True)
        for path in config.streams:
            link = sub.links.setdefault(path, Link(self._tail(path) or self._start_of(path)))
            link.explicit = True
        await self._save(sub)
        self.subs[sub_id] = sub
        assert self._nursery is not None
        self._nursery.start_soon(self._drive, sub)
        return _json(201, self._view(sub))

    async def _delete(self, sub_id: str) -> Response:
        sub = self._get(sub_id)
        async with sub.lock:
            sub.deleted = True  # a tombstone: in-flight callbacks, acks and releases now fail
            sub.wake = None
            await self._forget(sub)
            del self.subs[sub_id]
        sub.poke()
        return Response(204)

    async def _add_streams(self, request: Request, sub_id: str) -> Response:
        sub = self._get(sub_id)
        try:
            raw = json.loads(request.body or b"null")
        except ValueError:
            raise bad_request("INVALID_JSON", 'the body must be {"streams": [...]}') from None
        paths = normalize_streams(raw.get("streams") if isinstance(raw, dict) else None)
        async with sub.lock:
            for path in paths:
                link = sub.links.setdefault(path, Link(self._tail(path) or self._start_of(path)))
                link.explicit = True
            await self._save(sub)
        sub.poke()
        return Response(204)

    async def _remove_stream(self, sub_id: str, path: str) -> Response:
        sub = self._get(sub_id)
        async with sub.lock:
            link = sub.links.get(path)
            if link is not None and link.explicit:
                link.explicit = False
                link.glob = sub.config.matches(path)
                if not link.glob:
                    del sub.links[path]
                await self._save(sub)
        return Response(204)

    # ---- delivery endpoints ----------------------------------------------------------------

    def _authorized(self, request: Request, sub: Subscription, kind: str) -> dict:
        header = request.headers.get("authorization") or ""
        scheme, _, token = header.partition(" ")
        claims = self.keys.check_token(token.strip(), sub.id, kind) if scheme.lower() == "bearer" else None
        if claims is None:
            raise ProtocolError(
                401, "UNAUTHORIZED", f"a valid {kind} token is required (Authorization: Bearer ...)"
            )
        return claims

    def _wake_body(self, request: Request) -> dict:
        try:
            body = json.loads(request.body or b"null")
        except ValueError:
            raise bad_request("INVALID_JSON", "the body must be a JSON object") from None
        if not isinstance(body, dict):
            raise bad_request("INVALID_JSON", "the body must be a JSON object")
        return body

    def _check_current(self, sub: Subscription, claims: dict, body: dict) -> Wake:
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

    def _parse_acks(self, body: dict) -> list[tuple[str, int]]:
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
            out.append((ack["stream"], offsets.decode(ack["offset"]).position))
        return out

    async def _finish(self, request: Request, sub: Subscription, kind: str) -> Response:
        """Callback (webhook) and ack (pull-wake): apply acks; `done` ends the wake, else the
        call is a heartbeat that extends the lease."""
        body = self._wake_body(request)
        async with sub.lock:
            if sub.deleted:
                raise _fenced()
            claims = self._authorized(request, sub, kind)
            wake = self._check_current(sub, claims, body)
            acks = self._parse_acks(body)
            self._apply_acks(sub, acks)
            next_wake = False
            if body.get("done") is True:
                sub.wake = None
                next_wake = bool(self._pending(sub))
            else:
                wake.lease_until = self.now() + sub.config.lease_ttl_ms / 1000
            await self._save(sub)
        sub.poke()
        return _json(200, {"ok": True, "next_wake": next_wake})

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
            sub.wake = None
            await self._save(sub)
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
            now = self.now()
            wake = sub.wake
            if (
                wake is not None
                and wake.holder is not None
                and wake.lease_until is not None
                and now < wake.lease_until
            ):
                return _error(
                    409,
                    "ALREADY_CLAIMED",
                    "another worker holds the lease",
                    current_holder=wake.holder,
                    generation=wake.generation,
                )
            if wake is None or wake.holder is not None:  # none issued yet, or an expired claim
                if not self._pending(sub):
                    return _error(409, "NO_PENDING_WORK", "nothing to claim: every linked stream is acked")
                wake = await self._issue(sub, now)
            wake.holder = worker
            wake.lease_until = now + sub.config.lease_ttl_ms / 1000
            token = self.keys.token(
                sub.id, wake.generation, wake.wake_id, "claim", sub.config.lease_ttl_ms / 1000 * 4 + 300
            )
            await self._save(sub)
            return _json(
                200,
                {
                    "wake_id": wake.wake_id,
                    "generation": wake.generation,
                    "token": token,
                    "streams": self._streams_json(sub, wake.snapshot),
                    "lease_ttl_ms": sub.config.lease_ttl_ms,
                },
            )


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
