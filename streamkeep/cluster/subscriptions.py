"""Subscriptions across the members of a cluster (remote.Remote for the subscriptions package).

One member keeps each subscription, its state and its cursors: the member its id's slot names, the
one HAProxy sends its control requests to (`subscription_owner`); a control request that reaches
another member anyway (an id percent-encoded another way, a client talking to a member directly) is
forwarded to it. The keeper follows streams on every member:

- It tells the other members what each of its subscriptions follows (pattern, explicit streams)
  when one is created or gains streams (`sub.interest`), and learns their matching streams' state
  in the same answer: the backfill links them at their tails. A member that cannot be reached then
  makes the creation a 503 (retry): a backfill without it would later replay its streams.
- A member hears of its own streams' changes synchronously (the supervisor's listeners) and only
  marks the stream dirty for each member with a subscription that follows it. One task per other
  member sends the dirty streams' states, read when sent, in batches (`sub.changed`): appends never
  wait for another member, a burst of appends to one stream costs one report, and a report that
  fails goes back into the dirty set and is retried with backoff (at least once).
- At start, and whenever a member restarts, the two exchange all their subscriptions and the paths
  each follows on the other (`sub.hello`), and each reports every matching stream again. So what a
  crash lost (dirty streams not yet reported, the other members' subscriptions) is learnt again,
  and a stream deleted meanwhile is reported gone.
- Reports carry the reporter's stamp (subscriptions_view.py); a stale one is dropped.
- A callback acking past the tail last reported asks the stream's member first (`sub.states`);
  wake events for a wake stream another member owns are appended there (`sub.wake`).

A member that cannot be reached costs retries with backoff (up to 10 s, and at once when it says
hello again), one log line per cause and counters in the subscriptions' `/stats`; never a crash.
A member whose last call failed unavailable (503: unreachable, no answer within 5 s) is taken for
down (`Peers` keeps that, for every feature alike): calls a client waits for (creations, added
streams, acks past the known tail, wake events, a claim's catch-up) fail at once for it (503,
Retry-After) instead of waiting 5 s again each time, as the registry relay skips a keeper that is
down, until a probe (`sub.states` of no path, with the same backoff), a report, its hello or any
other call to it shows it answers again.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import unquote

import trio

from streamkeep.actors.supervisor import Supervisor
from streamkeep.background import Backoff
from streamkeep.cluster.forward import Forwarder, forwarded_by
from streamkeep.cluster.peers import PeerOps, Peers, PeerUnavailable
from streamkeep.cluster.placement import Member
from streamkeep.cluster.subscriptions_view import (
    Interest,
    Interests,
    RemoteStreams,
    Stamp,
    state_of,
    subscription_owner,
)
from streamkeep.health import Causes
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.model import Request, Response
from streamkeep.protocol.names import CONTROL_PREFIX
from streamkeep.protocol.responses import error as error_response
from streamkeep.subscriptions.config import check_id
from streamkeep.subscriptions.delivery import append_wake_event
from streamkeep.subscriptions.manager import SubscriptionManager
from streamkeep.subscriptions.state import Subscription

log = logging.getLogger("streamkeep.subscriptions")

BATCH = 512  # stream states per report
ASK_TIMEOUT_S = 5.0  # a call a client's request waits for (creation, an ack past the known tail)
RETRY_MIN_S = 0.5
RETRY_MAX_S = 10.0
KNOWN_DOWN = "it failed a call just before; it is asked again once it answers"


class _Member:
    """What this member owes one other member, and how talking to it goes."""

    def __init__(self, member: Member) -> None:
        self.member = member
        self.dirty: set[str] = set()  # this member's streams to report to it
        self.wake = trio.Event()  # something is dirty
        self.retry_now = trio.Event()  # it said hello: stop backing off
        self.greeted = False  # subscriptions exchanged since this process started
        self.failures = 0  # calls that failed
        self.reports = 0  # states reported
        self.retry = Backoff(RETRY_MIN_S, RETRY_MAX_S)

    def poke(self) -> None:
        self.wake.set()


class SubscriptionPeers:
    def __init__(
        self,
        manager: SubscriptionManager,
        view: RemoteStreams,
        peers: Peers,
        ops: PeerOps,
        forwarder: Forwarder | None,
        secret: str,
    ) -> None:
        self.manager = manager
        self.view = view
        self.peers = peers
        self.placement = peers.placement
        self.me = peers.member
        self.forwarder = forwarder
        self.secret = secret
        self.supervisor: Supervisor = manager.supervisor
        self.boot = time.time_ns()
        self._counter = 0
        self.interests = Interests()  # the other members' subscriptions
        self._mine: dict[str, Interest] = {}  # what this member's subscriptions follow, as told
        self._members = {member.id: _Member(member) for member in peers.others()}
        # Why calls to a member fail now, told once per member and cause.
        self._failing: Causes[str, tuple[str, str]] = Causes()
        self._nursery: trio.Nursery | None = None
        self.forwarded = 0
        for op, handler in (
            ("sub.hello", self._on_hello),
            ("sub.interest", self._on_interest),
            ("sub.changed", self._on_changed),
            ("sub.states", self._on_states),
            ("sub.wake", self._on_wake),
        ):
            ops.register(op, handler)

    def _stamp(self) -> Stamp:
        self._counter += 1
        return (self.boot, self._counter)

    # ---- background --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # Before the member answers anyone: a hello must carry every subscription it keeps.
        for sub in self.manager.subs.values():
            self._mine[sub.id] = interest_of(sub)
        self.supervisor.listeners.append(self.stream_changed)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                for state in self._members.values():
                    nursery.start_soon(self._watch, state, name=f"subscriptions-hello:{state.member.id}")
                    nursery.start_soon(self._report, state, name=f"subscriptions-report:{state.member.id}")
        finally:
            self.supervisor.listeners.remove(self.stream_changed)

    def stream_changed(self, path: str) -> None:
        """A stream of this member changed (synchronous, on the append's path): marks it for the
        members that follow it, nothing more."""
        for member_id in self.interests.members_for(path):
            state = self._members.get(member_id)
            if state is not None:
                state.dirty.add(path)
                state.poke()

    async def _watch(self, state: _Member) -> None:
        """Exchanges subscriptions with `state.member` once (it greets us itself when it restarts),
        then, whenever it is taken for down, probes it with backoff until it answers again."""
        while True:
            if state.greeted and self.peers.down.why(state.member.id) is None:
                await self.peers.down.went_down(state.member.id)
                continue
            what = "hello" if not state.greeted else "probe"
            try:
                if not state.greeted:
                    answer = await self.peers.call(state.member, "sub.hello", self._hello(state.member.id))
                    self._take_hello(state, answer)
                else:
                    await self._ask(state.member, "sub.states", {"paths": []}, fail_fast=False)
            except Exception as error:
                self._failed(state, what, error)
                await self._pause(state)
                continue
            self._recovered(state)

    async def _report(self, state: _Member) -> None:
        """Reports this member's dirty streams to `state.member`, in batches, until none is left;
        a failed report is retried with backoff (its streams stay dirty)."""
        while True:
            await state.wake.wait()
            state.wake = trio.Event()
            while state.dirty:
                batch = [state.dirty.pop() for _ in range(min(BATCH, len(state.dirty)))]
                stamp = self._stamp()  # taken as the states are read: nothing can come between
                states = {path: state_of(self.supervisor.storage, path) for path in batch}
                try:
                    await self.peers.call(
                        state.member, "sub.changed", {"stamp": list(stamp), "states": states}
                    )
                except Exception as error:
                    state.dirty.update(batch)
                    self._failed(state, "report", error)
                    await self._pause(state)
                    continue
                state.reports += len(batch)
                self._recovered(state)

    async def _pause(self, state: _Member) -> None:
        with trio.move_on_after(state.retry.failed()):
            await state.retry_now.wait()
        if state.retry_now.is_set():  # two tasks may wait on it (reports and the watcher)
            state.retry_now = trio.Event()

    def _failed(self, state: _Member, what: str, error: Exception) -> None:
        state.failures += 1  # a 503 about the member (peers.MEMBER_DOWN_CODES) made peers take it for down
        if isinstance(error, ProtocolError):
            cause = f"{what}: {error.status} {error.code}"
        else:
            cause = f"{what}: {type(error).__name__}"
        if self._failing.failed(state.member.id, (state.member.id, cause)):
            if not isinstance(error, ProtocolError):
                log.error("subscriptions: %s to member %r failed", what, state.member.id, exc_info=error)
            elif what == "hello" and error.status == 503:
                log.info(
                    "subscriptions: member %r is not up yet (%s); greeting it again soon",
                    state.member.id,
                    error.message,
                )
            else:
                log.warning(
                    "subscriptions: %s to member %r failed (%s); retrying with backoff, further failures "
                    "are counted in /stats",
                    what,
                    state.member.id,
                    error.message,
                )

    def _recovered(self, state: _Member) -> None:
        state.retry.reset()
        self.peers.down.answered(state.member.id)
        told = self._failing.cleared(state.member.id)
        if told is not None:
            log.info(
                "subscriptions: member %r answers again (it failed with %s)", state.member.id, told[0][1]
            )

    # ---- greetings ---------------------------------------------------------------------------

    def _hello(self, member_id: str) -> dict[str, Any]:
        """All our subscriptions, and the paths we follow on `member_id`."""
        followed = (path for sub in self.manager.subs.values() for path in sub.links)
        return {
            "stamp": list(self._stamp()),
            "interests": {sub_id: interest.to_wire() for sub_id, interest in self._mine.items()},
            "paths": self.view.known_of(member_id, followed),
        }

    def _take_hello(self, state: _Member, said: dict[str, Any]) -> None:
        """`state.member`'s subscriptions replace what we knew of them, and everything they follow
        here is reported again."""
        interests = {sub_id: Interest.from_wire(raw) for sub_id, raw in said["interests"].items()}
        self.interests.replace(state.member.id, tuple(said["stamp"]), interests)
        storage = self.supervisor.storage
        for path in storage.names():
            if self.interests.matches(state.member.id, path):
                state.dirty.add(path)
        for path in said.get("paths", []):
            if isinstance(path, str) and self.placement.owner(path).id == self.me:
                state.dirty.add(path)  # gone ones too: it may follow a stream deleted meanwhile
        state.greeted = True
        state.poke()

    async def _on_hello(self, caller: str, payload: dict[str, Any]) -> dict[str, Any]:
        state = self._members.get(caller)
        if state is None:
            raise ProtocolError(400, "bad_cluster_call", f"{caller!r} is not another member")
        answer = self._hello(caller)
        try:
            self._take_hello(state, payload)
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise ProtocolError(400, "bad_cluster_call", f"a bad hello: {error}") from None
        state.retry.reset()
        self.peers.down.answered(caller)
        state.retry_now.set()  # it is back: what failed to reach it goes now
        return answer

    # ---- this member's subscriptions ---------------------------------------------------------

    async def announce(self, sub: Subscription, extra: tuple[str, ...] = ()) -> None:
        down = next((state for state in self._members.values() if self._down(state)), None)
        if down is not None:
            # Known to be failing: refused at once, nobody told (a hung member must not cost every
            # creation 5 s); a probe finds out when it answers again.
            raise _unavailable(PeerUnavailable(down.member, KNOWN_DOWN))
        failed = await self._tell_all(sub, extra)
        if failed:
            if not sub.deleted and self.manager.subs.get(sub.id) is not sub:
                self.forget(sub)  # a creation that fails: the members that heard of it forget it
            raise _unavailable(failed[0])

    async def catch_up(self, sub: Subscription) -> None:
        # The same question as at creation (its answer: every matching stream's state now); a
        # member that does not answer, or is known to be failing, is left as it was last heard of.
        await self._tell_all(sub)

    async def _tell_all(self, sub: Subscription, extra: tuple[str, ...] = ()) -> list[ProtocolError]:
        """Tells every member what `sub` follows and takes their matching streams' states; the
        refusals of those that did not answer."""
        if sub.deleted:
            # Deleted before we got here (its `forget` is done): telling now would put it back in
            # `_mine` and on the other members with a stamp newer than its tombstone.
            return []
        interest = interest_of(sub, extra)
        told = self._mine.get(sub.id)
        if told is not None and not told.streams <= interest.streams:
            # Never fewer paths than told before: a catch-up or an announcement overtaking
            # another one in flight (with other added streams) must not drop those.
            interest = Interest(interest.pattern, interest.wake_stream, interest.streams | told.streams)
        self._mine[sub.id] = interest
        stamp = list(self._stamp())
        failed: list[ProtocolError] = []

        async def tell(state: _Member) -> None:
            payload = {"stamp": stamp, "sub": sub.id, "interest": interest.to_wire()}
            try:
                answer = await self._ask(state.member, "sub.interest", payload)
                self._apply(state.member.id, answer)
            except ProtocolError as error:
                failed.append(error)

        async with trio.open_nursery() as nursery:
            for state in self._members.values():
                nursery.start_soon(tell, state)
        if sub.deleted and self._mine.get(sub.id) is interest:
            self.forget(sub)  # deleted without its forget undoing what this call wrote
        return failed

    def forget(self, sub: Subscription) -> None:
        self._mine.pop(sub.id, None)
        if self._nursery is None:
            return
        payload = {"stamp": list(self._stamp()), "sub": sub.id, "interest": None}
        for state in self._members.values():
            # Best effort: a member that misses it only tells us about streams nobody follows,
            # until it next greets us (the hello carries every subscription there is).
            self._nursery.start_soon(self._tell_quietly, state, "sub.interest", payload)

    async def _tell_quietly(self, state: _Member, op: str, payload: dict[str, Any]) -> None:
        try:
            await self._ask(state.member, op, payload, fail_fast=False)  # nobody waits for it
        except ProtocolError:
            state.failures += 1

    async def refresh(self, sub: Subscription, acks: list[tuple[str, int]]) -> None:
        wanted: dict[str, list[str]] = {}
        for path, position in acks:
            owner = self.placement.owner(path)
            if owner.id == self.me:
                continue
            known = self.view.known.get(path)
            if known is not None and position <= known.published_tail:
                continue
            wanted.setdefault(owner.id, []).append(path)
        for member_id, paths in wanted.items():
            member = self.placement.member(member_id)
            self._apply(member_id, await self._ask(member, "sub.states", {"paths": paths}))

    def elsewhere(self, path: str) -> bool:
        return self.placement.owner(path).id != self.me

    async def append_wake(self, path: str, body: bytes) -> bool:
        owner = self.placement.owner(path)
        if owner.id == self.me:
            return False
        await self._ask(owner, "sub.wake", {"path": path, "body": body})
        return True

    async def _ask(
        self, member: Member, op: str, payload: dict[str, Any], *, fail_fast: bool = True
    ) -> dict[str, Any]:
        """A call a client's request waits for: a member that does not answer soon is unavailable,
        and one known to be failing is not asked at all (`fail_fast`)."""
        state = self._members.get(member.id)
        if fail_fast and state is not None and self._down(state):
            raise PeerUnavailable(member, KNOWN_DOWN)
        with trio.move_on_after(ASK_TIMEOUT_S):
            return await self.peers.call(member, op, payload)  # which tells peers how it went
        slow = PeerUnavailable(member, f"no answer within {ASK_TIMEOUT_S:g} s")
        self.peers.down.mark(member.id, slow.message)
        raise slow

    def _failing_with(self, member_id: str) -> str | None:
        cause = self._failing.current.get(member_id)
        return None if cause is None else cause[1]

    def _down(self, state: _Member) -> bool:
        return self.peers.down.why(state.member.id) is not None

    def _apply(self, member_id: str, said: dict[str, Any]) -> None:
        """A member's report on its streams: what changed is noticed by the subscriptions."""
        stamp = said.get("stamp")
        states = said.get("states")
        if not isinstance(stamp, list) or len(stamp) != 2 or not isinstance(states, dict):
            raise ProtocolError(400, "bad_cluster_call", "a report is {stamp, states}")
        at: Stamp = (int(stamp[0]), int(stamp[1]))
        for path, state in states.items():
            try:
                changed = self.view.apply(member_id, at, path, state)
            except (TypeError, ValueError):
                continue  # a malformed state: counted nowhere, changes nothing
            if changed:
                self.manager.stream_changed(path)

    # ---- what the other members ask ----------------------------------------------------------

    async def _on_interest(self, caller: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            stamp = tuple(payload["stamp"])
            sub_id = payload["sub"]
            raw = payload["interest"]
            interest = None if raw is None else Interest.from_wire(raw)
        except (KeyError, TypeError, ValueError) as error:
            raise ProtocolError(400, "bad_cluster_call", f"a bad interest: {error}") from None
        self.interests.update(caller, stamp, sub_id, interest)
        if interest is None:
            return {}
        storage = self.supervisor.storage
        paths = {path for path in storage.names() if interest.matches(path)}
        paths.update(path for path in interest.streams if self.placement.owner(path).id == self.me)
        # Read at the same instant as the interest was taken: every later change is reported.
        return {"stamp": list(self._stamp()), "states": {path: state_of(storage, path) for path in paths}}

    async def _on_changed(self, caller: str, payload: dict[str, Any]) -> dict[str, Any]:
        self._apply(caller, payload)
        return {}

    async def _on_states(self, caller: str, payload: dict[str, Any]) -> dict[str, Any]:
        paths = payload.get("paths")
        if not isinstance(paths, list):
            raise ProtocolError(400, "bad_cluster_call", "paths is a list")
        storage = self.supervisor.storage
        mine = [path for path in paths if isinstance(path, str) and self.placement.owner(path).id == self.me]
        return {"stamp": list(self._stamp()), "states": {path: state_of(storage, path) for path in mine}}

    async def _on_wake(self, caller: str, payload: dict[str, Any]) -> dict[str, Any]:
        path, body = payload.get("path"), payload.get("body")
        if not isinstance(path, str) or not isinstance(body, bytes):
            raise ProtocolError(400, "bad_cluster_call", "a wake is {path, body}")
        if self.placement.owner(path).id != self.me:
            raise ProtocolError(
                503, "stale_placement", f"{path!r} is not this member's", [("Retry-After", "1")]
            )
        await append_wake_event(self.supervisor, path, body)
        return {}

    # ---- control requests --------------------------------------------------------------------

    async def route(self, request: Request) -> Response | None:
        rest = request.raw_path[len(CONTROL_PREFIX) :]
        if not rest.startswith("subscriptions/"):
            return None  # the JWKS: the same on every member
        sub_id = unquote(rest.split("/", 2)[1])
        try:
            check_id(sub_id)
            by = forwarded_by(request, self.secret, self.placement.members)
        except ProtocolError as error:
            return None if error.status == 400 else error_response(error)  # a bad id: the API says so
        owner = subscription_owner(self.placement, sub_id)
        if owner.id == self.me:
            return None  # the service restored a forwarded request's Host (forward.as_the_client_sent)
        if by is not None or self.forwarder is None:
            return error_response(
                ProtocolError(
                    503,
                    "stale_placement",
                    f"subscription {sub_id!r} belongs to member {owner.id!r}, which sent it here",
                    [("Retry-After", "1")],
                )
            )
        self.forwarded += 1
        try:
            return await self.forwarder.forward(request, owner)
        except ProtocolError as error:
            return error_response(error)

    # ---- /stats ------------------------------------------------------------------------------

    def stats(self) -> dict:
        return {
            **self.view.stats(),
            "followed_for_members": self.interests.count(),
            "forwarded_requests": self.forwarded,
            "members": {
                member_id: {
                    "greeted": state.greeted,
                    "to_report": len(state.dirty),
                    "reported": state.reports,
                    "failures": state.failures,
                    "failing": self._failing_with(member_id),
                    # why calls clients wait for are refused at once, while they are
                    "down": self.peers.down.why(member_id),
                }
                for member_id, state in self._members.items()
            },
        }


def interest_of(sub: Subscription, extra: tuple[str, ...] = ()) -> Interest:
    explicit = {path for path, link in sub.links.items() if link.explicit}
    return Interest(sub.config.pattern, sub.config.wake_stream, {*sub.config.streams, *explicit, *extra})


def _unavailable(error: ProtocolError) -> ProtocolError:
    return ProtocolError(
        503,
        "member_unavailable",
        f"a subscription follows streams on every cluster member, and one did not answer "
        f"({error.message}); retry shortly",
        [("Retry-After", "1")],
    )
