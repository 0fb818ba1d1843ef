"""Background loops that never end the server, and the one backoff every retry waits by.

Every long-running task the server starts (the committer, the archiver, interval syncs, the TTL
sweep, subscription drivers) runs under `supervised`: if it raises, the failure is logged once per
cause with its traceback, counted in the `Health` that `/stats` shows, and the loop starts again
after a backoff of 1 s doubling to 60 s. Only a cancellation (shutdown) ends it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import random
from collections.abc import Awaitable, Callable

import trio

from streamkeep.health import Health

MIN_BACKOFF = 1.0
MAX_BACKOFF = 60.0
# How often freed heap memory is handed back to the system (`MemoryGiveBack`).
TRIM_EVERY = 60.0


class Backoff:
    """Waits between retries: `first` seconds doubling up to `most`, each stretched or shrunk at
    random by up to `jitter` (a fraction) so that what failed together does not retry together.
    `failed()` counts a failure and returns the wait before the next try; `reset()` after one
    that worked. `delay(n)` is the wait after the n-th failure in a row, for callers that keep
    the count themselves (saved with a subscription, say)."""

    __slots__ = ("failures", "first", "jitter", "most")

    def __init__(self, first: float = MIN_BACKOFF, most: float = MAX_BACKOFF, *, jitter: float = 0.2) -> None:
        self.first = first
        self.most = most
        self.jitter = jitter
        self.failures = 0

    def delay(self, failures: int) -> float:
        # The exponent is capped: a count that grows for days must not overflow a float.
        wait = min(self.most, self.first * 2.0 ** min(max(failures, 1) - 1, 62))
        if self.jitter:
            wait *= random.uniform(1 - self.jitter, 1 + self.jitter)
        return wait

    def failed(self) -> float:
        self.failures += 1
        return self.delay(self.failures)

    def reset(self) -> None:
        self.failures = 0


async def supervised(name: str, loop: Callable[[], Awaitable[object]], health: Health) -> None:
    backoff = Backoff()
    while True:
        started = trio.current_time()
        try:
            await loop()
            return  # a loop that returns has finished its work
        except Exception as error:
            health.failed(f"{name} ({type(error).__name__})", f"{error!r}; restarting it", traceback=error)
        if trio.current_time() - started > MAX_BACKOFF:
            backoff.reset()  # it ran well for a while: this is a new failure, not a crash loop
        await trio.sleep(backoff.failed())


def malloc_trim() -> Callable[[], int] | None:
    """glibc's `malloc_trim(0)`, or None where the C library has none (musl, macOS).

    glibc keeps what Python frees in the middle of its heap (anything over 512 bytes: request
    bodies, reads, segment payloads) for reuse and never hands those pages back, so under churn a
    process's RSS ratchets up to each new peak of fragmentation and stays there, though the live
    memory is flat (under ops/soak.py's churn a trim every 20 s gave back 0.3-2.5 MiB each)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: int(trim(0))


class MemoryGiveBack:
    """Hands freed heap pages back to the system every `every` seconds, so a server that runs for
    months shows the memory it uses, not its worst moment's, and soon after `soon()`: when many
    streams went idle at once (the hibernation sweep says so), what they freed is given back then,
    not up to a minute later (100,000 streams: ~130 B per idle stream; issue 26). A trim runs on
    the event loop (2 ms on a heap that held 100,000 streams: not worth a thread); without glibc
    `run` returns at once."""

    def __init__(self, every: float = TRIM_EVERY) -> None:
        self.every = every
        self._wake = trio.Event()

    def soon(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        trim = malloc_trim()
        if trim is None:
            return
        while True:
            with trio.move_on_after(self.every):
                await self._wake.wait()
            self._wake = trio.Event()
            trim()
