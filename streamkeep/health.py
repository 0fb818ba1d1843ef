"""Failures told once per cause, and the failures of the server's background work and storage.

A full disk fails every append and an unreachable bucket every upload; one log line says so (and
one more when it recovers), not one per request or per retry. `Causes` is that rule, kept once
for everything that logs failures (`Health` here, the subscriptions' faults, the cluster's calls
between members); `Health` adds the counts, the last error of each kind and what is failing now,
for `/stats`.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Generic, TypeVar

log = logging.getLogger("streamkeep")

K = TypeVar("K", bound=Hashable)
C = TypeVar("C", bound=Hashable)


class Causes(Generic[K, C]):
    """What fails now (`K`: a task, a member, a subscription's step) and with which cause. The log
    hears of a cause when the first thing fails with it and once more when the last one stops,
    not at every retry nor for every thing failing alike. A cause that names its key (a member
    and why) is told per key."""

    __slots__ = ("_holders", "current")

    def __init__(self) -> None:
        self.current: dict[K, C] = {}  # read it, change it through the methods
        self._holders: dict[C, set[K]] = {}

    def failed(self, key: K, cause: C) -> bool:
        """`key` fails with `cause` now (whatever it failed with before is dropped quietly: call
        `cleared` first to hear of that). True when nothing failed with `cause`: tell it."""
        if key in self.current:
            if self.current[key] == cause:
                return False
            self._release(key, self.current[key])
        self.current[key] = cause
        holders = self._holders.setdefault(cause, set())
        holders.add(key)
        return len(holders) == 1

    def cleared(self, key: K) -> tuple[C] | None:
        """`key` works again. `(cause,)` when nothing fails with its cause any more (tell that it
        is over); None when it was not failing or others still fail with that cause."""
        if key not in self.current:
            return None
        cause = self.current.pop(key)
        return (cause,) if self._release(key, cause) else None

    def _release(self, key: K, cause: C) -> bool:
        """True if `key` was the last holder of `cause`."""
        holders = self._holders.get(cause)
        if holders is None:
            return False
        holders.discard(key)
        if holders:
            return False
        del self._holders[cause]
        return True


class Health:
    def __init__(self) -> None:
        self.failures: dict[str, int] = {}
        self.last_error: dict[str, str] = {}
        self._failing: Causes[str, str] = Causes()

    def failed(self, kind: str, error: str, *, traceback: BaseException | None = None) -> None:
        """Counts a failure of `kind`; logs it if `kind` was not already failing (with the
        traceback of `traceback`, for failures that are bugs rather than faults)."""
        self.failures[kind] = self.failures.get(kind, 0) + 1
        self.last_error[kind] = error
        if self._failing.failed(kind, kind):
            log.error("%s failed: %s (logged once until it recovers)", kind, error, exc_info=traceback)

    def ok(self, kind: str) -> None:
        # A dict lookup first: this runs after every commit.
        if kind in self._failing.current and self._failing.cleared(kind) is not None:
            log.warning("%s recovered after %d failures in all", kind, self.failures.get(kind, 0))

    @property
    def failing(self) -> list[str]:
        return sorted(self._failing.current)

    def stats(self) -> dict[str, object]:
        return {
            "failures": dict(self.failures),
            "failing": self.failing,
            "last_errors": dict(self.last_error),
        }
