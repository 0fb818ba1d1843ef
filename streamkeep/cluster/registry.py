"""One `__registry__` for a cluster: kept by the member that owns the name, fed by all of them.

The member that placement gives `__registry__` keeps it (`ClusterKeeper`, a `RegistryKeeper` that
also takes entries from the others); every other member keeps none and sends its creates and
deletes there (`registry_relay.py`). An entry's member is never stored: it is the owner of the
entry's name (`Placement.owner`), so "member B's part of the registry" is a pure function of the
names listed, and a reconcile of B's part touches nothing else.

The calls (`peers.py`, CBOR):

- `registry.change {name, value|None, sent}`: B tells the keeper of one create (value) or delete
  (None), before answering its client. The keeper refuses (409) a name B does not own. A change
  whose turn comes more than `ACCEPT_SECONDS` after B sent it is refused (503) rather than
  appended: B gives up waiting after `GIVE_UP_SECONDS` (longer) and leaves the stream to its
  repair, so an insert that arrives late can never land after the delete B made once it gave up.
  (Wall clocks of members must agree within a few seconds; forwarding already needs 60.)
- `registry.list {}` -> `{streams: {name: value}}`: a member's live streams, as its own
  single-process keeper would list them; `{probe: true}` -> `{}` only says it answers.
- `registry.reconcile {}`: B asks the keeper to reconcile B's part (at B's start, and after B
  could not send a change); the keeper calls `registry.list` back.

A reconcile holds the keeper's lock from its fold to its append, and asks for the lists inside it:
a change B made before B answered is in B's list, a change made after waits for the lock and is
appended after the reconcile's entries, so neither can be undone by it. Creates wait for that lock
too, so members are first probed outside it, and only those that answer are asked for their list
(within `LIST_SECONDS`). A member that does not answer keeps its entries as they are (never
deleted because a member is merely unreachable) and is asked again with backoff (1 s doubling to
60 s), logged once per member and cause (a warning: members start and stop), and shown under
`members_behind` in the registry's /stats section. The keeper reconciles every member's part at
its start (before it serves; members still starting are simply asked again), after a failed write
of its own, and when a member asks.

A list is one CBOR map of every stream of a member: fine for hundreds of thousands of streams,
not for tens of millions (it would want paging by name).
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from streamkeep.actors.supervisor import Supervisor
from streamkeep.background import Backoff
from streamkeep.cluster.peers import PeerOps, Peers
from streamkeep.cluster.placement import Member
from streamkeep.health import Causes
from streamkeep.protocol.errors import ProtocolError
from streamkeep.registry import entries
from streamkeep.registry.entries import NAME
from streamkeep.registry.keeper import RegistryKeeper

log = logging.getLogger(__name__)

CHANGE = "registry.change"
LIST = "registry.list"
RECONCILE = "registry.reconcile"

LIST_SECONDS = 5.0  # the most a reconcile waits for a member's list (it holds the lock meanwhile)
ACCEPT_SECONDS = 8.0  # a change decided later than this after it was sent is refused
GIVE_UP_SECONDS = 10.0  # a member waits this long for the keeper to take a change (> ACCEPT_SECONDS)


class LateChange(ProtocolError):
    def __init__(self, waited: float) -> None:
        super().__init__(
            503,
            "registry_change_late",
            f"the entry waited {waited:.1f} s for its turn; the sending member repairs it instead",
            [("Retry-After", "1")],
        )


class Unreached:
    """The members a registry call could not reach, and why: logged once per member and cause
    (a warning, like the other calls between members, and a line when it answers again), and
    counted for /stats. Not `Health`, whose errors are for this process's own failures."""

    def __init__(self, consequence: str) -> None:
        self.consequence = consequence
        self.causes: dict[str, str] = {}  # member -> "code: message"
        self._told: Causes[str, tuple[str, str]] = Causes()  # member -> (member, code)
        self.failures = 0

    def failed(self, member_id: str, cause: str) -> None:
        self.failures += 1
        self.causes[member_id] = cause
        if self._told.failed(member_id, (member_id, _code(cause))):
            log.warning(
                "registry: member %s: %s; %s (logged once per cause)", member_id, cause, self.consequence
            )

    def cleared(self, member_id: str) -> None:
        self.causes.pop(member_id, None)
        if self._told.cleared(member_id) is not None:
            log.info("registry: member %s answers again", member_id)


def _code(cause: str) -> str:
    return cause.split(":", 1)[0]


