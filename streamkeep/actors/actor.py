"""The actor that owns one stream: a trio task taking messages from a bounded mailbox, one at a
time, and the direct calls that skip the mailbox while it is idle.

Every change to a stream happens in its actor (its operations: actors/stream_ops.py), so the
actor is the stream's only writer. The actor hibernates after a quiet spell with no live readers;
the supervisor makes a fresh one on the next request.

The mailbox and the task that reads it are made at the first message that needs them. A stream
woken by requests that all have a direct form (an append to a hibernated stream, a catch-up read)
never gets either: most of what an append to one of 100,000 idle streams cost beyond an append to
an awake one was that task and its mailbox, made and ended again for one request (issue 26).
"""

from __future__ import annotations

import logging
from typing import Protocol, TypeVar

import trio

from streamkeep.actors.host import StreamHost
from streamkeep.actors.mailbox import ActorGone, Envelope, NotNow, Reply
from streamkeep.actors.messages import Ask
from streamkeep.actors.stream_ops import HANDLERS, NOW, StreamOps
from streamkeep.protocol.errors import ProtocolError
from streamkeep.storage.errors import STORAGE_ERRORS, as_protocol_error

log = logging.getLogger(__name__)

R = TypeVar("R")


class ActorHost(StreamHost, Protocol):
    """What an actor needs from whoever runs it (the Supervisor): what its stream's operations
    need, its mailbox size, a task to read its mailbox, and a way to leave."""

    mailbox_size: int

    def start(self, actor: StreamActor) -> None: ...

    def forget(self, actor: StreamActor) -> None: ...


class StreamActor:
    def __init__(self, name: str, supervisor: ActorHost) -> None:
        self.name = name
        self.ops = StreamOps(name, supervisor)
        self._supervisor = supervisor
        # Made, with the task that reads them, by the first message sent (`_mailbox`).
        self._send: trio.MemorySendChannel[Envelope] | None = None
        self._receive: trio.MemoryReceiveChannel[Envelope] | None = None
        self.live_readers = 0
        self.alive = True
        self.busy = False
        self.last_active = trio.current_time()
        self._queued = 0  # messages sent and not yet taken: `call_now` must not overtake them

    async def call(self, message: Ask[R]) -> R:
        handler = HANDLERS[type(message)]
        reply = Reply()
        send = self._send if self._send is not None else self._mailbox()
        self._queued += 1
        try:
            await send.send(Envelope(handler, message, reply))
        except BaseException as error:
            self._queued -= 1
            if isinstance(error, trio.ClosedResourceError):  # it hibernated: a new actor takes it
                raise ActorGone from None
            if isinstance(error, trio.BrokenResourceError):
                # Its task ended (the server stops) and it stays in the table: "gone" would make
                # a shielded caller (a fork's detach) ask this same actor again, forever.
                raise _stopping(self.name) from None
            raise
        answer: R = await reply.wait()
        return answer

    def _mailbox(self) -> trio.MemorySendChannel[Envelope]:
        if not self.alive:  # hibernated before its first message: the supervisor makes a new one
            raise ActorGone
        send, receive = trio.open_memory_channel[Envelope](self._supervisor.mailbox_size)
        # The task first runs after this returns; if it cannot start (its nursery closed), the
        # actor keeps no mailbox that nobody would read.
        self._supervisor.start(self)
        self._send, self._receive = send, receive
        return send

    def call_now(self, message: Ask[R]) -> R:
        """Runs a message's handler in the caller's task when the actor is idle, or raises `NotNow`.

        trio runs one task at a time, and these handlers never await: nothing else runs between
        their first line and their last, so this actor is still the stream's only writer, with no
        mailbox round trip (two task switches and a memory channel: ~15 % of an in-memory append).
        The actor must be idle, with nothing queued, so a message sent earlier is not overtaken;
        a handler that would have to wait (an expired stream to remove) raises `NotNow` before it
        changes anything, and the caller sends the message instead.
        """
        now = NOW.get(type(message))
        if now is None or self.busy or self._queued or not self.alive:
            raise NotNow
        self.busy = True  # a listener calling back into this actor meanwhile takes the mailbox
        try:
            answer: R = now(self.ops, message)
            return answer
        except STORAGE_ERRORS as error:
            raise as_protocol_error(error, self.name) from None
        finally:
            self.busy = False
            self.last_active = trio.current_time()

    async def run(self) -> None:
        # No timeout per message: the supervisor's sweep decides hibernation. A deadline per
        # message cost ~10 % of an append once 10,000 actors kept trio's deadline heap busy.
        assert self._receive is not None, "started by its first message, which made the mailbox"
        try:
            async for envelope in self._receive:
                self._queued -= 1
                self.busy = True
                try:
                    await self._handle(envelope)
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
        assert self._receive is not None
        while True:
            try:
                envelope = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            envelope.reply.fail(_stopping(self.name))

    async def _handle(self, envelope: Envelope) -> None:
        try:
            result = await envelope.handler(self.ops, envelope.message)
        except ProtocolError as error:
            envelope.reply.fail(error)
        except STORAGE_ERRORS as error:  # the one place storage failures become answers
            envelope.reply.fail(as_protocol_error(error, self.name))
        except Exception as error:  # a bug: answer 500, keep the actor alive
            log.exception("stream %r: %s failed", self.name, type(envelope.message).__name__)
            envelope.reply.fail(error)
        except BaseException:  # cancelled mid-message: the caller hears so, never nothing
            envelope.reply.fail(_stopping(self.name))
            raise
        else:
            envelope.reply.set(result)

    def hibernate_if_idle(self, idle_since: float) -> bool:
        """Ends the actor if it has been idle since `idle_since` and nothing needs it; the
        supervisor's sweep calls it. No checkpoint between the check and closing the mailbox, so
        no message can slip into a mailbox that nobody will read."""
        # `_queued` too: a message handed straight to a waiting actor is in no buffer yet. Never one
        # that already ended (the sweep yields between slices): its stream may have a new actor.
        if (
            not self.alive
            or self.busy
            or self._queued
            or self.last_active > idle_since
            or not self._can_hibernate()
        ):
            return False
        self.alive = False
        self._supervisor.forget(self)
        if self._send is not None:
            self._send.close()
        self.ops.hibernated()
        return True

    def _can_hibernate(self) -> bool:
        if self.live_readers or (
            self._receive is not None and self._receive.statistics().current_buffer_used
        ):
            return False
        return self.ops.settled()

    def live_reader(self) -> LiveReaderMark:
        """Marks a long-poll or SSE reader, which keeps the actor from hibernating."""
        return LiveReaderMark(self)


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


def _stopping(name: str) -> ProtocolError:
    return ProtocolError(
        503, "shutting_down", f"stream {name!r}: the server is stopping; retry once it is back"
    )
