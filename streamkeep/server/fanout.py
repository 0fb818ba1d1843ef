"""Live readers of one stream share each change: one read and one encoding, whatever their number.

Without sharing, a change on a stream with N live readers (SSE subscribers, long-polls) costs N actor
messages, N storage reads and N encodings. A `LiveStream` exists while a stream has live readers. The
first reader to wake after a change reads the new bytes once (`change_at`); the others wait for that
read and take the same `SharedChange`, whose encoded forms (an SSE data event, a long-poll body) are built
once, on first use, and shared by reference.

A reader's own position decides everything, so nothing here can skip or repeat data: a reader whose
position is not the start of a kept change (it is catching up, or fell behind the kept window) reads
alone, by offset, exactly as a reconnecting client would. The window is bounded in bytes, so memory
does not grow with slow readers; what a slow reader holds is its socket buffer and one change.

Idle subscribers on an edge that can take pushed bytes (plain HTTP/1.1) go further: they park,
and one push loop per stream writes each change's framed bytes straight into every parked socket,
without waking a single subscriber task. A socket that takes only part of it gets its subscriber
woken with the rest, to send it the ordinary way; one that fails is dropped. So a change costs one
read, one encoding and one non-blocking write per subscriber.

No I/O here beyond the `fetch` callable and the writes of the edge's `PushTarget`s.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable

import trio

from streamkeep.actors.reads import ReadView
from streamkeep.protocol.model import PushTarget

log = logging.getLogger(__name__)

# The push loop lets other tasks run after this many writes, so 10,000 subscribers never hold the
# event loop (and the writer's next append) for the whole round.
PUSHES_PER_CHECKPOINT = 512


class SharedChange:
    """One change as every live reader sees it; encodings are built once, on first use."""

    __slots__ = ("_encoded", "size", "view")

    def __init__(self, view: ReadView) -> None:
        self.view = view
        self.size = sum(len(message) for message in view.messages)
        self._encoded: dict[object, bytes] = {}

    def encoded(self, key: object, build: Callable[[], bytes]) -> bytes:
        value = self._encoded.get(key)
        if value is None:
            value = self._encoded[key] = build()
        return value


Fetch = Callable[[int], Awaitable[ReadView]]
Spawn = Callable[[Callable[[], Awaitable[None]]], None]


class Parked:
    """An idle subscriber, its socket written to by the push loop while its task sleeps."""

    __slots__ = ("finished", "frame", "gone", "leftover", "position", "sent", "target", "wake", "woke")

    def __init__(self, position: int, target: PushTarget, frame: Callable[[SharedChange], bytes]) -> None:
        self.position = position  # advanced by every change pushed
        self.target = target
        self.frame = frame  # this subscriber's framed bytes for a change (shared through the change)
        self.wake = trio.Event()
        self.leftover = b""  # framed bytes the socket did not take; the subscriber sends them
        self.finished = False  # the stream's closing event was pushed; nothing more will come
        self.gone = False  # the subscriber left; never write to its socket again
        self.woke = False
        self.sent = 0  # bytes the push loop wrote to the socket (for the access log and metrics)


class LiveStream:
    def __init__(self, fetch: Fetch, window_bytes: int, spawn: Spawn | None = None) -> None:
        self._fetch = fetch
        self._spawn = spawn
        self._parked: dict[int, set[Parked]] = {}
        self._pushing: trio.CancelScope | None = None
        self.parked = 0  # subscribers asleep in park(), wherever the push loop has them
        self.pushes = 0
        self.pushed_bytes = 0
        self._window_bytes = window_bytes
        self._changes: deque[SharedChange] = deque()
        self._by_start: dict[int, SharedChange] = {}
        self._kept_bytes = 0
        self._fetching: trio.Event | None = None
        self._latest: ReadView | None = None  # the newest read we know of
        self.readers = 0
        self.fetches = 0

    @property
    def end(self) -> int:
        return -1 if self._latest is None else self._latest.next_position

    def observe(self, view: ReadView) -> None:
        """Adopts a reader's own read if it is newer than ours."""
        latest = self._latest
        if latest is None or view.next_position > latest.next_position:
            self._latest = view
        elif view.next_position == latest.next_position and latest.changed.is_set():
            self._latest = view

    def _quiet_at(self, position: int) -> ReadView | None:
        """Our last read, if it ended at the tail exactly at `position` and nothing is kept there:
        a reader at `position` has nothing to read until that read's `changed` fires."""
        latest = self._latest
        if latest is None or latest.next_position != position or not latest.at_tail:
            return None
        return None if position in self._by_start else latest

    def unchanged_at(self, position: int) -> ReadView | None:
        """A read at `position` answered without asking the actor: nothing new since our last read."""
        latest = self._quiet_at(position)
        if latest is None or latest.changed.is_set():
            return None
        if latest.view.meta.ttl_seconds is not None:
            return None  # reads extend a TTL; only the actor may record that
        return ReadView(latest.view, position, [], position, latest.changed)

    def at_tail(self, view: ReadView) -> bool:
        """Whether `view` still ends at the stream's tail: it did when it was read, it is our
        newest read, and nothing was published since (a kept change may be long past)."""
        latest = self._latest
        return (
            view.at_tail
            and latest is not None
            and latest.next_position == view.next_position
            and not latest.changed.is_set()
        )

    def kept(self, position: int) -> SharedChange | None:
        return self._by_start.get(position)

    async def wait_beyond(self, position: int, deadline: float) -> bool:
        """Waits until the stream changes past `position` or `deadline` passes; True if it changed."""
        latest = self._quiet_at(position)
        if latest is None:
            return True
        with trio.move_on_at(deadline):
            await latest.changed.wait()
            return True
        return False

    def wake_all(self) -> None:
        """Ends every wait at once (shutdown); readers then see the server is stopping."""
        if self._latest is not None:
            self._latest.changed.set()
        for records in self._parked.values():
            for record in records:
                record.wake.set()

    @property
    def can_push(self) -> bool:
        return self._spawn is not None

    async def park(
        self, position: int, target: PushTarget, frame: Callable[[SharedChange], bytes], deadline: float
    ) -> Parked:
        """Sleeps until `deadline` while changes are pushed to `target`, or until the subscriber
        must act: there is something to read or send itself, or the stream closed or went away.
        `woke` on the result is False only if the deadline passed."""
        record = Parked(position, target, frame)
        latest = self._quiet_at(position)
        if latest is None or latest.changed.is_set():
            record.woke = True  # there is something to read already
            return record
        self._parked.setdefault(position, set()).add(record)
        self.parked += 1
        if self._pushing is None:
            assert self._spawn is not None
            self._pushing = trio.CancelScope()
            self._spawn(self._push_loop)
        try:
            with trio.move_on_at(deadline):
                await record.wake.wait()
                record.woke = True
        finally:
            record.gone = True
            self.parked -= 1
            records = self._parked.get(record.position)
            if records is not None:
                records.discard(record)
                if not records:
                    del self._parked[record.position]
            if not self.parked and self._pushing is not None:
                self._pushing.cancel()
        return record

    async def _push_loop(self) -> None:
        scope = self._pushing
        assert scope is not None
        try:
            with scope:
                while self._parked:
                    pushed = False
                    for position in sorted(self._parked):
                        change = await self.change_at(position)
                        if change is None:
                            if position != self.end:
                                self._wake_at(position)  # behind the window: they read alone
                            continue
                        if change.view.messages or change.view.view.meta.closed:
                            await self._push(change)
                            pushed = True
                    if not pushed and self._parked and self._latest is not None:
                        await self._latest.changed.wait()
        except Exception as error:  # a failed read (deleted, storage down): subscribers see it themselves
            log.debug("push loop ended: %s", error)
            for position in list(self._parked):
                self._wake_at(position)
        finally:
            if self._pushing is scope:
                self._pushing = None
            if self._parked and self._pushing is None and self._spawn is not None:
                self._pushing = trio.CancelScope()
                self._spawn(self._push_loop)

    def _wake_at(self, position: int) -> None:
        for record in self._parked.pop(position, ()):
            record.wake.set()

    async def _push(self, change: SharedChange) -> None:
        records = self._parked.pop(change.view.start, set())
        end = change.view.next_position
        closing = change.view.view.meta.closed and change.view.at_tail
        moved = []
        for count, record in enumerate(records, 1):
            if record.gone:
                continue
            data = record.frame(change)
            try:
                written = record.target.write(data)
            except BlockingIOError:
                written = 0
            except OSError:
                record.wake.set()  # the peer is gone; its task finds out when it sends
                continue
            self.pushes += 1
            self.pushed_bytes += written
            record.sent += written
            record.position = end
            if written < len(data):
                record.leftover = data[written:]
                record.wake.set()
            elif closing:
                record.finished = True
                record.wake.set()
            else:
                moved.append(record)
            if count % PUSHES_PER_CHECKPOINT == 0:
                await trio.lowlevel.checkpoint()
        if moved:
            self._parked.setdefault(end, set()).update(record for record in moved if not record.gone)

    async def change_at(self, position: int) -> SharedChange | None:
        """The change starting at `position`, read once for every reader; None: read it alone."""
        while True:
            change = self._by_start.get(position)
            if change is not None:
                return change
            latest = self._latest
            if latest is None or position != latest.next_position:
                return None
            if self._fetching is not None:
                await self._fetching.wait()
                continue
            if latest.at_tail and not latest.changed.is_set():
                return None
            return await self._read_change(position)

    async def _read_change(self, position: int) -> SharedChange:
        fetching = self._fetching = trio.Event()
        try:
            view = await self._fetch(position)
            self.fetches += 1
        finally:
            self._fetching = None
            fetching.set()
        change = SharedChange(view)
        self.observe(view)
        if view.messages or (view.view.meta.closed and view.at_tail):
            # Kept only when it carries something: an empty read at an open tail (a spurious wake)
            # must not stand in for the data that arrives at that position later.
            self._keep(position, change)
        return change

    def _keep(self, position: int, change: SharedChange) -> None:
        self._changes.append(change)
        self._by_start[position] = change
        self._kept_bytes += change.size
        while len(self._changes) > 1 and self._kept_bytes > self._window_bytes:
            old = self._changes.popleft()
            self._kept_bytes -= old.size
            if self._by_start.get(old.view.start) is old:
                del self._by_start[old.view.start]


__all__ = ["Fetch", "LiveStream", "Parked", "SharedChange", "Spawn"]
