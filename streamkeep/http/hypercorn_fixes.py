"""Four patches to hypercorn 0.18 for the `--edge quart` edge: three guards so that no client can
take the server down, and reason phrases on HTTP/1.1 status lines.

1. HTTP/2 DATA for a stream whose response already went out (we answered 413 before the body
   finished) raises KeyError in `H2Protocol._handle_events` (hypercorn issues #161/#197; PR #365
   unmerged). The error escapes the connection task and ends the whole trio worker. We drop such
   DATA but still return its flow-control credit, so the connection keeps working.
2. Any other exception inside one connection is logged and ends that connection only, instead of
   propagating into the server nursery.
3. `TCPServer._close` calls `send_eof()` outside the connection's send lock, and trio's
   `send_eof` checkpoints inside its conflict detector, so a response being sent at that moment
   fails with BusyResourceError ("Error in ASGI Framework") and is lost. We take the lock first.
4. HTTP/1.1 status lines get their reason phrase (`204 No Content`, not `204 `) from the table the
   lean edge uses too (reasons.py).
"""

from __future__ import annotations

import logging

import h2.events
import h2.exceptions
import h11
import trio
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.typing import H11SendableEvent

from streamkeep.http.reasons import reason

log = logging.getLogger(__name__)
_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    _applied = True
    original_handle_events = H2Protocol._handle_events
    original_run = TCPServer.run
    original_send_h11_event = H11Protocol._send_h11_event
    original_close = TCPServer._close

    async def handle_events(self: H2Protocol, events: list[h2.events.Event]) -> None:
        # One event at a time: a batch can hold a stream's HEADERS and then its DATA, and the
        # stream only exists after the HEADERS are handled.
        dropped = False
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                _discard(self, event)
                dropped = True
                continue
            await original_handle_events(self, [event])
        if dropped:
            await self._flush()  # send the WINDOW_UPDATE now, or the client stalls

    async def guarded_run(self: TCPServer) -> None:
        try:
            await original_run(self)
        except Exception:
            log.exception("a connection failed inside hypercorn; closing it and serving on")
            try:
                await self.stream.aclose()
            except Exception:
                pass

    async def send_h11_event_with_reason(self: H11Protocol, event: H11SendableEvent) -> None:
        if isinstance(event, h11.Response | h11.InformationalResponse) and not event.reason:
            event = type(event)(
                status_code=event.status_code, headers=event.headers, reason=reason(event.status_code)
            )
        await original_send_h11_event(self, event)

    async def close_under_send_lock(self: TCPServer) -> None:
        # protocol_send() may reach _close() while holding the lock itself; trio locks are not
        # reentrant, so only take it when another task (or none) holds it.
        if self.send_lock.statistics().owner is trio.lowlevel.current_task():
            await original_close(self)
        else:
            async with self.send_lock:
                await original_close(self)

    TCPServer._close = close_under_send_lock  # type: ignore[method-assign]
    H11Protocol._send_h11_event = send_h11_event_with_reason  # type: ignore[method-assign]
    H2Protocol._handle_events = handle_events  # type: ignore[method-assign]
    TCPServer.run = guarded_run  # type: ignore[method-assign]


def _discard(protocol: H2Protocol, event: h2.events.DataReceived) -> None:
    """Drop DATA for an answered stream but grant its credit: clients such as httpx send the
    whole body before reading the answer, and stall if the window never reopens. (Resetting the
    stream with NO_ERROR, as RFC 9113 allows, leaves httpx hanging, so we drain instead.)"""
    try:
        protocol.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
    except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
        pass
