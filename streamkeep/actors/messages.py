"""The messages a stream's actor takes, one class per operation, each typed by its answer.

`supervisor.call(name, Append(spec))` answers a `PendingAppend`: the actor finds the handler by
the message's class (one dict lookup), so a message is a small slotted value built per request;
those without fields are module constants (`HEAD`, `DELETE`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from streamkeep.actors.replies import PendingAppend, ReadPlan, Snapshot, StreamView
from streamkeep.protocol.offsets import Offset
from streamkeep.protocol.state_fold import StateFold
from streamkeep.protocol.stream import AppendSpec, CreateSpec, ForkSource, ForkSpec

R = TypeVar("R", covariant=True)


class Ask(Generic[R]):
    """A message whose answer is an `R`."""

    __slots__ = ()


# Not frozen: built per request, where frozen's __init__ costs ~1 us.


@dataclass(slots=True)
class Create(Ask[tuple[int, StreamView]]):
    """Creates the stream, or finds it created alike: (201 or 200, its view); 409 if unlike."""

    spec: CreateSpec


@dataclass(slots=True)
class Append(Ask[PendingAppend]):
    spec: AppendSpec


@dataclass(slots=True)
class Read(Ask[ReadPlan]):
    """Where a read from `start` (an offset, or "-1"/"now") begins; `touch` counts as access for TTL."""

    start: Offset | str
    touch: bool = True


@dataclass(slots=True)
class Head(Ask[StreamView]):
    """The stream's published state (send the constant `HEAD`)."""


@dataclass(slots=True)
class Delete(Ask[None]):
    """Deletes the stream, or soft-deletes it while forks still read it (send `DELETE`)."""


@dataclass(slots=True)
class Compact(Ask[Snapshot]):
    """Compaction's last step (actors/folding.py `append_snapshot`): folds from `position` on
    and appends the snapshot in records of at most `chunk` bytes, if the stream is still the
    one with `stream_id`."""

    fold: StateFold
    position: int
    chunk: int
    stream_id: str


@dataclass(slots=True)
class AttachFork(Ask[ForkSource]):
    """To a fork's source: check the fork point and count the fork. `pin` (fork stream id, fork
    name) when the fork lives on another cluster member."""

    fork: ForkSpec
    content_type: str | None
    pin: tuple[str, str] | None = None


@dataclass(slots=True)
class DetachFork(Ask[None]):
    """To a fork's source: a fork is gone; `pin` names one another member owned."""

    pin: str | None = None


@dataclass(slots=True)
class RaisePin(Ask[None]):
    """To a fork's source: the pinned fork on another member reads from `low` up now."""

    pin: str
    low: int


HEAD = Head()
DELETE = Delete()
