"""Counts of every request by method, route kind, status and HTTP version, with latencies per
route kind, and the bytes that moved; plus the access log line, written for the same call.

`RequestStats.finish` runs once per request on the event loop (for a streaming response, when the
stream ends), so it is kept to dictionary increments and one histogram observation.
"""

from __future__ import annotations

import time
from collections import Counter

from streamkeep.telemetry.accesslog import AccessLog
from streamkeep.telemetry.histogram import Histogram


class RequestStats:
    def __init__(self, access_log: AccessLog | None = None) -> None:
        self.requests: Counter[tuple[str, str, int, str]] = Counter()
        self.latency: dict[tuple[str, str], Histogram] = {}
        self.bytes_out: Counter[str] = Counter()  # response body bytes by route kind
        self.access_log = access_log

    def finish(
        self,
        *,
        method: str,
        route: str,
        status: int,
        http_version: str,
        started: float,
        sent: int,
        client: str,
        target: str,
        subject: str | None,
    ) -> None:
        seconds = time.perf_counter() - started
        if method not in _METHODS:
            method = "other"  # a label per junk method would let a client grow the series
        self.requests[(method, route, status, http_version)] += 1
        key = (route, http_version)
        histogram = self.latency.get(key)
        if histogram is None:
            histogram = self.latency[key] = Histogram()
        histogram.observe(seconds)
        if sent:
            self.bytes_out[route] += sent
        if self.access_log is not None:
            self.access_log.request(
                client=client,
                subject=subject,
                method=method,
                target=target,
                http_version=http_version,
                status=status,
                sent=sent,
                seconds=seconds,
            )


_METHODS = frozenset(("GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS"))
