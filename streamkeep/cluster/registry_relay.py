"""A member that does not own `__registry__`: sends its creates and deletes to the one that does.

The stream actors tell the relay of every create and delete, as they tell a keeper in a single
process (`Lifecycle`), and await it before answering; the relay sends the change to the keeper
(`registry.change`, cluster/registry.py) and returns once it is taken. It never fails the
change: if the keeper cannot be reached, refuses, or takes longer than `GIVE_UP_SECONDS`, the
stream's change stands and the relay owes the registry a repair: it asks the keeper to reconcile
this member's part (`registry.reconcile`, which lists our streams back) at once, then, while
that fails, with backoff from 1 s doubling to 60 s (cut short when the keeper calls for our
list: it is back), logging once per cause (a warning) and showing `owed` and its `cause` in
its /stats section. While the keeper is taken for down (`Peers.down`: its last call failed
unavailable, whichever feature made it), changes are not sent at all (no create waits on an owner
known to be down); the repair's list covers them.

A change that failed while a repair was under way may be missing from the list that repair
took, so such a repair does not settle the debt: another round follows. At start the member owes
one too (a crash may have come between a change and its entry, or the keeper may have missed
changes while it was down), paid once this member answers calls (`run` starts then).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import trio

from streamkeep.background import Backoff
from streamkeep.cluster.peers import PeerOps, Peers
from streamkeep.cluster.registry import (
    CHANGE,
    GIVE_UP_SECONDS,
    LIST,
    RECONCILE,
    Unreached,
)
from streamkeep.health import Health
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.stream import StreamMeta
from streamkeep.registry import entries
from streamkeep.registry.entries import NAME
from streamkeep.registry.keeper import live_streams
from streamkeep.storage.base import Storage

log = logging.getLogger(__name__)


class RegistryRelay:
    def __init__(self, storage: Storage, peers: Peers, *, clock: Callable[[], float] = time.time) -> None:
        self.storage = storage
        self.peers = peers
        self.keeper = peers.placement.owner(NAME)
        self.clock = clock
        self.health = Health()
        self.owed = True  # reconciled at start: see the module docstring
        self._owed_changes = 0  # changes not taken since start; a repair settles those before it
        self._due = trio.Event()
        self._due.set()
        self._heard = trio.Event()  # set when the keeper calls: the backoff ends early
        self.unreached = Unreached("the stream changed all the same; its entry is owed and will be repaired")
        self.sent = 0
        self.unsent = 0
        self.repairs = 0

    def register(self, ops: PeerOps) -> None:
        ops.register(LIST, self._on_list)

    # ---- told by the stream actors (Lifecycle) --------------------------------------------

    async def created(self, meta: StreamMeta) -> None:
        if meta.name != NAME:
            await self._send(meta.name, entries.value(meta))

    async def deleted(self, name: str) -> None:
        if name != NAME:
            await self._send(name, None)

    def unsure(self) -> None:
        self._owe()

    async def _send(self, name: str, value: dict[str, Any] | None) -> None:
        if self.peers.down.why(self.keeper.id) is not None:
            self._owe()
            return
        try:
            with trio.fail_after(GIVE_UP_SECONDS):
                await self.peers.call(
                    self.keeper, CHANGE, {"name": name, "value": value, "sent": self.clock()}
                )
        except (ProtocolError, trio.TooSlowError) as error:
            self._gave_up(error)
            self._owe(_cause(error))
        except Exception as error:  # a bug here must not fail the stream's own change
            log.exception("registry: sending the entry of %r failed", name)
            self._owe(_cause(error))
        else:
            self.sent += 1

    def _owe(self, cause: tuple[str, str] | None = None) -> None:
        self.unsent += 1
        self._owed_changes += 1
        self.owed = True
        if cause is not None:
            self._fail(*cause)
        self._due.set()

    # ---- the repair -------------------------------------------------------------------------

    async def run(self) -> None:
        """Pays what is owed, with backoff; started once this member answers the keeper's calls."""
        backoff = Backoff(jitter=0)
        while True:
            await self._due.wait()
            self._due = trio.Event()
            if not self.owed:
                continue
            settles = self._owed_changes  # a change owed during the round owes another one
            try:
                with trio.fail_after(GIVE_UP_SECONDS):
                    await self.peers.call(self.keeper, RECONCILE, {})
            except (ProtocolError, trio.TooSlowError) as error:
                self._gave_up(error)
                self._fail(*_cause(error))
                self._due.set()
                self._heard = trio.Event()
                with trio.move_on_after(backoff.failed()):
                    await self._heard.wait()  # the keeper asking for our list: it is back, try now
                    backoff.reset()
                continue
            self.repairs += 1
            backoff.reset()
            if self._owed_changes == settles:
                self.owed = False
                self.unreached.cleared(self.keeper.id)
            else:
                self._due.set()  # one failed meanwhile: the list may have missed it

    def _gave_up(self, error: Exception) -> None:
        if isinstance(error, trio.TooSlowError):  # unanswered: down, as an unreachable one is
            self.peers.down.mark(self.keeper.id, f"no answer within {GIVE_UP_SECONDS:g} s")

    def _fail(self, code: str, message: str) -> None:
        self.unreached.failed(self.keeper.id, f"{code}: {message}")

    # ---- answering the keeper ---------------------------------------------------------------

    async def _on_list(self, caller: str, payload: dict[str, Any]) -> dict[str, Any]:
        self._heard.set()
        if payload.get("probe"):
            return {}
        if self.storage.unread():  # the keeper holds its lock for this answer: do not make it wait
            raise ProtocolError(503, "recovering", "this member is still reading its streams from disk")
        return {"streams": live_streams(self.storage, self.clock())}

    def stats(self) -> dict:
        return {
            "keeper": self.keeper.id,
            "owed": self.owed,
            "sent": self.sent,
            "unsent": self.unsent,
            "repairs": self.repairs,
            "calls_failed": self.unreached.failures,
            "cause": self.unreached.causes.get(self.keeper.id),  # why entries are owed, while they are
            **self.health.stats(),  # the repair loop's own crashes
        }


def _cause(error: BaseException) -> tuple[str, str]:
    if isinstance(error, ProtocolError):
        return error.code, error.message
    if isinstance(error, trio.TooSlowError):
        return "timeout", f"no answer within {GIVE_UP_SECONDS:g} s"
    return type(error).__name__, repr(error)
