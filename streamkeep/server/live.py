"""Live reads: long-poll and SSE, waiting outside the actor on the event it fires at each change.

Every live reader of a stream incarnation joins its `LiveStream` (server/fanout.py), which reads
each change once for all of them through the `Reads` this was built with.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import trio

from streamkeep.actors.reads import ReadView
from streamkeep.actors.supervisor import Supervisor
from streamkeep.protocol import offsets, responses, sse
from streamkeep.protocol.cursor import response_cursor
from streamkeep.protocol.errors import ProtocolError, not_found
from streamkeep.protocol.model import Framed, PushTarget, Request, Response, Tally
from streamkeep.protocol.offsets import Offset
from streamkeep.server.fanout import LiveStream, SharedChange, Spawn
from streamkeep.server.reads import Reads


class LiveReads:
    def __init__(
        self,
        supervisor: Supervisor,
        reads: Reads,
        *,
        long_poll_timeout: float,
        sse_close_after: float,
        window_bytes: int,
        spawn: Spawn | None,
    ) -> None:
        self.supervisor = supervisor
        self.reads = reads
        self.long_poll_timeout = long_poll_timeout
        self.sse_close_after = sse_close_after
        self.window_bytes = window_bytes
        # Where fan-out runs its push loops; without one, subscribers wake and send themselves.
        self.spawn = spawn
        self.stopping = False
        self.streams: dict[tuple[str, int], LiveStream] = {}
        self.readers_by_mode: Counter[str] = Counter()  # live readers now, by mode
        # How live readers got their data: one "shared" read served every reader of a change, "alone"
        # reads were a reader's own (catching up), "cached" re-polls needed no read at all.
        self.reads_by_kind: Counter[str] = Counter()

    def stop(self) -> None:
        """Ends live reads cleanly: long-polls answer 204, SSE streams finish their last event."""
        self.stopping = True
        for live in self.streams.values():
            live.wake_all()

    # ---- what /stats, /metrics and the admin API show -------------------------------------

    @property
    def readers(self) -> int:
        return sum(live.readers for live in self.streams.values())

    def pushed(self) -> int:
        """Changes written straight to parked subscribers, by streams gone and streams live."""
        return self.reads_by_kind["pushed"] + sum(live.pushes for live in self.streams.values())

    def readers_by_stream(self) -> Counter[str]:
        """Live readers (long-poll, SSE) now, by stream name."""
        counts: Counter[str] = Counter()
        for (name, _), live in self.streams.items():
            counts[name] += live.readers
        return counts

    # ---- the streams' shared state --------------------------------------------------------

    def _join(self, name: str, incarnation: int) -> LiveStream:
        """The shared state of one incarnation's live readers, kept while any reader is live. Keyed
        by incarnation too: a stream deleted and created again shares nothing with its predecessor."""
        key = (name, incarnation)
        live = self.streams.get(key)
        if live is None:
            live = self.streams[key] = LiveStream(
                lambda position: self._shared_read(name, offsets.Offset(incarnation, position)),
                self.window_bytes,
                self.spawn,
            )
        live.readers += 1
        return live

    def _leave(self, key: tuple[str, int], live: LiveStream) -> None:
        live.readers -= 1
        if live.readers == 0 and self.streams.get(key) is live:
            del self.streams[key]
            self.reads_by_kind["pushed"] += live.pushes

    async def _shared_read(self, name: str, start: Offset) -> ReadView:
        self.reads_by_kind["shared"] += 1
        return await self.reads.view(name, start)

    async def _alone_read(self, name: str, start: Offset | str) -> ReadView:
        self.reads_by_kind["alone"] += 1
        return await self.reads.view(name, start)

    async def _next_view(self, reader: _LiveReader, position: int) -> tuple[ReadView, SharedChange | None]:
        change = await reader.live.change_at(position)
        if change is not None:
            return change.view, change
        view = await self._alone_read(reader.name, offsets.Offset(reader.incarnation, position))
        reader.live.observe(view)
        return view, None

    # ---- long-poll ------------------------------------------------------------------------

    async def long_poll(
        self, name: str, start: Offset | str, cursor: str | None, request: Request
    ) -> Response:
        change = cached = None
        if isinstance(start, Offset) and start.incarnation != offsets.ANY_INCARNATION:
            known = self.streams.get((name, start.incarnation))
            if known is not None:
                change = known.kept(start.position)
                if change is None:
                    cached = known.unchanged_at(start.position)
        if change is not None:
            view = change.view
        elif cached is not None:
            view = cached  # a re-poll at the tail: nothing new, no need to ask the actor
            self.reads_by_kind["cached"] += 1
        else:
            view = await self._alone_read(name, start)
        with _LiveReader(self, name, view.view.meta.incarnation, "long-poll") as reader:
            live_now = reader.live
            reader.live.observe(view)
            position = view.start
            deadline = trio.current_time() + self.long_poll_timeout
            until = credential_deadline(request)
            if until is not None:  # a wait never outlives the token that allowed it
                deadline = min(deadline, until)
            while not view.messages:
                meta = view.view.meta
                if meta.closed or self.stopping or trio.current_time() >= deadline:
                    headers = [
                        ("Stream-Next-Offset", offsets.encode(view.view.tail, meta.incarnation)),
                        ("Stream-Up-To-Date", "true"),
                        ("Cache-Control", responses.NO_STORE),
                    ]
                    if meta.closed:
                        headers.append(("Stream-Closed", "true"))
                    else:
                        headers.append(("Stream-Cursor", response_cursor(cursor)))
                    return Response(204, headers)
                if not await reader.live.wait_beyond(position, deadline) or self.stopping:
                    continue  # timed out or stopping: answered at the top of the loop
                try:
                    view, change = await self._next_view(reader, position)
                except ProtocolError as error:
                    # The re-read carries this incarnation's token, which the client may never have
                    # sent (offset=now or -1). Past a tail it reached, it can only fail because the
                    # stream was deleted, expired or replaced during the wait: the stream waited on
                    # is gone, a 404, not a 400/410 about an offset the client did not ask for.
                    if error.code in ("offset_out_of_range", "offset_of_deleted_stream"):
                        raise not_found(name) from None
                    raise
        body = None
        up_to_date = None
        if change is not None:  # a shared read, maybe kept a while: at the tail only if nothing came since
            meta = view.view.meta
            body = change.encoded("body", lambda: responses.body_for(meta, view.messages))
            up_to_date = live_now.at_tail(view)
        return self.reads.data_response(
            view, start, request, cursor=response_cursor(cursor), body=body, up_to_date=up_to_date
        )

    # ---- SSE ------------------------------------------------------------------------------

    async def sse(
        self,
        name: str,
        start: Offset | str,
        cursor: str | None,
        push: PushTarget | None,
        until: float | None = None,
    ) -> Response:
        first = await self.reads.view(name, start)  # errors become plain HTTP errors, not events
        meta = first.view.meta
        base64_mode = responses.sse_uses_base64(meta)
        headers = [
            ("Content-Type", "text/event-stream"),
            ("Cache-Control", "no-cache"),
            ("X-Accel-Buffering", "no"),
        ]
        if base64_mode:
            headers.append(("Stream-SSE-Data-Encoding", "base64"))
        tally = Tally()
        events = self._sse_events(name, first, cursor, base64_mode, push, tally, until)
        return Response(200, headers, stream=events, tally=tally)

    async def _sse_events(
        self,
        name: str,
        view: ReadView,
        cursor: str | None,
        base64_mode: bool,
        push: PushTarget | None,
        tally: Tally,
        until: float | None = None,
    ) -> AsyncIterator[bytes]:
        close_at = trio.current_time() + self.sse_close_after
        if until is not None:  # the stream ends when the token or link that opened it expires
            close_at = min(close_at, until)
        change: SharedChange | None = None
        try:
            with _LiveReader(self, name, view.view.meta.incarnation, "sse") as reader:
                live = reader.live
                live.observe(view)
                sent_control = False
                while True:
                    meta = view.view.meta
                    closed_at_end = meta.closed and view.at_tail
                    if view.messages:
                        yield _sse_change(view, change, cursor, base64_mode, live)
                        sent_control = True
                    elif not sent_control or closed_at_end:
                        yield sse.control(
                            offsets.encode(view.next_position, meta.incarnation),
                            cursor=response_cursor(cursor),
                            up_to_date=True,
                            closed=closed_at_end,
                        )
                        sent_control = True
                    if closed_at_end:
                        return
                    position = view.next_position
                    if view.at_tail:
                        if self.stopping or trio.current_time() >= close_at:
                            return
                        deadline = min(close_at, trio.current_time() + self.long_poll_timeout)
                        if push is not None and live.can_push:
                            # Asleep while changes are written straight to this subscriber's socket.
                            parked = await live.park(
                                position, push, _push_frame(push, cursor, base64_mode, live), deadline
                            )
                            tally.pushed += parked.sent
                            if parked.leftover:
                                yield Framed(parked.leftover)
                            if parked.finished:
                                return
                            position, changed = parked.position, parked.woke
                        else:
                            changed = await live.wait_beyond(position, deadline)
                        if self.stopping or trio.current_time() >= close_at:
                            return
                        # A quiet spell gets a fresh control event: a keep-alive with a new cursor.
                        sent_control = changed
                    try:
                        view, change = await self._next_view(reader, position)
                    except ProtocolError:
                        return  # deleted, replaced or expired meanwhile: end; a reconnect gets the answer
        except ProtocolError:
            # Deleted between the first read and here (its actor gone, so no live reader can
            # join): end the stream; the reconnect gets the answer (torture sim seed 4140).
            return


def credential_deadline(request: Request) -> float | None:
    """When (trio clock) the credential behind `request` expires, if it does: live reads end
    then, and the client's reconnect needs a fresh one."""
    principal = request.principal
    expires_at: float | None = getattr(principal, "expires_at", None)
    if expires_at is None:
        return None
    return trio.current_time() + (expires_at - time.time())


