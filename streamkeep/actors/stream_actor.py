"""The actor that owns one stream: every change to it happens here, one message at a time.

Because a single task applies every create, append, close and delete of its stream, sequencing
and producer checks need no locks. Readers get snapshots plus an event that fires at the next
change, so live readers wait without holding the actor. The actor hibernates (its task ends)
after a quiet spell with no live readers; the supervisor starts a fresh one on the next request.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import trio

from streamkeep.actors.mailbox import ActorGone, Message, NotNow, Reply
from streamkeep.protocol import offsets
from streamkeep.protocol import stream as rules
from streamkeep.protocol.errors import ProtocolError, bad_request, not_found
from streamkeep.protocol.headers import media_type
from streamkeep.protocol.state_fold import NotStateMessage, StateFold
from streamkeep.protocol.stream import AppendOutcome, AppendSpec, CreateSpec, ForkSource, ForkSpec, StreamMeta
from streamkeep.storage import forks
from streamkeep.storage.base import AppendRecord, Commit, Storage, StreamLog
from streamkeep.storage.errors import STORAGE_ERRORS, StorageUnavailable, as_protocol_error, below_floor

log = logging.getLogger(__name__)


@dataclass(slots=True)  # not frozen: built per request, where frozen's __init__ costs ~1 us
class StreamView:
    """A stream's published state at one moment, for a response built after the actor moved on."""

    meta: StreamMeta
    tail: int
    floor: int = 0  # the earliest position readers may ask for (retention moves it up)


@dataclass(slots=True)  # not frozen: built per request, where frozen's __init__ costs ~1 us
class ReadPlan:
    """Where a read starts, against a snapshot; the service reads the bytes outside the actor."""

    view: StreamView
    start: int
    log: StreamLog
    # Fires at the stream's next published change (append, close, delete): what live readers wait on.
    changed: trio.Event


@dataclass(slots=True)  # not frozen: built per request, where frozen's __init__ costs ~1 us
class PendingAppend:
    """An accepted append: the reply is `outcome` once `commit` is durable."""

    commit: Commit
    outcome: AppendOutcome
    incarnation: int  # of the stream's offset tokens
    name: str
    # Raised instead of answering `outcome` once `commit` is durable (a conflict with a close
    # that was accepted but is not yet durable).
    conflict: ProtocolError | None = None

    async def wait(self) -> AppendOutcome:
        await self.commit.settled()
        return self.result()

    def result(self) -> AppendOutcome:
        """The answer, once `commit.done` (memory storage, or a duplicate of durable data: at once)."""
        try:
            self.commit.result()
        except STORAGE_ERRORS as error:
            raise as_protocol_error(error, self.name) from None
        if self.conflict is not None:
            raise self.conflict
        return self.outcome


class Lifecycle(Protocol):
    """Told of every stream created or deleted once it happened in storage (the registry keeps
    its list by it: streamkeep/registry/keeper.py). The actor awaits it before answering, so a
    client whose PUT was answered finds the stream listed. It must not raise, nor call the
    stream's actor back."""

    async def created(self, meta: StreamMeta) -> None: ...

    async def deleted(self, name: str) -> None: ...

    def unsure(self) -> None:
        """A create or delete failed but may have happened (it is not durably known)."""
        ...


class ActorHost(Protocol):
    """What an actor needs from whoever runs it (the Supervisor): its storage, its mailbox size,
    the listeners of stream changes, a way to leave, and calls to other streams' actors."""

    storage: Storage
    mailbox_size: int
    listeners: list[Callable[[str], None]]
    lifecycle: Lifecycle | None

    def forget(self, actor: StreamActor) -> None: ...

    async def call(self, name: str, handler: str, *args: Any, must_exist: bool = True) -> Any: ...


# The handlers that can run to the end without awaiting, and so in the caller's task (call_now).
_NOW = {"append": "_append_now", "read": "_read_now", "head": "_head_now"}


