"""The TTL sweep: streams whose TTL or expiry passed are deleted even if nobody asks for them again.

A stream's actor deletes an expired stream when it is next asked anything; the sweep asks each
expired one for its head now and then, so their bytes do not wait for a client that never comes.
"""

from __future__ import annotations

import time

import trio

from streamkeep.actors.messages import HEAD
from streamkeep.actors.supervisor import SWEEP_SLICE, Supervisor
from streamkeep.protocol.errors import ProtocolError

SWEEP_INTERVAL = 10.0


async def sweep_expired(supervisor: Supervisor, interval: float = SWEEP_INTERVAL) -> None:
    await supervisor.storage.recovered()  # a sweep would read every stream on the event loop
    while True:
        await trio.sleep(interval)
        now = time.time()
        for seen, name in enumerate(supervisor.storage.names(), 1):
            stream_log = supervisor.storage.open(name)  # None if deleted since the list was made
            if stream_log is not None and stream_log.meta.expired(now):
                try:
                    await supervisor.call(name, HEAD)
                except ProtocolError:
                    pass
                await trio.lowlevel.checkpoint()  # a call may not yield (Supervisor.call)
            elif seen % SWEEP_SLICE == 0:
                await trio.lowlevel.checkpoint()


__all__ = ["SWEEP_INTERVAL", "SWEEP_SLICE", "sweep_expired"]
