"""What a stream's actor does to its stream: create, append, read, head, delete, compact, and the
fork messages a source takes (their bookkeeping is in actors/forking.py).

Because a single task applies every create, append, close and delete of its stream, sequencing
and producer checks need no locks. Readers get snapshots plus an event that fires at the next
change, so live readers wait without holding the actor. `append`, `read` and `head` also have a
form that never awaits (`*_now`), which the actor may run in the caller's task (`NOW`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from streamkeep.actors import forking
from streamkeep.actors.folding import append_snapshot
from streamkeep.actors.host import StreamHost
from streamkeep.actors.mailbox import NotNow
from streamkeep.actors.messages import (
    Append,
    Ask,
    AttachFork,
    Compact,
    Create,
    Delete,
    DetachFork,
    Head,
    RaisePin,
    Read,
)
from streamkeep.actors.replies import PendingAppend, ReadPlan, Snapshot, StreamView
from streamkeep.protocol import offsets
from streamkeep.protocol import stream as rules
from streamkeep.protocol.errors import ProtocolError, bad_request, not_found
from streamkeep.protocol.stream import AppendOutcome, AppendSpec, ForkSource
from streamkeep.storage import forks
from streamkeep.storage.base import AppendRecord, StreamLog
from streamkeep.storage.errors import StorageUnavailable, below_floor

log = logging.getLogger(__name__)


class StreamOps:
    """One stream's operations, run by its actor (actors/actor.py) one message at a time."""

    def __init__(self, name: str, host: StreamHost) -> None:
        self.name = name
        self._host = host
        self._storage = host.storage
        # Fired at the next published change; made when a reader first asks for it, since most
        # appends have no live reader waiting (a trio.Event per append cost ~1 us).
        self._changed: trio.Event | None = None

    def settled(self) -> bool:
        """Whether no commit of the stream is in flight (an actor with one must not hibernate)."""
        stream_log = self._storage.open(self.name)
        return stream_log is None or stream_log.pending == 0

    def hibernated(self) -> None:
        """The actor ended: storage may give back what only an active stream needs."""
        self._storage.idle(self.name)

    # ---- handlers ----------------------------------------------------------------------

    async def create(self, message: Create) -> tuple[int, StreamView]:
        spec = message.spec
        now = time.time()
        self._refuse_soft_deleted_path()
        try:
            existing = await self._existing(now)
        except ProtocolError:
            existing = None
            # It may have expired just now, and been soft-deleted because forks still read it.
            self._refuse_soft_deleted_path()
        if existing is not None:
            if not spec.matches(existing.meta):
                raise ProtocolError(
                    409,
                    "stream_exists",
                    "the stream exists with another content type, TTL, expiry, closed state or fork source",
                )
            return 200, self._view(existing)
        try:
            if spec.fork is None:
                meta = spec.new_meta(self.name, uuid.uuid4().hex[:12], now)
                created = await self._storage.create(meta, spec.messages)
            else:
                created = await forking.create_fork(self._host, self.name, spec, now)
        except StorageUnavailable as error:
            if error.happened:  # created, if not durably: listeners hear of it all the same
                self._notify()
                if self._host.lifecycle is not None:
                    self._host.lifecycle.unsure()
            raise
        created.on_publish = self._notify
        self._notify()
        if self._host.lifecycle is not None:
            await self._host.lifecycle.created(created.meta)
        return 201, self._view(created)

    async def append(self, message: Append) -> PendingAppend:
        now = time.time()
        return self._plan_append(await self._existing(now), message.spec, now)

    def append_now(self, message: Append) -> PendingAppend:
        now = time.time()
        return self._plan_append(self._existing_now(now), message.spec, now)

    async def read(self, message: Read) -> ReadPlan:
        """Validates `start` (an offset, or "-1"/"now") against the published stream."""
        now = time.time()
        return self._plan_read(await self._existing(now), message.start, message.touch, now)

    def read_now(self, message: Read) -> ReadPlan:
        now = time.time()
        return self._plan_read(self._existing_now(now), message.start, message.touch, now)

    async def head(self, message: Head) -> StreamView:
        return self._view(await self._existing(time.time()))

    def head_now(self, message: Head) -> StreamView:
        return self._view(self._existing_now(time.time()))

    async def delete(self, message: Delete) -> None:
        await self._remove(await self._existing(time.time()))

    async def compact(self, message: Compact) -> Snapshot:
        return await append_snapshot(self._storage, self.name, await self._existing(time.time()), message)

    async def attach_fork(self, message: AttachFork) -> ForkSource:
        forking.check_source(self.name, self._storage.open(self.name))
        try:
            source = await self._existing(time.time())
        except ProtocolError as error:
            if error.code == "stream_deleted":  # it expired just now, forks keep it: as check_source says
                forking.check_source(self.name, self._storage.open(self.name))
            raise
        return await forking.attach(self._storage, self.name, source, message)

    async def detach_fork(self, message: DetachFork) -> None:
        stream_log = self._storage.open(self.name)
        if stream_log is not None and await forking.count_out(
            self._storage, self.name, stream_log, message.pin
        ):
            await self._hard_delete(stream_log)

    async def raise_pin(self, message: RaisePin) -> None:
        stream_log = self._storage.open(self.name)
        if stream_log is not None:
            await forking.raise_pin(self._storage, self.name, stream_log, message.pin, message.low)

    # ---- planning ----------------------------------------------------------------------

    def _plan_append(self, stream_log: StreamLog, spec: AppendSpec, now: float) -> PendingAppend:
        stream_log.meta.last_access = now
        state = rules.StreamState(stream_log.meta, stream_log.producers, stream_log.tail)
        try:
            plan = rules.plan_append(state, spec)
        except ProtocolError as error:
            if not (stream_log.meta.closed and not stream_log.published_closed):
                raise
            # "Stream closed" about a close still being written: the close may yet fail and be
            # taken back (a full disk), and then the stream was never closed. Answer once the
            # close is durable; if it fails, this append fails with it (a 503 to retry).
            outcome = AppendOutcome(409, state.tail, True)
            return PendingAppend(
                stream_log.latest_commit(), outcome, stream_log.meta.incarnation, self.name, error
            )
        if isinstance(plan, AppendOutcome):
            # A duplicate or an idempotent close: answer once what it repeats is durable.
            return PendingAppend(stream_log.latest_commit(), plan, stream_log.meta.incarnation, self.name)
        candidate = rules.StreamState(
            rules.copy_meta(stream_log.meta), dict(stream_log.producers), state.tail
        )
        outcome = rules.apply_append(candidate, plan, state.tail + sum(len(m) for m in plan.messages))
        producer = (
            (plan.producer_id, plan.producer_state)
            if plan.producer_id is not None and plan.producer_state is not None
            else None
        )
        record = AppendRecord(plan.messages, candidate.meta, producer, plan.close, plan.stream_seq)
        commit = stream_log.submit(record)
        return PendingAppend(commit, outcome, stream_log.meta.incarnation, self.name)

    def _plan_read(
        self, stream_log: StreamLog, start: offsets.Offset | str, touch: bool, now: float
    ) -> ReadPlan:
        if touch:
            stream_log.meta.last_access = now
        view = self._view(stream_log)
        if start == "now":
            position = view.tail
        elif start == "-1":
            position = view.floor  # the earliest data kept
        else:
            assert isinstance(start, offsets.Offset)
            position = start.position
            if position > view.tail:
                raise bad_request("offset_out_of_range", "offset is past the end of the stream")
            forking.check_incarnation(self._storage, self.name, stream_log, start.incarnation)
            if position < view.floor:
                raise below_floor(view.floor, view.meta.incarnation)
            if view.meta.json_mode and not forks.is_boundary(self._storage, stream_log, position):
                raise bad_request("invalid_offset", "offset is not at a message boundary of this JSON stream")
        if self._changed is None:
            self._changed = trio.Event()
        return ReadPlan(view, position, stream_log, self._changed)

    # ---- the stream's state --------------------------------------------------------------

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        for listener in self._host.listeners:
            try:
                listener(self.name)
            except Exception:  # a listener's bug must not fail the stream's own operation
                log.exception("stream %r: a change listener failed", self.name)

    async def _tell_deleted(self) -> None:
        if self._host.lifecycle is not None:
            await self._host.lifecycle.deleted(self.name)

    def _view(self, stream_log: StreamLog) -> StreamView:
        meta = rules.copy_meta(stream_log.meta)
        meta.closed = stream_log.published_closed
        return StreamView(meta, stream_log.published_tail, forks.readable_from(self._storage, stream_log))

    async def _existing(self, now: float) -> StreamLog:
        stream_log = self._storage.open(self.name)
        if stream_log is not None and not stream_log.meta.soft_deleted and stream_log.meta.expired(now):
            log.info("stream %r expired", self.name)
            await self._remove(stream_log)
            if stream_log.meta.soft_deleted:  # forks read it: 410, as every later request hears
                raise _gone(self.name)
            raise not_found(self.name)
        return self._existing_now(now)

    def _existing_now(self, now: float) -> StreamLog:
        """The stream, for a handler that cannot await: `NotNow` if it expired (removing it awaits)."""
        stream_log = self._storage.open(self.name)
        if stream_log is None:
            raise not_found(self.name)
        if stream_log.meta.soft_deleted:
            raise _gone(self.name)
        if stream_log.meta.expired(now):
            raise NotNow
        stream_log.on_publish = self._notify
        return stream_log

    def _refuse_soft_deleted_path(self) -> None:
        current = self._storage.open(self.name)
        if current is not None and current.meta.soft_deleted:
            raise ProtocolError(
                409,
                "stream_soft_deleted",
                "this path belonged to a stream that was deleted while forks still read it; "
                "it can be reused once those forks are deleted",
            )

    async def _remove(self, stream_log: StreamLog) -> None:
        """Deletes the stream, or only soft-deletes it while forks still read its data (§4.2)."""
        # Its forks are all counted only once every stream is read (a start that served early):
        # with forks known it is soft-deleted as ever (the count only grows), without, it may
        # have forks not read yet, so the answer is 503 with Retry-After rather than a wait
        # here, which would hold every other request to the stream.
        if stream_log.meta.fork_count == 0 and self._storage.unread():
            raise self._storage.still_reading()
        if stream_log.meta.fork_count > 0:
            stream_log.meta.soft_deleted = True
            try:
                await self._storage.save_meta(self.name, stream_log.meta)
            except BaseException as error:
                if not getattr(error, "happened", False):  # else it is soft-deleted, if not durably
                    stream_log.meta.soft_deleted = False
                    raise
                self._notify()
                await self._tell_deleted()
                raise
            self._notify()
            await self._tell_deleted()  # gone for clients: forks only read what it held
            return
        await self._hard_delete(stream_log)

    async def _hard_delete(self, stream_log: StreamLog) -> None:
        uncertain = None
        try:
            await self._storage.delete(self.name)
        except StorageUnavailable as error:
            if not error.happened:
                raise
            uncertain = error  # it is deleted, if not durably: the rest of a delete still follows
        stream_log.on_publish = None
        self._notify()
        await self._tell_deleted()
        source = stream_log.meta.forked_from
        if source is not None:
            # Sources never call their forks, so this call up the chain cannot deadlock.
            with trio.CancelScope(shield=True):
                try:
                    await forking.detach_from(self._host, source, stream_log.meta.stream_id)
                except ProtocolError as error:
                    # Another member's source that cannot be told now keeps its pin until its
                    # reconcile finds this fork gone (streamkeep/cluster/forks.py).
                    log.warning("fork %r: its source %r was not told: %s", self.name, source, error.message)
        if uncertain is not None:
            raise uncertain


def _gone(name: str) -> ProtocolError:
    return ProtocolError(
        410, "stream_deleted", f"stream {name!r} was deleted; only its forks still read its data"
    )


# The handler of each message, run in the actor's task.
HANDLERS: dict[type[Ask[Any]], Callable[[StreamOps, Any], Awaitable[Any]]] = {
    Create: StreamOps.create,
    Append: StreamOps.append,
    Read: StreamOps.read,
    Head: StreamOps.head,
    Delete: StreamOps.delete,
    Compact: StreamOps.compact,
    AttachFork: StreamOps.attach_fork,
    DetachFork: StreamOps.detach_fork,
    RaisePin: StreamOps.raise_pin,
}

# The handlers that can run to the end without awaiting, and so in the caller's task (call_now).
NOW: dict[type[Ask[Any]], Callable[[StreamOps, Any], Any]] = {
    Append: StreamOps.append_now,
    Read: StreamOps.read_now,
    Head: StreamOps.head_now,
}
