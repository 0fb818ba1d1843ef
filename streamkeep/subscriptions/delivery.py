"""Delivery: one driver task per subscription issues wakes, by signed webhook or by pull-wake.

When a linked stream's tail passes its acked offset and no wake is in flight or leased, the driver
bumps the generation, saves the wake, and then either POSTs it to the webhook (a `{"done": true}`
answer acks its snapshot) or appends a wake event to the wake stream for workers to claim.
Leases expire on the driver's clock. A receiver that fails gets retries with backoff (1-60 s,
20% jitter, persisted); a failure of our own (a full disk, a bug) is caught, told once per cause,
and retried with backoff too: no driver or delivery task can end the server.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import trio

from streamkeep.actors.messages import Append
from streamkeep.actors.supervisor import Supervisor
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.model import Headers
from streamkeep.protocol.names import CONTROL_PREFIX
from streamkeep.protocol.stream import AppendSpec
from streamkeep.subscriptions.config import refuse_wake_stream
from streamkeep.subscriptions.faults import RETRY, Faults
from streamkeep.subscriptions.links import Links
from streamkeep.subscriptions.remote import Remote
from streamkeep.subscriptions.signing import Keys
from streamkeep.subscriptions.state import Subscription, Wake
from streamkeep.subscriptions.store import Store
from streamkeep.subscriptions.urls import check_resolved

log = logging.getLogger("streamkeep.subscriptions")

WEBHOOK_TIMEOUT_S = 10.0
IDLE_LOOK_S = 60.0  # an idle driver looks again this often even without a poke


def token_ttl(sub: Subscription) -> float:
    return sub.config.lease_ttl_ms / 1000 * 4 + 300


class Delivery:
    def __init__(
        self,
        supervisor: Supervisor,
        links: Links,
        store: Store,
        keys: Keys,
        faults: Faults,
        *,
        allow_loopback: bool,
        now: Callable[[], float],
    ) -> None:
        self.supervisor = supervisor
        self.links = links
        self.store = store
        self.keys = keys
        self.faults = faults
        self.allow_loopback = allow_loopback
        self.now = now
        self._nursery: trio.Nursery | None = None
        self._http: httpx.AsyncClient | None = None
        self.remote: Remote | None = None  # in a cluster: wake streams of other members
        # For metrics: webhook posts answered 2xx ("delivered") or not ("failed"), posts after a
        # failure ("retried"), and wake events appended to pull-wake streams ("announced").
        self.counts: Counter[str] = Counter()

    @asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        """The HTTP client and the nursery the drivers and deliveries run in."""
        async with httpx.AsyncClient(timeout=WEBHOOK_TIMEOUT_S, follow_redirects=False) as client:
            async with trio.open_nursery() as nursery:
                self._http, self._nursery = client, nursery
                yield
                nursery.cancel_scope.cancel()

    def start(self, sub: Subscription) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._drive, sub, name=f"subscription-driver:{sub.id}")

    # ---- the driver ------------------------------------------------------------------------

    async def _drive(self, sub: Subscription) -> None:
        while not sub.deleted:
            if sub.fault_until is not None:
                await self._sleep_until(sub, sub.fault_until)
                if sub.deleted:
                    return
            sub.kick = trio.Event()  # before the step: a poke during it makes the next one prompt
            try:
                deadline = await self._step(sub)
            except Exception as error:
                self.faults.failed(sub, "driver", error)
                sub.fault_count += 1
                sub.fault_until = trio.current_time() + RETRY.delay(sub.fault_count)
                continue
            self.faults.succeeded(sub, "driver")
            sub.fault_count, sub.fault_until = 0, None
            with trio.move_on_at(trio.current_time() + max(0.0, deadline - self.now())):
                await sub.kick.wait()

    async def _sleep_until(self, sub: Subscription, until: float) -> None:
        """Backoff: pokes do not shorten it (a publish storm must not become a retry storm), a
        deletion does."""
        while not sub.deleted and trio.current_time() < until:
            with trio.move_on_at(until):
                await sub.kick.wait()
            sub.kick = trio.Event()

    async def _step(self, sub: Subscription) -> float:
        """One look at a subscription; returns when (wall clock) to look again at the latest."""
        issued = None
        announce_after: Wake | None = None  # a wake event for another member's wake stream
        async with sub.lock:
            if sub.deleted:
                return self.now()
            self.links.absorb(sub)
            now = self.now()
            async with self.store.change(sub, links=False):  # issuing a wake moves no cursor
                wake = sub.wake
                if wake is not None and wake.lease_until is not None and now >= wake.lease_until:
                    log.info("subscription %s: lease of wake %s expired", sub.id, wake.wake_id)
                    sub.wake = wake = None
                retry_due = sub.next_attempt_at is None or now >= sub.next_attempt_at
                if wake is None and retry_due and self.links.pending(sub):
                    issued = sub.issue(self.links.snapshot(sub), now)
            if issued is not None and sub.config.type == "pull-wake":
                if self.remote is not None and self.remote.elsewhere(sub.config.wake_stream or ""):
                    announce_after = issued
                else:
                    await self._announce(sub, issued)
        if announce_after is not None:
            # Another member's wake stream: appended without the lock, so a member that does not
            # answer (up to 5 s) stalls no claim, ack or callback of this subscription meanwhile.
            # The wake is saved and only this driver appends events, so they stay in order.
            await self._announce(sub, announce_after, held=False)
        if issued is not None and sub.config.type == "webhook":
            assert self._nursery is not None
            self._nursery.start_soon(self._deliver, sub, issued)
        deadlines = [now + IDLE_LOOK_S]
        if sub.wake is not None and sub.wake.lease_until is not None:
            deadlines.append(sub.wake.lease_until)
        if sub.next_attempt_at is not None:
            deadlines.append(sub.next_attempt_at)
        return min(deadlines)

    # ---- pull-wake -------------------------------------------------------------------------

    async def _announce(self, sub: Subscription, wake: Wake, *, held: bool = True) -> None:
        """Appends a wake event to the wake stream (the wake saved; holding `sub.lock` unless
        `held` is False). If that fails, the wake is withdrawn (unless a worker claimed it
        meanwhile) and the error raised: the driver retries with backoff."""
        stream = next(
            (
                path
                for path in sorted(wake.snapshot)
                if (link := sub.links.get(path)) is not None and wake.snapshot[path].position > link.acked
            ),
            None,
        )
        event = {
            "type": "wake",
            "subscription_id": sub.id,
            "stream": stream,
            "generation": wake.generation,
            "ts": int(self.now() * 1000),
        }
        wake_stream = sub.config.wake_stream or ""
        try:
            refuse_wake_stream(wake_stream, ())  # one saved before the name was reserved
            body = json.dumps(event).encode()
            if self.remote is None or not await self.remote.append_wake(wake_stream, body):
                await append_wake_event(self.supervisor, wake_stream, body)
            self.counts["announced"] += 1
        except Exception as error:
            # Withdrawn in memory only: a saved wake is void after a restart anyway, and a wake
            # nobody was told about must not block the next one.
            if held:
                self._withdraw(sub, wake)
            else:
                async with sub.lock:  # not in the middle of a claim saving this wake
                    self._withdraw(sub, wake)
            if isinstance(error, ProtocolError):
                message = f"cannot write to wake stream {wake_stream!r}: {error.message}"
                raise ProtocolError(error.status, error.code, message) from None
            raise

    @staticmethod
    def _withdraw(sub: Subscription, wake: Wake) -> None:
        if sub.wake is wake and wake.holder is None:
            sub.wake = None

    # ---- webhooks --------------------------------------------------------------------------

    async def _deliver(self, sub: Subscription, wake: Wake) -> None:
        """POSTs the signed wake, then records the outcome. Never raises: a failure of ours
        counts as a failed attempt (retried with backoff) or, past the POST, leaves the wake to
        its lease."""
        if sub.attempts:
            self.counts["retried"] += 1
        try:
            ok, done = await self._post(sub, wake)
            self.counts["delivered" if ok else "failed"] += 1
        except Exception as error:  # a bug building or sending the wake
            self.faults.failed(sub, "webhook delivery", error)
            ok = done = False
        else:
            self.faults.succeeded(sub, "webhook delivery")
        try:
            async with sub.lock:
                if sub.deleted or sub.wake is None or sub.wake.wake_id != wake.wake_id:
                    return  # fenced meanwhile (a callback finished it, or its lease expired)
                async with self.store.change(sub):
                    self._settle(sub, wake, ok=ok, done=done)
            self.faults.succeeded(sub, "webhook outcome")
        except Exception as error:
            self.faults.failed(sub, "webhook outcome", error)
        finally:
            sub.poke()

    def _settle(self, sub: Subscription, wake: Wake, *, ok: bool, done: bool) -> None:
        if not ok:
            sub.attempts += 1
            sub.next_attempt_at = self.now() + RETRY.delay(sub.attempts)
            sub.status = "failed"
            sub.wake = None
            return
        sub.attempts, sub.next_attempt_at, sub.status = 0, None, "active"
        if done:
            self.links.ack_snapshot(sub, wake)
            sub.wake = None

    async def _post(self, sub: Subscription, wake: Wake) -> tuple[bool, bool]:
        """(2xx?, answered {"done": true}?). The receiver's failures are logged and return
        False; anything else raises."""
        assert self._http is not None
        body = json.dumps(
            {
                "subscription_id": sub.id,
                "wake_id": wake.wake_id,
                "generation": wake.generation,
                "streams": self.links.view(sub, wake),
                "callback_url": f"{sub.base_url}{CONTROL_PREFIX}subscriptions/{sub.id}/callback",
                "callback_token": self.keys.token(
                    sub.id, wake.generation, wake.wake_id, "callback", token_ttl(sub)
                ),
            }
        ).encode()
        headers = {"Content-Type": "application/json", "Webhook-Signature": self.keys.signature_header(body)}
        url = sub.config.webhook_url or ""
        try:
            await check_resolved(url, allow_loopback=self.allow_loopback)
            response = await self._http.post(url, content=body, headers=headers)
        except (httpx.HTTPError, ProtocolError) as error:
            log.warning("subscription %s: webhook failed: %s", sub.id, error)
            return False, False
        if not 200 <= response.status_code < 300:
            log.warning("subscription %s: webhook answered %d", sub.id, response.status_code)
            return False, False
        try:
            answer = json.loads(response.content or b"{}")
        except ValueError:
            return True, False
        return True, isinstance(answer, dict) and answer.get("done") is True


async def append_wake_event(supervisor: Supervisor, wake_stream: str, body: bytes) -> None:
    """Appends one wake event to a wake stream of this member, durably."""
    spec = AppendSpec.from_request(Headers([("Content-Type", "application/json")]), body)
    pending = await supervisor.call(wake_stream, Append(spec))
    await pending.wait()