class StreamActor:
    def __init__(self, name: str, supervisor: ActorHost) -> None:
        self.name = name
        self._supervisor = supervisor
        self._storage = supervisor.storage
        self._send, self._receive = trio.open_memory_channel[Message](supervisor.mailbox_size)
        # Fired at the next published change; made when a reader first asks for it, since most
        # appends have no live reader waiting (a trio.Event per append cost ~1 us).
        self._changed: trio.Event | None = None
        self.live_readers = 0
        self.alive = True
        self.busy = False
        self.last_active = trio.current_time()
        self._queued = 0  # messages sent and not yet taken: `call_now` must not overtake them

    # ---- the mailbox -------------------------------------------------------------------

    async def call(self, handler_name: str, *args: Any) -> Any:
        reply = Reply()
        self._queued += 1
        try:
            await self._send.send(Message(getattr(self, handler_name), args, reply))
        except BaseException as error:
            self._queued -= 1
            if isinstance(error, (trio.ClosedResourceError, trio.BrokenResourceError)):
                raise ActorGone from None
            raise
        return await reply.wait()

    def call_now(self, handler_name: str, *args: Any) -> Any:
        """Runs a handler in the caller's task when the actor is idle, or raises `NotNow`.

        trio runs one task at a time, and these handlers never await: nothing else runs between
        their first line and their last, so this actor is still the stream's only writer, with no
        mailbox round trip (two task switches and a memory channel: ~15 % of an in-memory append).
        The actor must be idle, with nothing queued, so a message sent earlier is not overtaken;
        a handler that would have to wait (an expired stream to remove) raises `NotNow` before it
        changes anything, and the caller sends the message instead.
        """
        now = _NOW.get(handler_name)
        if now is None or self.busy or self._queued or not self.alive:
            raise NotNow
        self.busy = True  # a listener calling back into this actor meanwhile takes the mailbox
        try:
            return getattr(self, now)(*args)
        except STORAGE_ERRORS as error:
            raise as_protocol_error(error, self.name) from None
        finally:
            self.busy = False
            self.last_active = trio.current_time()

    async def run(self) -> None:
        # No timeout per message: the supervisor's sweep decides hibernation. A deadline per
        # message cost ~10 % of an append once 10,000 actors kept trio's deadline heap busy.
        try:
            async for message in self._receive:
                self._queued -= 1
                self.busy = True
                try:
                    await self._handle(message)
                finally:
                    self.busy = False
                    self.last_active = trio.current_time()
        finally:
            # Cancelled (the server stops): whoever waits on a message this actor will never
            # take is answered, or a caller that must finish (a shielded delete calling its
            # fork source) would wait forever and hold up the shutdown (torture sim seed 2462).
            self._answer_pending()
            self._receive.close()

    def _answer_pending(self) -> None:
        while True:
            try:
                message = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            message.reply.fail(_stopping(self.name))

    def hibernate_if_idle(self, idle_since: float) -> bool:
        """Ends the actor if it has been idle since `idle_since` and nothing needs it; the
        supervisor's sweep calls it. No checkpoint between the check and closing the mailbox, so
        no message can slip into a mailbox that nobody will read."""
        # `_queued` too: a message handed straight to a waiting actor is in no buffer yet.
        if self.busy or self._queued or self.last_active > idle_since or not self._can_hibernate():
            return False
        self.alive = False
        self._supervisor.forget(self)
        self._send.close()
        return True

    async def _handle(self, message: Message) -> None:
        try:
            result = await message.handler(*message.args)
        except ProtocolError as error:
            message.reply.fail(error)
        except STORAGE_ERRORS as error:  # the one place storage failures become answers
            message.reply.fail(as_protocol_error(error, self.name))
        except Exception as error:  # a bug: answer 500, keep the actor alive
            log.exception("stream %r: %s failed", self.name, message.handler.__name__)
            message.reply.fail(error)
        except BaseException:  # cancelled mid-message: the caller hears so, never nothing
            message.reply.fail(_stopping(self.name))
            raise
        else:
            message.reply.set(result)

    def _can_hibernate(self) -> bool:
        if self.live_readers or self._receive.statistics().current_buffer_used:
            return False
        stream_log = self._storage.open(self.name)
        return stream_log is None or stream_log.pending == 0

    def live_reader(self) -> LiveReaderMark:
        """Marks a long-poll or SSE reader, which keeps the actor from hibernating."""
        return LiveReaderMark(self)

    # ---- helpers -----------------------------------------------------------------------

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        for listener in self._supervisor.listeners:
            try:
                listener(self.name)
            except Exception:  # a listener's bug must not fail the stream's own operation
                log.exception("stream %r: a change listener failed", self.name)

    async def _tell_deleted(self) -> None:
        if self._supervisor.lifecycle is not None:
            await self._supervisor.lifecycle.deleted(self.name)

    def _view(self, stream_log: StreamLog) -> StreamView:
        meta = rules.copy_meta(stream_log.meta)
        meta.closed = stream_log.published_closed
        return StreamView(meta, stream_log.published_tail, forks.readable_from(self._storage, stream_log))

    async def _existing(self, now: float) -> StreamLog:
        stream_log = self._storage.open(self.name)
        if stream_log is not None and not stream_log.meta.soft_deleted and stream_log.meta.expired(now):
            log.info("stream %r expired", self.name)
            await self._remove(stream_log)
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

    async def _remove(self, stream_log: StreamLog) -> None:
        """Deletes the stream, or only soft-deletes it while forks still read its data (§4.2)."""
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
                    await self._detach_from(source, stream_log.meta.stream_id)
                except ProtocolError as error:
                    # Another member's source that cannot be told now keeps its pin until its
                    # reconcile finds this fork gone (streamkeep/cluster/forks.py).
                    log.warning("fork %r: its source %r was not told: %s", self.name, source, error.message)
        if uncertain is not None:
            raise uncertain

    # ---- handlers: each runs inside the actor's task ----------------------------------

    def _refuse_soft_deleted_path(self) -> None:
        current = self._storage.open(self.name)
        if current is not None and current.meta.soft_deleted:
            raise ProtocolError(
                409,
                "stream_soft_deleted",
                "this path belonged to a stream that was deleted while forks still read it; "
                "it can be reused once those forks are deleted",
            )

    async def create(self, spec: CreateSpec) -> tuple[int, StreamView]:
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
                created = await self._create(meta, spec.messages)
            else:
                created = await self._create_fork(spec, now)
        except StorageUnavailable as error:
            if error.happened:  # created, if not durably: listeners hear of it all the same
                self._notify()
                if self._supervisor.lifecycle is not None:
                    self._supervisor.lifecycle.unsure()
            raise
        created.on_publish = self._notify
        self._notify()
        if self._supervisor.lifecycle is not None:
            await self._supervisor.lifecycle.created(created.meta)
        return 201, self._view(created)

    async def _create(self, meta: StreamMeta, messages: list[bytes]) -> StreamLog:
        return await self._storage.create(meta, messages)

    async def _detach_from(self, source: str, stream_id: str) -> None:
        remote = forks.remote_source(self._storage, source)
        if remote is not None:
            await remote.detach(source, stream_id)
        else:
            await self._supervisor.call(source, "detach_fork")

    async def _create_fork(self, spec: CreateSpec, now: float) -> StreamLog:
        fork = spec.fork
        assert fork is not None
        if fork.source == self.name:
            raise not_found(fork.source)  # this path holds no stream, so it cannot be the source
        given = spec.content_type if spec.content_type_given else None
        stream_id = uuid.uuid4().hex[:12]
        remote = forks.remote_source(self._storage, fork.source)
        if remote is None:
            source: ForkSource = await self._supervisor.call(fork.source, "attach_fork", fork, given)
            return await self._create_attached(spec, now, stream_id, source)
        # The source's member pins its data for this fork durably before the fork exists; while
        # this create runs, its reconcile hears "pending" for the pin, never "absent".
        with remote.attaching(stream_id):
            source = await remote.attach(fork, given, fork_name=self.name, pin=stream_id)
            return await self._create_attached(spec, now, stream_id, source)

    async def _create_attached(self, spec: CreateSpec, now: float, stream_id: str, source: ForkSource) -> StreamLog:
        fork = spec.fork
        assert fork is not None
        try:
            ttl, expires = spec.ttl_seconds, spec.expires_at
            if ttl is None and expires is None:  # the inheritance table of §4.2
                if source.ttl_seconds is not None:
                    ttl = source.ttl_seconds
                elif source.expires_at is not None and source.expires_at_ts is not None:
                    expires = (source.expires_at, source.expires_at_ts)
            meta = StreamMeta(
                name=self.name,
                stream_id=stream_id,
                content_type=source.content_type,
                created_at=now,
                ttl_seconds=ttl,
                expires_at=expires[0] if expires else None,
                expires_at_ts=expires[1] if expires else None,
                closed=spec.closed,
                last_access=now,
                forked_from=fork.source,
                fork_base=source.base,
                fork_offset=fork.offset_token,
                fork_sub_offset=fork.sub_offset,
                fork_low=source.low,
                source_incarnations=source.incarnations,
            )
            return await self._create(meta, spec.split(source.content_type))
        except BaseException as error:
            if getattr(error, "happened", False):
                raise  # the fork exists (if not durably): its source keeps counting it
            with trio.CancelScope(shield=True):
                try:
                    await self._detach_from(fork.source, stream_id)
                except ProtocolError:
                    pass
            raise

    async def attach_fork(
        self, fork: ForkSpec, content_type: str | None, pin: tuple[str, str] | None = None
    ) -> ForkSource:
        """A new fork of this stream: validate its fork point and count it (runs in the source's
        actor). `pin` (fork stream id, fork name): the fork lives on another cluster member, so
        the count is a pin saved in this stream's meta before the fork is created."""
        stream_log = self._storage.open(self.name)
        if stream_log is None:
            raise ProtocolError(404, "fork_source_not_found", f"the fork source {self.name!r} does not exist")
        if stream_log.meta.soft_deleted:
            raise ProtocolError(409, "fork_source_deleted", f"the fork source {self.name!r} was deleted")
        stream_log = await self._existing(time.time())
        meta = stream_log.meta
        if content_type is not None and media_type(content_type) != media_type(meta.content_type):
            raise ProtocolError(
                409,
                "content_type_mismatch",
                f"the source holds {meta.content_type!r}, the fork asked for {content_type!r}",
            )
        tail = stream_log.published_tail
        position = tail if fork.offset is None else fork.offset.position
        if position > tail:
            raise bad_request(
                "fork_offset_out_of_range", "Stream-Fork-Offset is past the end of the source stream"
            )
        if fork.offset is not None:
            self._check_incarnation(stream_log, fork.offset.incarnation)
        floor = forks.readable_from(self._storage, stream_log)
        if position < floor:
            raise below_floor(floor, meta.incarnation)
        boundary, end = await forks.probe(self._storage, stream_log, position)
        if meta.json_mode and not boundary:
            raise bad_request(
                "invalid_fork_offset", "Stream-Fork-Offset is not at a message boundary of the source"
            )
        base = position
        if fork.sub_offset:
            if end is None:
                raise bad_request(
                    "fork_sub_offset_out_of_range", "the source holds no data past Stream-Fork-Offset"
                )
            if meta.json_mode:
                result = await forks.read_range(
                    self._storage, stream_log, position, end - position, whole_messages=True, limit=end
                )
                if fork.sub_offset > len(result.messages):
                    raise bad_request(
                        "fork_sub_offset_out_of_range",
                        f"Stream-Fork-Sub-Offset {fork.sub_offset} passes the {len(result.messages)} messages "
                        "of the append at Stream-Fork-Offset",
                    )
                base = position + sum(len(m) for m in result.messages[: fork.sub_offset])
            else:
                if position + fork.sub_offset > end:
                    raise bad_request(
                        "fork_sub_offset_out_of_range",
                        "Stream-Fork-Sub-Offset passes the end of the append at Stream-Fork-Offset",
                    )
                base = position + fork.sub_offset
        # The fork will read the source up to its fork point for as long as it lives: under a
        # relaxed fsync policy that point must be on disk first, or a power cut could take back
        # what the fork reads (and leave the fork pointing past its source's end).
        if pin is None:
            await stream_log.make_durable()
            # Counted on the meta in place now, not on `meta`: an append that failed meanwhile put
            # a copy of the durable meta in its place (log.py `_fail`), and a count on the one
            # read before would be lost, the source deleted outright under its fork (sim seed 7582).
            # (The fields read below are the source's own: no append changes them.)
            stream_log.meta.fork_count += 1
            return ForkSource(meta.content_type, meta.ttl_seconds, meta.expires_at, meta.expires_at_ts, base)
        return await self._pin_fork(stream_log, pin, position, base)

    async def _pin_fork(self, stream_log: StreamLog, pin: tuple[str, str], position: int, base: int) -> ForkSource:
        """Saves the pin of a fork another member will own. Counted from the start, so no retention
        pass drops what the pin is about to name while the fork point is made durable; the pin
        names the floor as it is once that is done (retention may have raised it meanwhile)."""
        meta = stream_log.meta
        before = meta.remote_forks
        again = any(p[0] == pin[0] for p in before)  # a retried attach: one pin, one count
        if not again:
            meta.fork_count += 1
        pins = before
        try:
            await stream_log.make_durable()
            low = min(forks.readable_from(self._storage, stream_log), base)
            if position < low:
                raise below_floor(low, meta.incarnation)
            pins = (*(p for p in before if p[0] != pin[0]), (pin[0], pin[1], low))
            await self._storage.save_meta(self.name, replace(stream_log.meta, remote_forks=pins))
        except BaseException as error:
            # On the meta in place now, as in `attach_fork`: a failed append may have replaced it.
            if pins is not before and getattr(error, "happened", False):
                stream_log.meta.remote_forks = pins  # saved, if not durably: the fork may follow
            elif not again:
                stream_log.meta.fork_count -= 1
            raise
        stream_log.meta.remote_forks = pins
        incarnations = (meta.incarnation, *self._source_incarnations(stream_log))
        return ForkSource(meta.content_type, meta.ttl_seconds, meta.expires_at, meta.expires_at_ts, base, low, incarnations)

    def _source_incarnations(self, stream_log: StreamLog) -> tuple[int, ...]:
        """The incarnations of this stream's sources, nearest first."""
        found: list[int] = []
        meta: StreamMeta | None = stream_log.meta
        while meta is not None and meta.forked_from is not None:
            if meta.source_incarnations:
                return (*found, *meta.source_incarnations)
            source = self._storage.open(meta.forked_from)
            meta = source.meta if source is not None else None
            if meta is not None:
                found.append(meta.incarnation)
        return tuple(found)

    async def detach_fork(self, pin: str | None = None) -> None:
        """A fork of this stream is gone; the last one out removes a soft-deleted source. `pin`:
        the stream id of a fork another member owned (its pin goes; a second detach is a no-op)."""
        stream_log = self._storage.open(self.name)
        if stream_log is None:
            return
        if pin is not None:
            meta = stream_log.meta
            kept = tuple(p for p in meta.remote_forks if p[0] != pin)
            if len(kept) == len(meta.remote_forks):
                return
            try:
                await self._storage.save_meta(self.name, replace(meta, remote_forks=kept))
            except BaseException as error:
                if not getattr(error, "happened", False):
                    raise  # the pin stays, in memory as on disk: a reconcile tries again
            stream_log.meta.remote_forks = kept  # the meta in place now (see `attach_fork`)
        stream_log.meta.fork_count = max(0, stream_log.meta.fork_count - 1)
        if stream_log.meta.soft_deleted and stream_log.meta.fork_count == 0:
            await self._hard_delete(stream_log)

    async def raise_pin(self, pin: str, low: int) -> None:
        """A fork on another member reads from `low` up now (its own retention moved on): its pin
        here stops holding what lies below. Pins only ever rise."""
        stream_log = self._storage.open(self.name)
        if stream_log is None:
            return
        meta = stream_log.meta
        raised = tuple((i, name, max(held, low)) if i == pin else (i, name, held) for i, name, held in meta.remote_forks)
        if raised != meta.remote_forks:
            await self._storage.save_meta(self.name, replace(meta, remote_forks=raised))
            stream_log.meta.remote_forks = raised  # the meta in place now (see `attach_fork`)

    async def append(self, spec: AppendSpec) -> PendingAppend:
        now = time.time()
        return self._plan_append(await self._existing(now), spec, now)

    def _append_now(self, spec: AppendSpec) -> PendingAppend:
        now = time.time()
        return self._plan_append(self._existing_now(now), spec, now)

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

    async def compact(
        self, fold: StateFold, position: int, chunk: int, stream_id: str
    ) -> tuple[Commit, int, StreamLog]:
        """The last step of a compaction, in the actor so no append slips in: folds what came
        after `position` (what the background fold read up to), then appends the snapshot,
        starting a new segment, in records of at most `chunk` bytes (so reads of it stay chunked).
        Returns the last record's commit, where the snapshot starts, and the log."""
        stream_log = await self._existing(time.time())
        if stream_log.meta.stream_id != stream_id:
            raise ProtocolError(
                409, "stream_replaced", f"stream {self.name!r} was deleted and created again during the compaction"
            )
        check_compactable(stream_log)
        fresh_segment = getattr(stream_log, "fresh_segment", None)
        if fresh_segment is None:
            raise ProtocolError(409, "compaction_needs_disk", "compaction needs disk storage (--storage disk)")
        await stream_log.drain()  # appends accepted before this message land first
        if stream_log.published_closed:
            raise ProtocolError(409, "stream_closed", f"stream {self.name!r} is closed: nothing to compact for")
        await fold_range(self._storage, stream_log, fold, position, stream_log.published_tail, chunk)
        start = await fresh_segment()
        # Encoding 100,000 values takes a while: in a worker thread, so other streams' requests
        # get the event loop back every few milliseconds (the GIL's switch interval).
        messages = await trio.to_thread.run_sync(fold.snapshot, offsets.encode(start, stream_log.meta.incarnation))
        commit = stream_log.latest_commit()
        for group in _groups(messages, chunk):
            commit = stream_log.submit(AppendRecord(group, rules.copy_meta(stream_log.meta), None, False, None))
        return commit, start, stream_log

    def _check_incarnation(self, stream_log: StreamLog, incarnation: int) -> None:
        """An offset token must be this stream's, or its fork sources' (a fork shares their
        positions), or carry no incarnation at all; else it belongs to a deleted predecessor."""
        if incarnation == offsets.ANY_INCARNATION:
            return
        meta: StreamMeta | None = stream_log.meta
        while meta is not None:
            if meta.incarnation == incarnation or incarnation in meta.source_incarnations:
                return
            source = self._storage.open(meta.forked_from) if meta.forked_from else None
            meta = source.meta if source is not None else None
        raise ProtocolError(
            410,
            "offset_of_deleted_stream",
            f"that offset belongs to an earlier stream named {self.name!r}, deleted since; "
            "this one is new: read it from offset=-1",
        )

    async def read(self, start: offsets.Offset | str, touch: bool) -> ReadPlan:
        """Validates `start` (an offset, or "-1"/"now") against the published stream."""
        now = time.time()
        return self._plan_read(await self._existing(now), start, touch, now)

    def _read_now(self, start: offsets.Offset | str, touch: bool) -> ReadPlan:
        now = time.time()
        return self._plan_read(self._existing_now(now), start, touch, now)

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
            position = start.position
            if position > view.tail:
                raise bad_request("offset_out_of_range", "offset is past the end of the stream")
            self._check_incarnation(stream_log, start.incarnation)
            if position < view.floor:
                raise below_floor(view.floor, view.meta.incarnation)
            if view.meta.json_mode and not forks.is_boundary(self._storage, stream_log, position):
                raise bad_request("invalid_offset", "offset is not at a message boundary of this JSON stream")
        if self._changed is None:
            self._changed = trio.Event()
        return ReadPlan(view, position, stream_log, self._changed)

    async def head(self) -> StreamView:
        return self._view(await self._existing(time.time()))

    def _head_now(self) -> StreamView:
        return self._view(self._existing_now(time.time()))

    async def delete(self) -> None:
        await self._remove(await self._existing(time.time()))