class _LiveReader:
    """One live reader: keeps the stream's actor awake and its incarnation's `LiveStream` alive
    while it lasts.

    A slotted class rather than @contextmanager: 10,000 SSE subscribers each hold one for as long
    as they are connected, and a generator-based context manager costs ten times the memory.
    """

    __slots__ = ("awake", "incarnation", "live", "lives", "mode", "name")

    def __init__(self, lives: LiveReads, name: str, incarnation: int, mode: str) -> None:
        self.lives = lives
        self.name = name
        self.incarnation = incarnation
        self.mode = mode

    def __enter__(self) -> _LiveReader:
        self.awake = self.lives.supervisor.live_reader(self.name)
        self.awake.__enter__()
        self.live = self.lives._join(self.name, self.incarnation)
        self.lives.readers_by_mode[self.mode] += 1
        return self

    def __exit__(self, *_: object) -> None:
        self.awake.__exit__()
        self.lives._leave((self.name, self.incarnation), self.live)
        self.lives.readers_by_mode[self.mode] -= 1


def _sse_bytes(view: ReadView, fresh_cursor: str, base64_mode: bool, up_to_date: bool) -> bytes:
    """The events for one read: its data (if any) and the control event after it."""
    meta = view.view.meta
    control = sse.control(
        offsets.encode(view.next_position, meta.incarnation),
        cursor=fresh_cursor,
        up_to_date=up_to_date,
        closed=meta.closed and view.at_tail,
    )
    if not view.messages:
        return control
    payload = sse.data_payload(view.messages, json_mode=meta.json_mode, base64_mode=base64_mode)
    return sse.event("data", payload) + control


def _sse_change(
    view: ReadView, change: SharedChange | None, cursor: str | None, base64_mode: bool, live: LiveStream
) -> bytes:
    """A read's events; built once per change for all readers that share a cursor. A kept change
    may be long past: `upToDate` is what holds now (§5.8), so it is part of the key."""
    fresh = response_cursor(cursor)
    if change is None:
        return _sse_bytes(view, fresh, base64_mode, view.at_tail)
    now = live.at_tail(view)
    return change.encoded(("sse", base64_mode, fresh, now), lambda: _sse_bytes(view, fresh, base64_mode, now))


def _push_frame(
    push: PushTarget, cursor: str | None, base64_mode: bool, live: LiveStream
) -> Callable[[SharedChange], bytes]:
    """A parked subscriber's bytes for a change: the same object for every subscriber that shares
    the edge's framing, a cursor and whether the change still ends at the tail."""

    def frame(change: SharedChange) -> bytes:
        fresh = response_cursor(cursor)
        now = live.at_tail(change.view)
        return change.encoded(
            ("push", push.kind, base64_mode, fresh, now),
            lambda: push.frame(_sse_bytes(change.view, fresh, base64_mode, now)),
        )

    return frame


__all__ = ["LiveReads", "credential_deadline"]
