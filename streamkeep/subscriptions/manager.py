"""The subscription manager: wires the state store, the links, the delivery drivers and the control
API together, and is what the server sees (`run`, `handle`, `stream_changed`, `stats`).

With a state directory (disk storage), every change is saved before it is answered, so a crash
between a wake and its ack replays the wake: nothing acknowledged is redone, nothing unacked lost.

In a cluster (`attach`), the links read other members' streams through the cluster's view, and
`stream_changed` also hears of their changes, as their members report them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import trio

from streamkeep.actors.supervisor import Supervisor
from streamkeep.auth.tokens import Principal
from streamkeep.protocol import offsets
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.model import Request, Response
from streamkeep.storage import files
from streamkeep.subscriptions.api import ControlApi
from streamkeep.subscriptions.delivery import Delivery
from streamkeep.subscriptions.faults import Faults
from streamkeep.subscriptions.links import Links
from streamkeep.subscriptions.remote import KnownStreams, Remote
from streamkeep.subscriptions.signing import Keys
from streamkeep.subscriptions.state import Subscription
from streamkeep.subscriptions.store import Store
from streamkeep.subscriptions.wakes import Wakes

log = logging.getLogger("streamkeep.subscriptions")

__all__ = ["SubscriptionManager"]


class SubscriptionManager:
    def __init__(
        self,
        supervisor: Supervisor,
        keys: Keys,
        *,
        state_dir: Path | None,
        allow_loopback_webhooks: bool,
        now: Callable[[], float] = time.time,
        view: KnownStreams | None = None,
        fs: files.FileSystem = files.OS,
    ) -> None:
        self.supervisor = supervisor
        self.subs: dict[str, Subscription] = {}
        self.faults = Faults()
        self.store = Store(state_dir, self.faults, fs)
        self.links = Links(supervisor.storage, view)
        self.remote: Remote | None = None
        self.delivery = Delivery(
            supervisor,
            self.links,
            self.store,
            keys,
            self.faults,
            allow_loopback=allow_loopback_webhooks,
            now=now,
        )
        self.wakes = Wakes(self.links, self.store, keys, now=now)
        self.api = ControlApi(
            self.subs,
            self.links,
            self.store,
            keys,
            self.delivery,
            self.faults,
            self.wakes,
            allow_loopback=allow_loopback_webhooks,
        )
        self._listener_failed = False

    def attach(self, remote: Remote) -> None:
        """Makes this member's subscriptions follow the streams of the whole cluster."""
        self.remote = self.api.remote = self.wakes.remote = self.delivery.remote = remote

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # Listening first: a stream that changes while the state loads is noticed, and what
        # happened before is found by `reconcile`, right after the load with no checkpoint between.
        self.supervisor.listeners.append(self.stream_changed)
        try:
            for sub in await trio.to_thread.run_sync(self.store.load):
                self.links.reconcile(sub)
                self.subs[sub.id] = sub
            async with self.delivery.open(), trio.open_nursery() as nursery:
                for sub in self.subs.values():
                    self.delivery.start(sub)
                if self.remote is not None:
                    await nursery.start(self.remote.run)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self.supervisor.listeners.remove(self.stream_changed)

    async def handle(self, request: Request) -> Response:
        if self.remote is not None:
            routed = await self.remote.route(request)
            if routed is not None:
                return routed
        return await self.api.handle(request)

    def stream_changed(self, path: str) -> None:
        """Called by the stream's actor at every publish, create and delete, synchronously (and in
        a cluster for another member's stream when its member tells of a change): only notes the
        path on the subscriptions that care and pokes their drivers."""
        try:
            for sub in self.subs.values():
                if self.links.notice(sub, path):
                    sub.poke()
        except Exception:  # never let a bug here fail the stream's own write
            if not self._listener_failed:
                self._listener_failed = True
                log.exception("subscriptions: noticing a change of %r failed", path)

    def linked_to(self, path: str, principal: Principal | None) -> list[dict]:
        """The subscriptions following `path` that `principal` may see (the control API's rule:
        with auth on, an owner's own and every one for admins), each with its cursor on `path`.
        Read-only, for the admin API: links not yet absorbed show as of their last change."""
        tail = self.supervisor.storage.open(path)
        out = []
        for sub in sorted(self.subs.values(), key=lambda sub: sub.id):
            link = sub.links.get(path)
            if link is None or sub.deleted:
                continue
            try:
                self.api.check_owner(principal, sub.id)  # the one rule, as the control API applies it
            except ProtocolError:
                continue
            pending = None
            if tail is not None and tail.meta.stream_id == link.stream_id:
                pending = max(0, tail.published_tail - link.acked)
            out.append(
                {
                    "id": sub.id,
                    "type": sub.config.type,
                    "pattern": sub.config.pattern,
                    "status": sub.status,
                    "link_type": "explicit" if link.explicit else "glob",
                    "acked_offset": offsets.encode(link.acked, link.incarnation),
                    "pending_bytes": pending,
                    "skipped_bytes": link.skipped,
                    "generation": sub.generation,
                    "wake_in_flight": sub.wake is not None,
                }
            )
        return out

    def stats(self) -> dict:
        faults = self.faults
        subs = list(self.subs.values())
        return {
            "subscriptions": len(subs),
            "save_failures": faults.save_failures,
            "saves_failing": faults.saves_failing,
            "in_backoff": sum(1 for sub in subs if sub.fault_until is not None),
            "webhooks_retrying": sum(1 for sub in subs if sub.status == "failed"),
            "task_failures": faults.task_failures,
            "last_error": faults.last_error,
            "deliveries": dict(self.delivery.counts),
            **({} if self.remote is None else {"cluster": self.remote.stats()}),
        }