async def fold_range(
    storage: Storage,
    stream_log: StreamLog,
    fold: StateFold,
    position: int,
    limit: int,
    chunk: int,
    *,
    slice_seconds: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Folds the messages of `stream_log` from `position` up to `limit`, read like any reader, in
    reads of `chunk` bytes; yields to the event loop after `slice_seconds` of folding if given.
    Returns where it stopped (`limit`); 422 at a message not of the State Protocol's shape."""
    while position < limit:
        result = await forks.read_range(storage, stream_log, position, chunk, whole_messages=True, limit=limit)
        slice_end = time.perf_counter() + (slice_seconds or 0.0)
        try:
            for message in result.messages:
                fold.apply(message)
                position += len(message)
                if slice_seconds is not None and time.perf_counter() >= slice_end:
                    await trio.lowlevel.checkpoint()
                    slice_end = time.perf_counter() + slice_seconds
        except NotStateMessage as error:
            raise not_state_message(error, offsets.encode(position, stream_log.meta.incarnation)) from None
        position = result.next_position
        if progress is not None:
            progress(position)
    return position


def _groups(messages: list[bytes], limit: int) -> list[list[bytes]]:
    """`messages` in runs of at most `limit` bytes (a message larger than that alone)."""
    groups: list[list[bytes]] = [[]]
    size = 0
    for message in messages:
        if groups[-1] and size + len(message) > limit:
            groups.append([])
            size = 0
        groups[-1].append(message)
        size += len(message)
    return groups


def not_state_message(error: NotStateMessage, offset: str) -> ProtocolError:
    return ProtocolError(422, "not_state_message", f"the message at offset {offset} {error}")


def check_compactable(stream_log: StreamLog) -> None:
    """A State Protocol stream is JSON; a closed one takes no snapshot (it takes no appends)."""
    if not stream_log.meta.json_mode:
        raise ProtocolError(
            409,
            "not_a_state_stream",
            f"only JSON streams of State Protocol messages are compacted; this one is {stream_log.meta.content_type!r}",
        )
    if stream_log.meta.closed:
        raise ProtocolError(409, "stream_closed", "a closed stream takes no snapshot: nothing to compact for")


class LiveReaderMark:
    """`with actor.live_reader():` - a slotted class, as 10,000 SSE subscribers each hold one."""

    __slots__ = ("actor",)

    def __init__(self, actor: StreamActor) -> None:
        self.actor = actor

    def __enter__(self) -> StreamActor:
        self.actor.live_readers += 1
        return self.actor

    def __exit__(self, *_: object) -> None:
        self.actor.live_readers -= 1


def _gone(name: str) -> ProtocolError:
    return ProtocolError(
        410, "stream_deleted", f"stream {name!r} was deleted; only its forks still read its data"
    )


__all__ = ["ActorGone", "PendingAppend", "ReadPlan", "StreamActor", "StreamView"]


def _stopping(name: str) -> ProtocolError:
    return ProtocolError(503, "shutting_down", f"stream {name!r}: the server is stopping; retry once it is back")
