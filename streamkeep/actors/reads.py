"""A read of a stream: the actor decides where it starts, its published bytes are read after.

The actor answers a read with a `ReadPlan` (a snapshot and a start) and moves on; the bytes it
points at never change once published, so they are read here, outside the actor, without holding
its mailbox. The request path and the live fan-out call `read`, never storage directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from streamkeep.actors.messages import Read
from streamkeep.actors.replies import StreamView
from streamkeep.actors.supervisor import Supervisor
from streamkeep.protocol.offsets import Offset
from streamkeep.storage import forks
from streamkeep.storage.errors import STORAGE_ERRORS, RetainedAway, as_protocol_error, below_floor

# A read from -1 restarts at most this often when retention drops its bytes under it.
ATTEMPTS = 8


@dataclass(frozen=True)
class ReadView:
    """One read of a stream: the messages from `start` up to `next_position`, and what to wait on."""

    view: StreamView
    start: int
    messages: list[bytes]
    next_position: int
    # Fires at the stream's next published change after this read: what live readers wait on.
    changed: trio.Event

    @property
    def at_tail(self) -> bool:
        return self.next_position >= self.view.tail


async def read(
    supervisor: Supervisor, name: str, start: Offset | str, chunk_bytes: int, *, touch: bool = True
) -> ReadView:
    """Up to `chunk_bytes` of `name` from `start` (an offset, "-1" or "now")."""
    # A read from -1 whose bytes retention drops under it starts again at the new floor (it
    # asked for the earliest data, not for an offset): the floor only rises, so this ends.
    for attempt in range(ATTEMPTS):
        plan = await supervisor.call(name, Read(start, touch))
        view = plan.view
        if plan.start >= view.tail:
            return ReadView(view, plan.start, [], view.tail, plan.changed)
        try:
            result = await forks.read_range(
                supervisor.storage, plan.log, plan.start, chunk_bytes, whole_messages=view.meta.json_mode
            )
        except RetainedAway:
            if start == "-1" and attempt < ATTEMPTS - 1:
                continue
            # Dropped under the read (maybe in a fork's source): where this stream can resume.
            floor = forks.readable_from(supervisor.storage, plan.log)
            raise below_floor(floor, view.meta.incarnation) from None
        except STORAGE_ERRORS as error:
            raise as_protocol_error(error, name) from None
        return ReadView(view, plan.start, result.messages, result.next_position, plan.changed)
    raise AssertionError("unreachable")  # the last attempt returns or raises


__all__ = ["ReadView", "read"]
