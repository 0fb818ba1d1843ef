"""Starts stream actors on demand, routes messages to them, and lets idle ones hibernate."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import trio

from streamkeep.actors.actor import LiveReaderMark, StreamActor
from streamkeep.actors.host import Lifecycle
from streamkeep.actors.mailbox import ActorGone, NotNow
from streamkeep.actors.messages import Ask
from streamkeep.actors.stream_ops import NOW
from streamkeep.protocol.errors import not_found
from streamkeep.storage.base import Storage

log = logging.getLogger(__name__)

R = TypeVar("R")

# What a sweep over every actor (hibernation) or every stream (expiry.py) looks at between two
# checkpoints. A pass over 100,000 streams without one held the event loop ~30 ms (a stall for every
# request in flight, growing with the streams); a slice of this size takes ~0.3 ms.
SWEEP_SLICE = 1000


class Supervisor:
    def __init__(
        self,
        storage: Storage,
        nursery: trio.Nursery,
        *,
        mailbox_size: int = 64,
        hibernate_after: float = 30.0,
    ) -> None:
        self.storage = storage
        self.mailbox_size = mailbox_size
        self.hibernate_after = hibernate_after
        self._nursery = nursery
        self._actors: dict[str, StreamActor] = {}
        self._sweeping = False
        self.spawned = 0
        # Told the name of every stream that published data, was created or deleted
        # (subscriptions link and wake on it). Called synchronously: listeners must not block.
        self.listeners: list[Callable[[str], None]] = []
        # Told of creates and deletes, and awaited by the actor before it answers (the registry,
        # streamkeep/registry/keeper.py); None when nothing keeps a list.
        self.lifecycle: Lifecycle | None = None
        # Called once SWEEP_SLICE or more actors went to sleep since the last call, or some did and
        # none is awake: what they freed can go back to the system now
        # (background.MemoryGiveBack.soon, where the process has one).
        self.many_hibernated: Callable[[], None] | None = None
        self._slept = 0  # actors put to sleep since `many_hibernated` was last called

    @property
    def active(self) -> int:
        return len(self._actors)

    def actor(self, name: str, *, must_exist: bool) -> StreamActor:
        """The stream's running actor, started if needed.

        With `must_exist`, a stream that has neither an actor nor stored data is answered 404
        without starting one, so a flood of requests for random names costs no tasks.
        """
        actor = self._actors.get(name)
        if actor is None:
            if must_exist and self.storage.open(name) is None:
                raise not_found(name)
            actor = self._spawn(name)
        return actor

    def _spawn(self, name: str) -> StreamActor:
        if not self._sweeping:
            self._nursery.start_soon(self._sweep_idle, name="stream-actor-sweep")
            self._sweeping = True  # only once it started: else no sweep would ever run again
        actor = StreamActor(name, self)
        self._actors[name] = actor
        self.spawned += 1
        return actor

    def start(self, actor: StreamActor) -> None:
        """Starts the task that reads the actor's mailbox (its first message made it)."""
        self._nursery.start_soon(actor.run, name=f"stream-actor:{actor.name}")

    async def _sweep_idle(self) -> None:
        """Hibernates actors idle for `hibernate_after`: one task for all of them, running only
        while any actor is awake."""
        try:
            while self._actors:
                await trio.sleep(self.hibernate_after / 4)
                idle_since = trio.current_time() - self.hibernate_after
                for seen, actor in enumerate(list(self._actors.values()), 1):
                    try:
                        self._slept += actor.hibernate_if_idle(idle_since)
                    except Exception:  # a bug must cost one actor its nap, not the server its life
                        log.exception("stream %r: hibernation check failed", actor.name)
                    if seen % SWEEP_SLICE == 0:
                        # 100,000 awake actors (live readers) held the event loop ~30 ms a sweep.
                        await trio.lowlevel.checkpoint()
                if self._slept >= SWEEP_SLICE or (self._slept and not self._actors):
                    self._slept = 0
                    if self.many_hibernated is not None:
                        self.many_hibernated()
        finally:
            self._sweeping = False

    def call_now(self, name: str, message: Ask[R]) -> R:
        """Runs the message's handler in the caller's task if the stream's actor is idle (see
        StreamActor.call_now), else raises NotNow and nothing happened. A hibernated stream gets
        its actor back without a task: the message has a direct form, so none is needed yet."""
        actor = self._actors.get(name)
        if actor is None:
            # No stored stream: the long way answers 404 (or creates), as it always did.
            if type(message) not in NOW or self.storage.open(name) is None:
                raise NotNow
            actor = self._spawn(name)
        return actor.call_now(message)

    async def call(self, name: str, message: Ask[R], *, must_exist: bool = True) -> R:
        """The answer to `message` (actors/messages.py); at once, without a checkpoint, when
        `call_now` can take it."""
        try:
            return self.call_now(name, message)
        except NotNow:
            pass
        while True:
            actor = self.actor(name, must_exist=must_exist)
            try:
                return await actor.call(message)
            except ActorGone:
                continue

    def live_reader(self, name: str) -> LiveReaderMark:
        """`with supervisor.live_reader(name):` keeps the stream's actor awake (404 if there is none)."""
        return self.actor(name, must_exist=True).live_reader()

    def forget(self, actor: StreamActor) -> None:
        if self._actors.get(actor.name) is actor:
            del self._actors[actor.name]
