"""Failures of the server's background work and storage, by kind: each logged once until it
clears, counted for /stats.

A full disk fails every append and an unreachable bucket every upload; one log line says so (and
one more when it recovers), not one per request or per retry, and `/stats` shows the counts, the
last error of each kind and what is failing now.
"""

from __future__ import annotations

import logging

log = logging.getLogger("streamkeep")


class Health:
    def __init__(self) -> None:
        self.failures: dict[str, int] = {}
        self.last_error: dict[str, str] = {}
        self._failing: set[str] = set()

    def failed(self, kind: str, error: str, *, traceback: BaseException | None = None) -> None:
        """Counts a failure of `kind`; logs it if `kind` was not already failing (with the
        traceback of `traceback`, for failures that are bugs rather than faults)."""
        self.failures[kind] = self.failures.get(kind, 0) + 1
        self.last_error[kind] = error
        if kind not in self._failing:
            self._failing.add(kind)
            log.error("%s failed: %s (logged once until it recovers)", kind, error, exc_info=traceback)

    def ok(self, kind: str) -> None:
        if kind in self._failing:
            self._failing.discard(kind)
            log.warning("%s recovered after %d failures in all", kind, self.failures.get(kind, 0))

    @property
    def failing(self) -> list[str]:
        return sorted(self._failing)

    def stats(self) -> dict:
        return {
            "failures": dict(self.failures),
            "failing": self.failing,
            "last_errors": dict(self.last_error),
        }
