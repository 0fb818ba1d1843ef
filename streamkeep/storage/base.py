"""The storage interface the actors program against (memory and disk storage implement it).

A `StreamLog` is one stream's state. It keeps two views of it:

- the *accepted* state (`meta`, `producers`, `tail`): every append the actor has sequenced,
  including ones still being written. The actor decides new appends against it.
- the *published* state (`published_tail`, `published_closed`): what is durable. Readers and
  live subscribers see only this, so a crash can never take back bytes a reader saw.

`submit` hands an append to the log without waiting; its `Commit` resolves once the append is
durable (or written, under a relaxed fsync policy), and the log then calls `on_publish`. If a write
fails, that commit and every later one fail and the accepted state falls back to the published one.
Only the stream's actor calls the mutating methods, so logs need no locks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import trio

from streamkeep.protocol.stream import ForkSource, ForkSpec, ProducerState, StreamMeta
from streamkeep.storage.errors import StorageFull


class ByteBudget:
    """Per-stream and total byte caps, shared by all logs of one storage."""

    def __init__(self, *, max_stream_bytes: int, max_total_bytes: int) -> None:
        self.max_stream_bytes = max_stream_bytes
        self.max_total_bytes = max_total_bytes
        self.total_bytes = 0

    def reserve(self, stream_bytes: int, added: int) -> None:
        if stream_bytes + added > self.max_stream_bytes:
            raise StorageFull(
                f"the stream would pass its cap of {self.max_stream_bytes} bytes", per_stream=True
            )
        if self.total_bytes + added > self.max_total_bytes:
            raise StorageFull(
                f"the server would pass its storage cap of {self.max_total_bytes} bytes", per_stream=False
            )
        self.total_bytes += added

    def release(self, amount: int) -> None:
        self.total_bytes -= amount


class Commit:
    """Resolves with the stream's new tail once an append is published, or fails."""

    __slots__ = ("_error", "_event", "done", "tail")

    def __init__(self) -> None:
        self.done = False
        # Made only when someone waits before the commit is done: most in-memory commits are
        # done when made, and a trio.Event per append cost ~1 us.
        self._event: trio.Event | None = None
        self._error: Exception | None = None
        self.tail = 0

    def resolve(self, tail: int) -> None:
        self.tail = tail
        self._settle()

    def fail(self, error: Exception) -> None:
        self._error = error
        self._settle()

    def _settle(self) -> None:
        self.done = True
        if self._event is not None:
            self._event.set()

    async def settled(self) -> None:
        """Waits until the commit resolved or failed, without raising (a checkpoint either way)."""
        if self.done:
            await trio.lowlevel.checkpoint()
            return
        if self._event is None:
            self._event = trio.Event()
        await self._event.wait()

    async def wait(self) -> int:
        await self.settled()
        return self.result()

    def result(self) -> int:
        """The new tail of a commit that is `done` (raises its error if it failed)."""
        if self._error is not None:
            raise self._error
        return self.tail


def resolved(tail: int) -> Commit:
    commit = Commit()
    commit.resolve(tail)
    return commit


@dataclass(frozen=True)
class ReadResult:
    messages: list[bytes]
    next_position: int


@dataclass(slots=True)  # not frozen: built per request, where frozen's __init__ costs ~1 us
class AppendRecord:
    """What one accepted append writes, all in one atomic record."""

    messages: list[bytes]
    # The accepted metadata after this append (closed flag, Stream-Seq): a copy the log may keep.
    meta: StreamMeta
    producer: tuple[str, ProducerState] | None
    closes: bool
    stream_seq: str | None


class StreamLog(Protocol):
    meta: StreamMeta
    producers: dict[str, ProducerState]
    on_publish: Callable[[], None] | None

    @property
    def tail(self) -> int: ...

    @property
    def published_tail(self) -> int: ...

    @property
    def published_closed(self) -> bool: ...

    # Readers see nothing before it (410); `fork_base` until retention moves it (disk storage).
    floor: int

    @property
    def pending(self) -> int:
        """Appends submitted but not yet published."""
        ...

    def is_boundary(self, position: int) -> bool:
        """Whether `position` (at or past this log's fork base) starts a message."""
        ...

    def next_append_end(self, position: int) -> int | None:
        """Where the append holding `position` ends, or None past the published tail."""
        ...

    async def read(self, start: int, max_bytes: int, *, whole_messages: bool) -> ReadResult:
        """Published messages from `start` until about `max_bytes`, at least one; byte streams
        (`whole_messages=False`) may be cut anywhere, JSON messages never."""
        ...

    def submit(self, record: AppendRecord) -> Commit:
        """Accepts an append (raises StorageFull at once for caps); the Commit tracks durability."""
        ...

    def latest_commit(self) -> Commit:
        """Resolves when everything submitted so far is published (for duplicates to wait on)."""
        ...

    async def make_durable(self) -> None:
        """Makes everything published durable. Under a relaxed fsync policy published bytes may
        not be yet; something that must outlive a power cut built on them (a fork point) asks."""
        ...


class RemoteSources(Protocol):
    """Fork sources another cluster member owns (streamkeep/cluster/forks.py implements it)."""

    def elsewhere(self, name: str) -> bool: ...

    async def read_range(
        self, name: str, start: int, max_bytes: int, *, whole_messages: bool, limit: int
    ) -> ReadResult:
        """`forks.read_range` of stream `name`, run by its owner (its own chain included)."""
        ...

    async def probe(self, name: str, position: int) -> tuple[bool, int | None]:
        """Whether `position` starts a message of `name`, and where the append holding it ends."""
        ...

    async def attach(
        self, fork: ForkSpec, content_type: str | None, *, fork_name: str, pin: str
    ) -> ForkSource:
        """The source's `attach_fork`, run by its owner, which saves a pin for the fork first."""
        ...

    async def detach(self, source: str, pin: str) -> None:
        """The source's `detach_fork` for the fork whose stream id is `pin`."""
        ...

    def attaching(self, pin: str) -> AbstractContextManager[None]:
        """Marks a fork create in progress, so the source's reconcile does not drop its new pin."""
        ...


class Storage(Protocol):
    budget: ByteBudget
    # In a cluster: how this member reaches fork sources the others own (None: every source is here).
    remote: RemoteSources | None

    def open(self, name: str) -> StreamLog | None:
        """The stream, or None. Disk storage serving before it read everything reads the stream
        now if it is not read yet, and raises ProtocolError (503) if that read fails."""
        ...

    async def recovered(self) -> None:
        """Returns once every stream found at start is read (at once for memory storage)."""
        ...

    def still_reading(self) -> Exception:
        """What to answer a request that waited too long for `recovered`."""
        ...

    async def create(self, meta: StreamMeta, messages: list[bytes]) -> StreamLog:
        """A new stream whose own data starts at `meta.fork_base` (0 unless it is a fork)."""
        ...

    async def delete(self, name: str) -> None: ...

    async def save_meta(self, name: str, meta: StreamMeta) -> None:
        """Persists a changed stream configuration (today: the soft-deleted flag) atomically."""
        ...

    def names(self) -> list[str]:
        """Every stream's name, read yet or not."""
        ...

    def logs(self) -> Sequence[StreamLog]:
        """The streams read so far: all of them unless `unread()`."""
        ...

    def unread(self) -> int:
        """How many streams found at start are not read yet (disk storage serving early)."""
        ...

    def idle(self, name: str) -> None:
        """The stream's actor hibernated: give back what only an active stream needs (its
        `on_publish`, which holds the ended actor's state; on disk the active segment's
        descriptor). The next actor sets `on_publish` again. Synchronous, and never fails."""
        ...
