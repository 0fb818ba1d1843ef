"""The probes and the server's own numbers: `/healthz`, `/readyz`, `/stats` and `/metrics`.

`/readyz`: whether this server should get traffic now, and if not, why.

The answer is public (a load balancer has no token), so reasons name what is wrong, never paths,
URLs or sizes: `/stats` (admin) and the log carry those.

Liveness (`/healthz`) only says the process answers. Ready means: recovery finished (the server
listens from the start, so a probe can tell a long recovery from a hang), the JWKS loaded when auth
needs one, and the data directory takes writes: a file can be created in it and its file system has
more free space than `--min-free-bytes` (below that, appends and creates get 507, so a load
balancer should send writers elsewhere). The disk check runs in a worker thread and is remembered
for a second, so a probe storm costs one check per second.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from streamkeep.actors.supervisor import Supervisor
from streamkeep.health import Health
from streamkeep.protocol.model import Response
from streamkeep.protocol.responses import json_response
from streamkeep.server.live import LiveReads
from streamkeep.storage import files

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PROBE_FILE = ".readyz-probe"
CHECK_EVERY = 1.0


class Readiness:
    def __init__(
        self,
        *,
        data_dir: Path | None,
        min_free_bytes: int,
        free_bytes: Callable[[Path], int] | None = None,
        jwks_loaded: Callable[[], str | None] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.min_free_bytes = min_free_bytes
        self._free_bytes = free_bytes or files.OS.free_bytes
        self._jwks_loaded = jwks_loaded
        self._checked_at = -float("inf")
        self._disk_reason: str | None = None

    async def __call__(self) -> str | None:
        """None when ready, else the reason (a sentence for the operator)."""
        if self._jwks_loaded is not None and (reason := self._jwks_loaded()) is not None:
            return reason
        if self.data_dir is None:
            return None
        now = trio.current_time()
        if now - self._checked_at >= CHECK_EVERY:
            self._checked_at = now
            self._disk_reason = await trio.to_thread.run_sync(self._check_disk)
        return self._disk_reason

    def _check_disk(self) -> str | None:
        assert self.data_dir is not None
        probe = self.data_dir / PROBE_FILE
        try:
            fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"ok")
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as error:
            return f"the data directory does not take writes ({error.strerror or error})"
        try:
            free = self._free_bytes(self.data_dir)
        except OSError as error:
            return f"cannot read the data directory's free space ({error.strerror or error})"
        if free < self.min_free_bytes:
            return "the data directory's free space is below --min-free-bytes: appends get 507 until space is freed"
        return None


ReadinessCheck = Callable[[], Awaitable[str | None]]
# The other parts' /stats sections (storage, cold tier, subscriptions...), by section name.
Sections = dict[str, Callable[[], dict[str, Any]]]


def alive() -> Response:
    """`/healthz`: the liveness probe, on the main port and the metrics port alike."""
    return Response(200, [("Content-Type", "text/plain"), ("Cache-Control", "no-store")], b"ok")


async def ready(not_ready: str | None, check: ReadinessCheck | None) -> Response:
    """`/readyz`: 200 when streams are served and `check` finds nothing wrong, else 503 and why."""
    reason = not_ready
    if reason is None and check is not None:
        reason = await check()
    if reason is not None:
        return json_response(503, {"ready": False, "reason": reason}, [("Retry-After", "1")])
    return json_response(200, {"ready": True})


def metrics(page: Callable[[], bytes]) -> Response:
    """`/metrics`: the Prometheus exposition."""
    return Response(200, [("Content-Type", METRICS_CONTENT_TYPE), ("Cache-Control", "no-store")], page())


class Stats:
    """`/stats`: the request path's own numbers, then each section the other parts registered."""

    def __init__(
        self,
        supervisor: Supervisor,
        requests_by_http_version: Counter[str],
        live: LiveReads,
        health: Health,
        sections: Sections,
    ) -> None:
        self.supervisor = supervisor
        self.requests_by_http_version = requests_by_http_version
        self.live = live
        self.health = health
        self.sections = sections

    def body(self, ready: bool) -> dict[str, object]:
        storage = self.supervisor.storage
        live = self.live
        body: dict[str, object] = {
            "ready": ready,
            "streams": len(storage.names()),
            "stored_bytes": storage.budget.total_bytes,
            "actors_active": self.supervisor.active,
            "actors_spawned": self.supervisor.spawned,
            "requests_by_http_version": dict(self.requests_by_http_version),
            "live_streams": len(live.streams),
            "live_readers": live.readers,
            "live_readers_by_mode": dict(live.readers_by_mode),
            "live_reads": dict(live.reads_by_kind, pushed=live.pushed()),
            "background": self.health.stats(),
        }
        for section, source in self.sections.items():
            body[section] = source()
        return body
