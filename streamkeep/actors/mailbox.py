"""The envelopes in an actor's mailbox and the one-shot replies that come back."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio


class ActorGone(Exception):
    """The actor hibernated before it took the message; the supervisor starts a new one."""


class NotNow(Exception):
    """The handler cannot run in the caller's task now (the actor is busy, has messages queued, or
    the handler would have to wait): send it as a message instead."""


@dataclass
class Reply:
    _done: trio.Event = field(default_factory=trio.Event)
    _value: Any = None
    _error: BaseException | None = None

    def set(self, value: Any) -> None:
        self._value = value
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    async def wait(self) -> Any:
        await self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


@dataclass(slots=True)
class Envelope:
    """A message in an actor's mailbox: what to run, on what, and where the answer goes."""

    handler: Callable[[Any, Any], Awaitable[Any]]
    message: object
    reply: Reply
