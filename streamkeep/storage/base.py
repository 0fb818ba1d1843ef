"""The storage interface the actors program against; memory now, disk and cold tiers later.

A `StreamLog` is one stream's durable state: metadata, producer table and messages. Only the
stream's actor calls its mutating methods, so implementations need no locks of their own. Every
mutating method is one atomic, durable step: after it returns, a crash loses none of it, and a
crash during it leaves all or none of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from streamkeep.protocol.stream import ProducerState, StreamMeta


class StorageFull(Exception):
    """An append would pass a byte cap; `per_stream` tells which one."""

    def __init__(self, message: str, *, per_stream: bool) -> None:
        super().__init__(message)
        self.per_stream = per_stream


@dataclass(frozen=True)
class ReadResult:
    messages: list[bytes]
    next_position: int


class StreamLog(Protocol):
    meta: StreamMeta
    producers: dict[str, ProducerState]

    @property
    def tail(self) -> int: ...

    def read(self, start: int, max_bytes: int, *, whole_messages: bool) -> ReadResult:
        """Messages from `start` until about `max_bytes`, at least one; byte streams
        (`whole_messages=False`) may be cut anywhere, JSON messages never."""
        ...

    def is_boundary(self, position: int) -> bool: ...

    async def append(
        self,
        messages: list[bytes],
        meta: StreamMeta,
        producer: tuple[str, ProducerState] | None,
    ) -> int:
        """Store messages with the metadata and producer state they bring; returns the new tail."""
        ...

    async def save_meta(self, meta: StreamMeta) -> None: ...


class Storage(Protocol):
    def open(self, name: str) -> StreamLog | None: ...

    async def create(self, meta: StreamMeta, messages: list[bytes]) -> StreamLog: ...

    async def delete(self, name: str) -> None: ...

    def names(self) -> list[str]: ...
