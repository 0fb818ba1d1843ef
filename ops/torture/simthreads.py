"""A deterministic `trio.to_thread.run_sync`, and how to make a whole trio run replay from one seed.

A run replays exactly when nothing in it depends on the world:

1. The clock: `trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))`. Time moves only
   when every task waits, straight to the next deadline, so timeouts are exact and instant.
2. trio's scheduler: it shuffles each batch of runnable tasks with `trio._core._run._r`; seed it.
3. Threads: `SimThreads.run_sync` runs `fn` synchronously in the calling task, between a seeded
   number of checkpoints and mock-time sleeps, so "thread" work interleaves with the other tasks in
   a way that differs between seeds and never within one. `charge(seconds)`, called by `fn`,
   makes the call take that much mock time (a slow disk or S3).
4. The server's own randomness and clocks: `time.time` and `time.monotonic` (here they follow the
   mock clock), `uuid.uuid4`, the `random` module, `secrets`, `os.urandom`.
5. `PYTHONHASHSEED`: the iteration order of sets of str depends on it. A torture script calls
   `reexec_with_hash_seed()` first thing; it re-executes the interpreter with the seed fixed.

`deterministic(seed)` does 2-4 for the duration of a `with` block and restores everything after.
It patches module attributes, so it reaches code that calls `time.time()` or
`trio.to_thread.run_sync(...)` through the module, not names imported with `from x import y`.
"""

from __future__ import annotations

import os
import random
import secrets
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import trio
import trio.testing

T = TypeVar("T")

EPOCH = 1_700_000_000.0  # what time.time() says at mock time 0

_charged: ContextVar[list[float] | None] = ContextVar("simthreads_charged", default=None)


def charge(seconds: float) -> None:
    """Called from work running in `SimThreads.run_sync`: the call takes `seconds` more mock time
    (applied after the work, before its result reaches the caller)."""
    box = _charged.get()
    if box is None:
        raise RuntimeError("simthreads.charge() outside SimThreads.run_sync")
    box.append(seconds)


class SimThreads:
    """`run_sync` has trio.to_thread.run_sync's signature and cancellation rules: cancellable until
    the "thread" starts, then not (unless abandon_on_cancel, when the wait for the result is)."""

    def __init__(self, rng: random.Random, max_checkpoints: int = 3, max_delay: float = 0.001) -> None:
        self.rng = rng
        self.max_checkpoints = max_checkpoints
        self.max_delay = max_delay
        self.calls = 0

    async def run_sync(
        self,
        fn: Callable[..., T],
        *args: Any,
        thread_name: str | None = None,
        abandon_on_cancel: bool = False,
        limiter: trio.CapacityLimiter | None = None,
    ) -> T:
        limiter = limiter or trio.to_thread.current_default_thread_limiter()
        placeholder = object()  # trio acquires on behalf of the thread, not the task
        await limiter.acquire_on_behalf_of(placeholder)  # a checkpoint: cancellable
        try:
            self.calls += 1
            with trio.CancelScope(shield=True):
                await self._jitter()  # the thread starting
            box: list[float] = []
            token = _charged.set(box)
            try:
                result = fn(*args)
            except BaseException as error:  # delivered after the jitter, as a thread's would be
                failure: BaseException | None = error
            else:
                failure = None
            finally:
                _charged.reset(token)
            with trio.CancelScope(shield=not abandon_on_cancel):
                if box:
                    await trio.sleep(sum(box))
                await self._jitter()  # the result coming back
        finally:
            limiter.release_on_behalf_of(placeholder)
        if failure is not None:
            raise failure
        return result

    async def _jitter(self) -> None:
        for _ in range(self.rng.randint(0, self.max_checkpoints)):
            await trio.lowlevel.checkpoint()
        if self.max_delay and self.rng.random() < 0.5:
            await trio.sleep(self.rng.uniform(0, self.max_delay))


@dataclass
class Determinism:
    seed: int | str
    threads: SimThreads

    def rng(self, purpose: str) -> random.Random:
        """An independent stream per purpose, so adding draws to one does not shift the others."""
        return seeded(self.seed, purpose)


def seeded(seed: int | str, purpose: str) -> random.Random:
    return random.Random(f"{seed}/{purpose}")  # str seeds hash with sha512: no PYTHONHASHSEED


def _now() -> float:
    try:
        return EPOCH + trio.current_time()
    except RuntimeError:  # outside a trio run
        return EPOCH


@contextmanager
def deterministic(seed: int | str, *, threads: bool = True) -> Iterator[Determinism]:
    """Seeds trio's scheduler and `random`, and patches time.time (EPOCH + mock time),
    time.monotonic (mock time), uuid.uuid4, secrets, os.urandom and (if `threads`)
    trio.to_thread.run_sync; restores all on exit."""
    from trio._core import _run

    sim = Determinism(seed, SimThreads(seeded(seed, "threads")))
    ids, token_bytes, urandom, secret = (
        seeded(seed, p) for p in ("uuid", "secrets", "urandom", "secret-choices")
    )
    patches: list[tuple[Any, str, Any]] = [
        (time, "time", _now),
        (time, "time_ns", lambda: int(_now() * 1e9)),
        (time, "monotonic", lambda: _now() - EPOCH),  # not perf_counter: trio's SystemClock reads it
        (uuid, "uuid4", lambda: uuid.UUID(int=ids.getrandbits(128), version=4)),
        (secrets, "token_bytes", lambda nbytes=None: token_bytes.randbytes(32 if nbytes is None else nbytes)),
        (secrets, "randbits", secret.getrandbits),
        (secrets, "randbelow", secret.randrange),
        (secrets, "choice", secret.choice),
        (os, "urandom", urandom.randbytes),
    ]
    if threads:
        patches.append((trio.to_thread, "run_sync", sim.threads.run_sync))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    scheduler_state, random_state = _run._r.getstate(), random.getstate()
    ordered = _run._ALLOW_DETERMINISTIC_SCHEDULING
    try:
        # Trio orders each batch of runnable tasks by creation before its seeded shuffle (what it
        # does under Hypothesis); left alone, a batch comes in the order of sets of tasks, that
        # is of memory addresses, which an earlier seed in the same process changes.
        _run._ALLOW_DETERMINISTIC_SCHEDULING = True
        _run._r.seed(f"{seed}/trio-scheduler")
        random.seed(f"{seed}/random")
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield sim
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        _run._r.setstate(scheduler_state)
        _run._ALLOW_DETERMINISTIC_SCHEDULING = ordered
        random.setstate(random_state)


def reexec_with_hash_seed(value: str = "0") -> None:
    """Fixes PYTHONHASHSEED by re-executing this interpreter with the same arguments (once)."""
    if os.environ.get("PYTHONHASHSEED") == value:
        return
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "PYTHONHASHSEED": value})


def mock_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)
