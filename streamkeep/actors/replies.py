"""What a stream's actor answers: values read after the actor moved on to its next message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import trio

from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.stream import AppendOutcome, StreamMeta
from streamkeep.storage.base import Commit, StreamLog
from streamkeep.storage.errors import STORAGE_ERRORS, as_protocol_error


@dataclass(slots=True)  # not frozen: built per request, where frozen's __init__ costs ~1 us
class StreamView:
    """A stream's published state at one moment, for a response built after the actor moved on."""

    meta: StreamMeta
    tail: int
    floor: int = 0  # the earliest position readers may ask for (retention moves it up)


@dataclass(slots=True)  # not frozen: built per request, where frozen's __init__ costs ~1 us
class ReadPlan:
    """Where a read starts, against a snapshot; the bytes are read outside the actor."""

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


class SnapshotLog(StreamLog, Protocol):
    """A log that can take a snapshot: only disk storage's can (its floor moves up to it)."""

    async def drain(self) -> None: ...

    async def fresh_segment(self) -> int: ...

    async def raise_floor(self, new_floor: int, snapshot_end: int | None = None) -> bool: ...


@dataclass(slots=True)
class Snapshot:
    """Compaction's last step, done: the snapshot starts at `start` and is durable once `commit` is."""

    commit: Commit
    start: int
    log: SnapshotLog