class ClusterKeeper(RegistryKeeper):
    """The registry of the whole cluster, on the member that owns `__registry__`."""

    def __init__(self, supervisor: Supervisor, peers: Peers) -> None:
        super().__init__(supervisor)
        self.peers = peers
        self.placement = peers.placement
        self.member = peers.member
        # Members whose part could not be reconciled, and why (asked again with backoff).
        self.behind = Unreached("its streams' entries are left as they are until it answers")
        self._wake = trio.Event()
        self.changes_from_members = 0
        self.late_changes = 0

    def register(self, ops: PeerOps) -> None:
        ops.register(CHANGE, self._on_change)
        ops.register(RECONCILE, self._on_reconcile)

    # ---- reconciling ----------------------------------------------------------------------

    async def reconcile(self) -> None:
        """Every member's part (at start, and after a failed write of this keeper's own)."""
        others = [member.id for member in self.placement.members if member.id != self.member]
        await self.reconcile_members([self.member, *await self._answering(others)])

    async def reconcile_members(self, member_ids: list[str]) -> dict[str, str]:
        """Makes the entries of `member_ids`' streams match their lists; returns, by member, why
        a member's part was left as it is (it did not answer)."""
        unanswered: dict[str, str] = {}
        await self.storage.recovered()  # this member's part lists every stream; not under the lock

        async def wanted(listed: dict[str, Any]) -> dict[str, dict[str, Any]]:
            parts = await self._parts(member_ids)
            result = dict(listed)
            for member_id, part in parts.items():
                if isinstance(part, str):
                    unanswered[member_id] = part  # its entries stay as they are
                    continue
                for name in [name for name in result if self._owner_id(name) == member_id]:
                    del result[name]
                result.update(part)
            return result

        await self._reconcile(wanted)
        for member_id in member_ids:
            if member_id != self.member:
                self._note(member_id, unanswered.get(member_id))
        return unanswered

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(super().run)  # after a failed write of our own: everything
            nursery.start_soon(self._catch_up)

    async def _catch_up(self) -> None:
        """Asks the members that did not answer again, with backoff, until they do."""
        backoff = Backoff(jitter=0)
        while True:
            if not self.behind.causes:
                backoff.reset()
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            await trio.sleep(backoff.failed())
            answering = await self._answering(sorted(self.behind.causes))
            if answering:
                await self.reconcile_members(answering)

    async def _answering(self, member_ids: list[str]) -> list[str]:
        """The members that answer a probe, asked outside the lock: a member that is down or hung
        must not hold up every create while a reconcile waits for its list under the lock."""
        answered: list[str] = []

        async def probe(member: Member) -> None:
            cause = f"timeout: no answer within {LIST_SECONDS:g} s"
            with trio.move_on_after(LIST_SECONDS):
                try:
                    await self.peers.call(member, LIST, {"probe": True})
                except ProtocolError as error:
                    cause = f"{error.code}: {error.message}"
                else:
                    answered.append(member.id)
                    return
            self._note(member.id, cause)

        async with trio.open_nursery() as nursery:
            for member_id in member_ids:
                nursery.start_soon(probe, self.placement.member(member_id))
        return sorted(answered)

    async def _parts(self, member_ids: list[str]) -> dict[str, dict[str, Any] | str]:
        """Each member's live streams (this member's from storage), or why it gave none."""
        parts: dict[str, dict[str, Any] | str] = {}

        async def ask(member: Member) -> None:
            with trio.move_on_after(LIST_SECONDS):
                try:
                    answer = await self.peers.call(member, LIST, {})
                except ProtocolError as error:
                    parts[member.id] = f"{error.code}: {error.message}"
                    return
                streams = answer.get("streams")
                if not isinstance(streams, dict):
                    parts[member.id] = "bad_answer: registry.list without a streams map"
                    return
                parts[member.id] = self._own(member.id, streams)
                return
            parts[member.id] = f"timeout: no list within {LIST_SECONDS:g} s"

        async with trio.open_nursery() as nursery:
            for member_id in member_ids:
                if member_id == self.member:
                    parts[member_id] = self._own(member_id, self._live())
                else:
                    nursery.start_soon(ask, self.placement.member(member_id))
        return parts

    def _own(self, member_id: str, streams: dict[Any, Any]) -> dict[str, dict[str, Any]]:
        """The streams of a list that `member_id` owns (one it holds and does not own is out of
        every client's reach: placement sends its name elsewhere)."""
        return {
            name: value
            for name, value in streams.items()
            if isinstance(name, str)
            and name != NAME
            and entries.is_value(name, value)
            and self._owner_id(name) == member_id
        }

    def _owner_id(self, name: str) -> str:
        return self.placement.owner(name).id

    def _note(self, member_id: str, cause: str | None) -> None:
        if cause is None:
            self.behind.cleared(member_id)
        else:
            self.behind.failed(member_id, cause)
            self._wake.set()

    # ---- answering the other members ---------------------------------------------------

    async def _on_change(self, caller: str, payload: dict[str, Any]) -> dict[str, Any]:
        name, value, sent = payload.get("name"), payload.get("value"), payload.get("sent")
        if (
            not isinstance(name, str)
            or not isinstance(sent, int | float)
            or not (value is None or entries.is_value(name, value))
        ):
            raise ProtocolError(
                400,
                "bad_cluster_call",
                "registry.change needs name, value (null, or path, contentType and createdAt: a "
                "string, a string and an integer) and sent",
            )
        if name == NAME or self._owner_id(name) != caller:
            raise ProtocolError(409, "not_owner", f"member {caller!r} does not own stream {name[:200]!r}")
        self.changes_from_members += 1

        def still_due() -> None:
            waited = self.clock() - sent
            if waited > ACCEPT_SECONDS:
                self.late_changes += 1
                raise LateChange(waited)

        try:
            await self._record(name, value, still_due)
        except LateChange:
            raise
        except Exception as error:  # our write failed: our repair reconciles every part, the caller's too
            self._failed(error)
        else:
            self.health.ok("registry")
        return {}

    async def _on_reconcile(self, caller: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            unanswered = await self.reconcile_members([caller])
        except Exception as error:  # a failing write: ours to repair from now on
            self._failed(error)
            return {}
        if caller in unanswered:
            raise ProtocolError(
                503,
                "registry_unreconciled",
                f"the registry could not list member {caller!r}'s streams ({unanswered[caller]})",
                [("Retry-After", "1")],
            )
        return {}

    def stats(self) -> dict:
        return {
            **super().stats(),
            "keeper": self.member,
            "members_behind": dict(self.behind.causes),
            "member_failures": self.behind.failures,
            "changes_from_members": self.changes_from_members,
            "late_changes": self.late_changes,
        }
