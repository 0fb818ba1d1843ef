"""Background loops that never end the server.

Every long-running task the server starts (the committer, the archiver, interval syncs, the TTL
sweep, subscription drivers) runs under `supervised`: if it raises, the failure is logged once per
cause with its traceback, counted in the `Health` that `/stats` shows, and the loop starts again
after a backoff of 1 s doubling to 60 s. Only a cancellation (shutdown) ends it.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

import trio

from streamkeep.health import Health

MIN_BACKOFF = 1.0
MAX_BACKOFF = 60.0


async def supervised(name: str, loop: Callable[[], Awaitable[object]], health: Health) -> None:
    delay = MIN_BACKOFF
    while True:
        started = trio.current_time()
        try:
            await loop()
            return  # a loop that returns has finished its work
        except Exception as error:
            health.failed(f"{name} ({type(error).__name__})", f"{error!r}; restarting it", traceback=error)
        if trio.current_time() - started > MAX_BACKOFF:
            delay = MIN_BACKOFF  # it ran well for a while: this is a new failure, not a crash loop
        await trio.sleep(delay * random.uniform(0.8, 1.2))
        delay = min(MAX_BACKOFF, delay * 2)
