"""Append quotas: per-subject token buckets on appends and on bytes, answering "not yet, retry
in N seconds" instead of letting one client fill the disk or starve the others.

Each subject (a token's `sub`) has a bucket per limit holding up to `burst_seconds` worth of its
rate, refilled continuously. A request takes one append and its size in bytes, and is refused
whole if either bucket is short, so refusals charge nothing. A request bigger than the whole
byte burst could never fit; rather than refusing it forever, it passes when the bucket is full
and leaves it in debt, which the following requests wait out.

Subjects are whoever the issuer mints tokens for, so their number is bounded here: past
`max_subjects`, buckets that are full again (idle subjects, who lose nothing by being forgotten)
are dropped, least recently used first.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# Refill arithmetic in floats can land a hair below a whole token; this keeps "exactly enough" enough.
_EPSILON = 1e-9


class _Bucket:
    __slots__ = ("appends", "bytes", "updated")

    def __init__(self, appends: float, size: float, updated: float) -> None:
        self.appends = appends
        self.bytes = size
        self.updated = updated


class Quotas:
    """Limits appends per second and bytes per second for each subject. A rate of None (or 0,
    as the config spells "no limit") leaves that dimension unlimited."""

    def __init__(
        self,
        *,
        appends_per_second: float | None,
        bytes_per_second: float | None,
        burst_seconds: float = 2.0,
        max_subjects: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for label, rate in (
            ("appends_per_second", appends_per_second),
            ("bytes_per_second", bytes_per_second),
        ):
            if rate is not None and rate < 0:
                raise ValueError(f"{label} must be positive (or None for no limit), not {rate}")
        if burst_seconds <= 0:
            raise ValueError(f"burst_seconds must be positive, not {burst_seconds}")
        if max_subjects < 1:
            raise ValueError(f"max_subjects must be at least 1, not {max_subjects}")
        self._append_rate = appends_per_second or None
        self._byte_rate = bytes_per_second or None
        # At least one whole append (and byte) fits, whatever the rate: else nothing ever would.
        self._append_burst = max(1.0, (self._append_rate or 0) * burst_seconds)
        self._byte_burst = max(1.0, (self._byte_rate or 0) * burst_seconds)
        self._max_subjects = max_subjects
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}  # least recently charged first
        self.allowed = 0
        self.refused = 0
        self.evicted = 0

    @property
    def enabled(self) -> bool:
        return self._append_rate is not None or self._byte_rate is not None

    def charge(self, subject: str, size: int) -> float | None:
        """Charges one append of `size` bytes to `subject`: None if allowed, else the seconds
        until it would be (the caller rounds up for Retry-After); a refusal charges nothing."""
        if not self.enabled:
            return None
        if size < 0:
            raise ValueError(f"size must not be negative, not {size}")
        now = self._clock()
        bucket = self._buckets.pop(subject, None)
        if bucket is None:
            if len(self._buckets) >= self._max_subjects:
                self._evict(now)
            bucket = _Bucket(self._append_burst, self._byte_burst, now)
        else:
            self._refill(bucket, now)
        self._buckets[subject] = bucket  # to the end: the most recently used
        wait = 0.0
        if self._append_rate is not None and bucket.appends < 1 - _EPSILON:
            wait = (1 - bucket.appends) / self._append_rate
        if self._byte_rate is not None:
            needed = min(size, self._byte_burst)  # a full bucket lets any size through, into debt
            if bucket.bytes < needed - _EPSILON:
                wait = max(wait, (needed - bucket.bytes) / self._byte_rate)
        if wait > 0:
            self.refused += 1
            return wait
        if self._append_rate is not None:
            bucket.appends -= 1
        if self._byte_rate is not None:
            bucket.bytes -= size
        self.allowed += 1
        return None

    def _refill(self, bucket: _Bucket, now: float) -> None:
        elapsed = max(0.0, now - bucket.updated)  # a clock that steps back refills nothing
        if self._append_rate is not None:
            bucket.appends = min(self._append_burst, bucket.appends + elapsed * self._append_rate)
        if self._byte_rate is not None:
            bucket.bytes = min(self._byte_burst, bucket.bytes + elapsed * self._byte_rate)
        bucket.updated = now

    def _is_full(self, bucket: _Bucket, now: float) -> bool:
        self._refill(bucket, now)
        return bucket.appends >= self._append_burst - _EPSILON and bucket.bytes >= self._byte_burst - _EPSILON

    def _evict(self, now: float) -> None:
        # Free a tenth at once, so the scan runs once per max_subjects/10 new subjects, not per one.
        excess = len(self._buckets) - (self._max_subjects - max(1, self._max_subjects // 10))
        victims: list[str] = []
        for subject, bucket in self._buckets.items():
            if len(victims) >= excess:
                break
            if self._is_full(bucket, now):
                victims.append(subject)
        if len(victims) < excess:
            # Every subject is busy: memory stays bounded anyway, and the least recently active
            # are forgotten, which forgives them at most one burst.
            chosen = set(victims)
            for subject in self._buckets:
                if len(victims) >= excess:
                    break
                if subject not in chosen:
                    victims.append(subject)
        for subject in victims:
            del self._buckets[subject]
        self.evicted += len(victims)

    def stats(self) -> dict[str, object]:
        return {
            "enabled": self.enabled,
            "appends_per_second": self._append_rate,
            "bytes_per_second": self._byte_rate,
            "subjects": len(self._buckets),
            "allowed": self.allowed,
            "refused": self.refused,
            "evicted": self.evicted,
        }
