"""Forks whose source another cluster member owns.

A fork lives on the member its own name hashes to; its source may live on another. Nothing is
copied then either: the fork's member reads the inherited range from the source's member
(`fork.read`, which follows the rest of the chain itself), and the source keeps that range for
the fork for as long as the fork exists. The order makes a crash at any point safe:

1. **Pin first, durably, on the source.** `fork.attach` runs the source actor's `attach_fork`
   (the same checks as a local fork: offset, boundary, sub-offset), makes the fork point durable
   and saves a pin `(fork stream id, fork name, lowest position)` in the source's meta.cbor. A
   pinned source counts the fork: it is only soft-deleted while the fork lives, and retention
   keeps everything from the pin's position up.
2. **Then the fork is created** on its own member. While that runs the fork's stream id is in
   `attaching`, so a reconcile asking about the pin hears "pending".
3. **A deleted fork detaches** (`fork.detach` removes the pin; the last one out removes a
   soft-deleted source, and a source that was itself a fork detaches in turn: the cascade).

If the fork's member dies between 1 and 2, or a detach cannot reach the source's member, the pin
outlives its fork. Each member therefore **reconciles** its pins at start and every few minutes:
it asks each fork's member whether the fork with that stream id exists (`fork.exists`) and drops
the pins of those that answer "absent". Never "unreachable": a pin goes only on a definite
answer, so a fork's data is never freed under it; at worst it is held a little longer (a leak
that the next reconcile ends).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import trio

from streamkeep.actors.messages import AttachFork, DetachFork, RaisePin
from streamkeep.actors.supervisor import Supervisor
from streamkeep.background import Backoff
from streamkeep.cluster.peers import PeerOps, Peers, PeerUnavailable
from streamkeep.cluster.placement import Member
from streamkeep.health import Health
from streamkeep.protocol import offsets
from streamkeep.protocol.errors import ProtocolError, bad_request
from streamkeep.protocol.stream import ForkSource, ForkSpec
from streamkeep.storage import forks
from streamkeep.storage.base import ReadResult
from streamkeep.storage.errors import STORAGE_ERRORS, RetainedAway, as_protocol_error

log = logging.getLogger(__name__)

PRESENT, ABSENT, PENDING, UNKNOWN = "present", "absent", "pending", "unknown"
DETACH_SECONDS = 3.0
RETRY_FIRST = 5.0  # seconds until a reconcile that missed a member tries again (then doubling)


class RemoteForks:
    """Both sides of cross-member forks for one member: `storage.remote` for its forks, and the
    `fork.*` operations it answers for forks of its own streams."""

    def __init__(self, peers: Peers, supervisor: Supervisor, *, reconcile_interval: float = 300.0) -> None:
        self.peers = peers
        self.supervisor = supervisor
        self.storage = supervisor.storage
        self.reconcile_interval = reconcile_interval
        self.health = Health()
        self._attaching: set[str] = set()
        self._missed = False  # the last reconcile could not settle every pin
        self.remote_reads = 0  # inherited ranges this member's forks read from another member
        self.attached = 0  # forks other members made of this member's streams
        self.pins_dropped = 0
        self.reconciles = 0

    # ---- the fork's side: reaching a source on another member (storage.base.RemoteSources) ----

    def elsewhere(self, name: str) -> bool:
        return self.peers.elsewhere(name) is not None

    def _owner(self, name: str) -> Member:
        return self.peers.placement.owner(name)

    async def read_range(
        self, name: str, start: int, max_bytes: int, *, whole_messages: bool, limit: int
    ) -> ReadResult:
        payload = {"source": name, "start": start, "max": max_bytes, "whole": whole_messages, "limit": limit}
        try:
            answer = await self.peers.call(self._owner(name), "fork.read", payload)
        except ProtocolError as error:
            if error.code == "retained_away":
                raise RetainedAway(0, 0) from None  # the reader's floor is worked out on its side
            raise
        self.remote_reads += 1
        return ReadResult([bytes(m) for m in answer["messages"]], int(answer["next"]))

    async def probe(self, name: str, position: int) -> tuple[bool, int | None]:
        answer = await self.peers.call(
            self._owner(name), "fork.probe", {"source": name, "position": position}
        )
        end = answer["end"]
        return bool(answer["boundary"]), None if end is None else int(end)

    async def attach(
        self, fork: ForkSpec, content_type: str | None, *, fork_name: str, pin: str
    ) -> ForkSource:
        payload = {
            "source": fork.source,
            "offset": fork.offset_token,
            "sub_offset": fork.sub_offset,
            "content_type": content_type,
            "fork": fork_name,
            "pin": pin,
        }
        answer = await self.peers.call(self._owner(fork.source), "fork.attach", payload)
        return ForkSource(
            answer["content_type"],
            answer["ttl"],
            answer["expires_at"],
            answer["expires_at_ts"],
            int(answer["base"]),
            int(answer["low"]),
            tuple(int(i) for i in answer["incarnations"]),
        )

    async def detach(self, source: str, pin: str) -> None:
        """Bounded: callers shield it (a delete must finish), and a detach that does not arrive
        is repaired by the source member's reconcile, so nobody waits on a hung member for long."""
        owner = self._owner(source)
        with trio.move_on_after(DETACH_SECONDS):
            await self.peers.call(owner, "fork.detach", {"source": source, "pin": pin})
            return
        raise PeerUnavailable(owner, f"no answer within {DETACH_SECONDS:g} s")

    @contextmanager
    def attaching(self, pin: str) -> Iterator[None]:
        self._attaching.add(pin)
        try:
            yield
        finally:
            self._attaching.discard(pin)

    # ---- the source's side: what this member answers ------------------------------------------

    def register(self, ops: PeerOps) -> None:
        ops.register("fork.read", self._answer_read)
        ops.register("fork.probe", self._answer_probe)
        ops.register("fork.attach", self._answer_attach)
        ops.register("fork.detach", self._answer_detach)
        ops.register("fork.exists", self._answer_exists)

    def _check_mine(self, name: str) -> None:
        if self.peers.elsewhere(name) is not None:
            raise ProtocolError(
                503, "stale_placement", f"{name!r} is not this member's stream", [("Retry-After", "1")]
            )

    def _source_log(self, payload: dict[str, Any]) -> Any:
        name = _text(payload, "source")
        self._check_mine(name)
        stream_log = self.storage.open(name)  # soft-deleted included: forks still read it
        if stream_log is None:
            raise ProtocolError(
                503, "fork_source_missing", f"the source {name!r} of a fork is missing; see the startup log"
            )
        return stream_log

    async def _answer_read(self, _caller: str, payload: dict[str, Any]) -> dict[str, Any]:
        stream_log = self._source_log(payload)
        start, limit = _position(payload, "start"), _position(payload, "limit")
        whole = bool(payload.get("whole"))
        if whole and start < limit and not forks.is_boundary(self.storage, stream_log, start):
            raise bad_request("invalid_offset", "offset is not at a message boundary of this JSON stream")
        try:
            result = await forks.read_range(
                self.storage, stream_log, start, _position(payload, "max"), whole_messages=whole, limit=limit
            )
        except RetainedAway:
            raise ProtocolError(410, "retained_away", "the source dropped that range") from None
        except STORAGE_ERRORS as error:
            raise as_protocol_error(error, stream_log.meta.name) from None
        return {"messages": result.messages, "next": result.next_position}

    async def _answer_probe(self, _caller: str, payload: dict[str, Any]) -> dict[str, Any]:
        boundary, end = await forks.probe(
            self.storage, self._source_log(payload), _position(payload, "position")
        )
        return {"boundary": boundary, "end": end}

    async def _answer_attach(self, _caller: str, payload: dict[str, Any]) -> dict[str, Any]:
        token = payload.get("offset")
        if token is not None and not isinstance(token, str):
            raise bad_request("bad_cluster_call", "offset must be text")
        spec = ForkSpec(
            source=_text(payload, "source"),
            offset_token=token,
            offset=None if token is None else offsets.decode(token),
            sub_offset=_position(payload, "sub_offset"),
        )
        content_type = payload.get("content_type")
        pin = (_text(payload, "pin"), _text(payload, "fork"))
        self._check_mine(spec.source)
        source: ForkSource = await self.supervisor.call(spec.source, AttachFork(spec, content_type, pin))
        self.attached += 1
        return {
            "content_type": source.content_type,
            "ttl": source.ttl_seconds,
            "expires_at": source.expires_at,
            "expires_at_ts": source.expires_at_ts,
            "base": source.base,
            "low": source.low,
            "incarnations": list(source.incarnations),
        }

    async def _answer_detach(self, _caller: str, payload: dict[str, Any]) -> dict[str, Any]:
        name = _text(payload, "source")
        if self.storage.open(name) is not None:
            await self.supervisor.call(name, DetachFork(_text(payload, "pin")))
        return {}

    async def _answer_exists(self, _caller: str, payload: dict[str, Any]) -> dict[str, Any]:
        asked = payload.get("forks")
        if not isinstance(asked, list):
            raise bad_request("bad_cluster_call", "forks must be a list of [name, stream id]")
        answers = [self._state(str(name), str(pin)) for name, pin in asked]
        return {"states": [state for state, _ in answers], "lows": [low for _, low in answers]}

    def _state(self, name: str, pin: str) -> tuple[str, int]:
        """What this member knows of fork `name` with stream id `pin`, and the lowest position it
        reads (its pin on the source may rise to it)."""
        if pin in self._attaching:
            return PENDING, 0
        stream_log = self.storage.open(name)
        if stream_log is not None:
            if stream_log.meta.stream_id != pin:
                return ABSENT, 0  # deleted, and the name made again: another stream
            return PRESENT, forks.readable_from(self.storage, stream_log)
        directory = getattr(self.storage, "directory", None)
        if directory is not None and directory.fs.exists(directory.stream_dir(name)):
            return UNKNOWN, 0  # on disk but not loaded (recovery skipped it): it may come back
        return ABSENT, 0

    # ---- reconcile: pins whose fork is gone ------------------------------------------------------

    async def run(self) -> None:
        """Reconciles at start and every `reconcile_interval`; an unreachable member is retried
        on the next round (logged once, counted in /stats), never taken as "absent"."""
        retry = Backoff(RETRY_FIRST, self.reconcile_interval, jitter=0)
        await self.storage.recovered()  # every source's pins, not those read so far
        while True:
            await self.reconcile_once()
            if self._missed:  # a member did not answer, or a pin could not go: again soon, backing off
                await trio.sleep(retry.failed())
            else:
                retry.reset()
                await trio.sleep(self.reconcile_interval)

    async def reconcile_once(self) -> int:
        """Drops the pins whose fork its member says is gone; returns how many."""
        by_member: dict[str, list[tuple[str, str, str]]] = {}
        for name in self.storage.names():
            stream_log = self.storage.open(name)
            if stream_log is None:
                continue
            for pin, fork_name, _low in stream_log.meta.remote_forks:
                by_member.setdefault(self._owner(fork_name).id, []).append((name, fork_name, pin))
        dropped = 0
        self._missed = False
        for member_id, pins in by_member.items():
            if member_id == self.peers.member:
                answers = [self._state(fork_name, pin) for _, fork_name, pin in pins]
            else:
                try:
                    answer = await self.peers.call(
                        self.peers.member_of(member_id),
                        "fork.exists",
                        {"forks": [[f, p] for _, f, p in pins]},
                    )
                    answers = list(
                        zip((str(s) for s in answer["states"]), (int(n) for n in answer["lows"]), strict=True)
                    )
                except ProtocolError as error:
                    self.health.failed(f"fork pin reconcile with {member_id}", error.message)
                    self._missed = True
                    continue
                self.health.ok(f"fork pin reconcile with {member_id}")
            for (source, fork_name, pin), (state, low) in zip(pins, answers, strict=True):
                if state == PRESENT:
                    try:  # its own retention may have moved on: hold no more than it reads
                        await self.supervisor.call(source, RaisePin(pin, low))
                    except ProtocolError as error:
                        self.health.failed("fork pin reconcile", f"{source}: {error.message}")
                    continue
                if state == UNKNOWN:
                    self._missed = True
                if state != ABSENT:
                    continue
                try:
                    await self.supervisor.call(source, DetachFork(pin))
                except ProtocolError as error:
                    self.health.failed("fork pin reconcile", f"{source}: {error.message}")
                    self._missed = True
                    continue
                dropped += 1
                log.warning(
                    "cluster: fork %r of %r is gone; dropped its pin on the source", fork_name, source
                )
        self.pins_dropped += dropped
        self.reconciles += 1
        return dropped

    def stats(self) -> dict[str, object]:
        return {
            "remote_reads": self.remote_reads,
            "attached": self.attached,
            "pins": sum(len(log.meta.remote_forks) for log in self.storage.logs()),
            "pins_dropped": self.pins_dropped,
            "reconciles": self.reconciles,
            **self.health.stats(),
        }


def _text(payload: dict[str, Any], key: str) -> str:
    value = payload.get(key)
    if not isinstance(value, str):
        raise bad_request("bad_cluster_call", f"{key} must be text")
    return value


def _position(payload: dict[str, Any], key: str) -> int:
    value = payload.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise bad_request("bad_cluster_call", f"{key} must be a whole number")
    return value
