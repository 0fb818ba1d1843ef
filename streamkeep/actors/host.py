"""What a stream's operations need from the actors' runner (the Supervisor) and its listeners."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from streamkeep.actors.messages import Ask
from streamkeep.protocol.stream import StreamMeta
from streamkeep.storage.base import Storage

R = TypeVar("R")


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


class StreamHost(Protocol):
    """The storage, the listeners of stream changes, and calls to other streams' actors (a fork
    and its source talk to each other's actor)."""

    storage: Storage
    # Told the name of every stream that published data, was created or deleted. Called
    # synchronously: listeners must not block.
    listeners: list[Callable[[str], None]]
    lifecycle: Lifecycle | None

    async def call(self, name: str, message: Ask[R], *, must_exist: bool = True) -> R: ...
