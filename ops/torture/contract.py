"""What the server promises, as tables both torture tiers judge against.

- `STATUSES`: the statuses the protocol (`PROTOCOL.md`) names for each operation. Anything else is a
  finding; so is a 500 anywhere. `EXTENSIONS` lists the few statuses streamkeep adds on purpose,
  each with the reason, so the deviation is visible in one place.
- `FAULT_STATUSES`: 503 and 507 are never named per operation; they are allowed only while a fault
  could explain them (`fault_reason` says which fault an error body points at).
- `loss_window`: durability per `--fsync` mode. How much acknowledged data a fault may take back.
"""

from __future__ import annotations

import json
import math
import re

# ---- statuses ---------------------------------------------------------------------------------

# Per operation kind (the `op` of a history event), the statuses the spec names for it.
STATUSES: dict[str, frozenset[int]] = {
    # §5.1 (+ §4.2 for forks: 404 for a missing source, 409 for a soft-deleted source).
    "create": frozenset({200, 201, 400, 409, 429}),
    "fork": frozenset({200, 201, 400, 404, 409, 429}),
    # §5.2, §5.2.1 (producers: 200 new data, 204 duplicate, 400, 403 stale epoch, 409 gap).
    "append": frozenset({200, 204, 400, 403, 404, 409, 410, 413, 429}),
    "produce": frozenset({200, 204, 400, 403, 404, 409, 410, 413, 429}),
    # §5.3 close-only, and §5.2 append-and-close.
    "close": frozenset({200, 204, 400, 403, 404, 409, 410, 413, 429}),
    "delete": frozenset({204, 404, 410}),
    "head": frozenset({200, 404, 410, 429}),
    # §5.6 catch-up (304 for If-None-Match, 410 below retention or soft-deleted).
    "read": frozenset({200, 304, 400, 404, 410, 429}),
    "long_poll": frozenset({200, 204, 400, 404, 410, 429}),
    "sse": frozenset({200, 400, 404, 410, 429}),
    # §6, §7: subscriptions.
    "sub_put": frozenset({200, 201, 400, 409}),
    "sub_get": frozenset({200, 404}),
    "sub_claim": frozenset({200, 400, 404, 409}),
    "sub_ack": frozenset({200, 400, 401, 404, 409}),
    "sub_release": frozenset({204, 400, 401, 404, 409}),
    "healthz": frozenset({200}),
}

# Statuses streamkeep answers where the spec names none, on purpose.
EXTENSIONS: dict[str, dict[int, str]] = {
    # A token of a deleted incarnation names no position of the new stream (protocol/offsets.py);
    # §5.6 names 410 for reads, and a fork point is a read position of its source.
    "fork": {410: "Stream-Fork-Offset of a deleted incarnation (streamkeep offsets carry one)"},
    "long_poll": {},
    "sse": {},
}

FAULT_STATUSES = frozenset({503, 507})


def named(op: str, status: int) -> bool:
    """Whether the spec (or a documented streamkeep extension) names `status` for `op`."""
    allowed = STATUSES.get(op)
    if allowed is None:
        return True  # an operation this table does not know: judged by its own rules
    return status in allowed or status in EXTENSIONS.get(op, {})


def fault_reason(status: int, body: str) -> str:
    """Which fault an error response blames: "disk" (full or failing disk), "cold-read" (the bucket
    cannot serve a read), "cold-backlog" (sealed segments wait for S3: the high-water mark), "down"
    (not_ready, or recovering: a restarted server still reading its data directory back; a restart's
    window lasts until it read everything, in both tiers).

    The server's error body names the reason by a stable code ({"error": {"code", "message"}},
    streamkeep/storage/errors.py); anything not about the cold tier is taken as a disk fault, the
    strictest reading: it is allowed only while the disk is full or failing.
    """
    if status == 507:
        return "disk"
    return {
        "cold_backlog": "cold-backlog",
        "cold_tier_unavailable": "cold-read",
        "not_ready": "down",
        "recovering": "down",
    }.get(error_code(body), "disk")


def error_code(body: str) -> str:
    """The error code of an answer's JSON body; from its first bytes too, if the client took no
    more than a few (a vanishing reader)."""
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        found = re.search(r'"code":\s*"([A-Za-z_]+)"', body)
        return found.group(1) if found else ""


# A 503 with this code: the change was made but could not be made durable (a directory fsync kept
# failing after a create or delete was renamed into place), so it may or may not have happened.
NOT_DURABLE = "not_durable"


# ---- durability -------------------------------------------------------------------------------

# Faults that end the process or the machine. "kill" is SIGKILL (and any unexpected exit): the
# process dies, the kernel's page cache survives. "power_cut" (only the in-process tier can make
# one) loses whatever was not synced. "term" is a graceful SIGTERM.
PROCESS_FAULTS = ("term", "kill", "power_cut")

# Seconds of acknowledged writes, counted back from the fault, that may be lost, per --fsync mode.
# INTERVAL stands for "the last sync interval, and the one whose sync was in flight":
# 2 x --fsync-interval. Every other cell is a promise that nothing acknowledged is lost.
INTERVAL = -1.0
LOSS_WINDOW: dict[tuple[str, str], float] = {
    ("always", "term"): 0.0,
    ("always", "kill"): 0.0,
    ("always", "power_cut"): 0.0,
    ("interval", "term"): 0.0,
    ("interval", "kill"): 0.0,  # a process crash keeps the page cache
    ("interval", "power_cut"): INTERVAL,
    ("never", "term"): 0.0,
    ("never", "kill"): 0.0,
    ("never", "power_cut"): math.inf,  # nothing was ever synced on purpose
}


def loss_window(fsync: str, fault: str, fsync_interval: float = 1.0) -> float:
    """Seconds of acknowledged history before `fault` that may be lost under `--fsync fsync`."""
    window = LOSS_WINDOW.get((fsync, fault), 0.0)
    return 2 * fsync_interval if window == INTERVAL else window


# ---- fault windows ------------------------------------------------------------------------------

# Fault event kinds that open and close a window, and how long after it closes its symptoms may
# still show (seconds): the archiver backs off up to 60 s (x1.2 jitter) per stream before retrying
# an upload, so the high-water mark can hold for that long after S3 is back.
WINDOWS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "disk": (("disk_full",), ("disk_freed",)),
    # A disk that fails calls (EIO, ENOSPC, short writes, failed fsyncs): only the in-process tier
    # injects these (ops/torture/simfs.py).
    "disk-faults": (("disk_faults",), ("disk_healed",)),
    "s3": (("s3_stop", "s3_freeze"), ("s3_start", "s3_thaw")),
    # The server is down from a kill, a SIGTERM, a power cut or an unexpected exit ("crash") until
    # it listens again ("restart").
    "down": (("kill", "term", "power_cut", "crash"), ("restart",)),
}
# Point faults: "s3_wipe" (the bucket restarted empty: cold data is gone for good), and
# "client_vanish" (a client reset its connection mid-request; informational).
# The longest an SSE event may take from the server's write to the reader, on a loaded machine (the
# reader is a thread among the workers, behind HAProxy): an event arriving later than this after an
# acknowledgement was written after it. A stale server (a deposed owner, R4 in FINDINGS.md) lags by
# seconds, and a fresh connection to one is judged from its request's start.
DELIVERY_SKEW = 1.0

GRACE: dict[str, float] = {
    "disk": 3.0,
    "disk-faults": 3.0,
    "cold-read": 5.0,
    "cold-backlog": 150.0,
    "down": 1.0,
}
