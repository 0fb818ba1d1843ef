"""Messages to an actor and the one-shot replies that come back."""

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


@dataclass
class Message:
    handler: Callable[..., Awaitable[Any]]
    args: tuple[Any, ...]
    reply: Reply
