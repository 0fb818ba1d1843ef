"""`/readyz`: whether this server should get traffic now, and if not, why.

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
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from streamkeep.storage import files

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
