"""The HAProxy configuration that puts a cluster behind one front door, made from `[cluster]`.

HAProxy terminates HTTP/1.1, h2c (prior knowledge is detected on a clear-text port) and TLS with
ALPN h2 from clients in C, and talks HTTP/1.1 keep-alive to the members. It routes by the slot
table of `placement.py`: `path,crc32,mod(4096)` looked up in a map file of slot -> backend, one
backend with one server per member. The lookup is `map` (exact string match, a tree), not
`map_int`, whose integer match walks the 4096 lines one by one: a fifth of HAProxy's CPU per
append (ops/profile_cluster.py --perf). Deliberately not `balance uri` + `hash-type consistent`:
with health checks that hands a down member's streams to the next member on the ring, and `option
redispatch` breaks persistence the same way; either would give a stream a second history. Here a
down member's slots answer 503 with `Retry-After` until it is back. A replicated member's backend
(`[cluster] replicas`) is the exception that proves the rule: its two servers are the same member's
two replicas, of which only the owner listens, so redispatching within it is exactly right.

Subscription control requests route by the subscription's id (`/v1/stream/__ds/subscriptions/<id>`).
Timeouts sit above the long-poll timeout and the SSE response lifetime, so HAProxy never cuts a
live read the server would have ended cleanly.

Each member has two backends. `member_<id>` takes every request but live reads, with at most
`member_maxconn` of them at a member at once (the rest wait in HAProxy's queue, in order): without
the cap HAProxy opened a connection per waiting request, and a member with hundreds of them
answered some appends seconds late (issue 26: 1.5-3.3 s worst cases on 16 cores, 34-59 ms with 32).
`member_<id>_live` takes long-polls and SSE (`?live=`) and the members' calls to each other,
uncapped: a live read holds its connection for up to a minute, so capped it would take the slots
appends need, and a member waiting on a peer must never queue behind requests that wait on it. Its
servers track the first backend's health checks. HAProxy runs `threads` threads: by default a third
of the machine's cores (at least one), since it spends about a third of an append's CPU and every
thread it does not need costs per request (docs/benchmarks.md, issue 26).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from streamkeep.cluster.placement import SLOTS, Placement
from streamkeep.protocol.names import CONTROL_PREFIX, STREAM_PREFIX

SUBSCRIPTIONS_PREFIX = CONTROL_PREFIX + "subscriptions/"
# Fields of "/v1/stream/__ds/subscriptions/<id>/..." split on "/": the id is the sixth.
_SUBSCRIPTION_ID_FIELD = SUBSCRIPTIONS_PREFIX.count("/") + 1
_UNAVAILABLE = (
    '{"error": {"code": "owner_unavailable", "message": "the process that owns this stream is not '
    'reachable, or has had more requests waiting than it could take for 5 s; retry after a second"}}'
)


# At most this many requests at a member at once (live reads aside); issue 26 measured 32.
MEMBER_MAXCONN = 32
LIVE_SUFFIX = "_live"


def backend(member_id: str) -> str:
    return f"member_{member_id}"


def live_backend(member_id: str) -> str:
    return backend(member_id) + LIVE_SUFFIX


def default_threads(cores: int | None = None) -> int:
    """HAProxy's threads: a third of the cores, at least one."""
    return max(1, (cores or os.cpu_count() or 1) // 3)


def slot_map(placement: Placement) -> str:
    """The map file: one `slot backend` line per slot."""
    return "".join(f"{slot} {backend(placement.owner_of_slot(slot).id)}\n" for slot in range(SLOTS))


def config(
    placement: Placement,
    *,
    map_path: str,
    bind: str = "127.0.0.1",
    port: int = 8080,
    tls_cert: str | None = None,
    live_seconds: float = 60.0,
    stats_port: int | None = None,
    replicas: dict[str, list[tuple[str, str]]] | None = None,
    threads: int | None = None,
    member_maxconn: int = MEMBER_MAXCONN,
) -> str:
    """haproxy.cfg text. `live_seconds`: the longest a live read may stay quiet (the larger of the
    long-poll timeout and the SSE response lifetime); `tls_cert`: a PEM with key, for TLS + h2.

    `replicas` (with --replicas 2): each member's replicas as (name, host:port). Both are servers of
    the member's backend; only the owner listens (a follower does not), so the health checks send
    the member's requests to whichever replica owns it now, and after a failover to the promoted
    one. Each member's `address` is then a frontend of this HAProxy (the member's live backend),
    which the members use to reach each other wherever the member is served. `threads`: HAProxy's
    (default: `default_threads()` of this machine); `member_maxconn`: requests at a member at once."""
    quiet = int(live_seconds) + 30
    threads = default_threads() if threads is None else threads
    by_slot = f"path,crc32,mod({SLOTS}),map({map_path})"
    by_subscription = f"path,field({_SUBSCRIPTION_ID_FIELD},/),crc32,mod({SLOTS}),map({map_path})"
    bind_line = f"    bind {bind}:{port}"
    if tls_cert is not None:
        bind_line += f" ssl crt {tls_cert} alpn h2,http/1.1"
    lines = [
        "# Generated by `streamkeep cluster haproxy-config` from [cluster] "
        f"(epoch {placement.epoch}, {len(placement.members)} members). Do not edit: generate again.",
        "global",
        f"    nbthread {threads}",
        "    maxconn 8000",  # within a default 20k descriptor limit: two per proxied connection
        "",
        "defaults",
        "    mode http",
        "    option http-keep-alive",
        # Without it HAProxy sends a live response's small writes with MSG_MORE and the kernel holds
        # each for up to 200 ms: every SSE event and long-poll answer came ~205 ms late (torture C1).
        "    option http-no-delay",
        "    option forwardfor",
        "    no option redispatch",
        "    retries 2",
        "    timeout connect 2s",
        f"    timeout client {quiet}s",
        f"    timeout server {quiet}s",
        "    timeout http-request 30s",
        "    timeout http-keep-alive 75s",
        "    timeout queue 5s",
        f"    http-error status 503 content-type application/json hdr Retry-After 1 string '{_UNAVAILABLE}'",
        "",
        "frontend streams",
        bind_line,
        f"    http-request set-header Streamkeep-Placement-Epoch {placement.epoch}",
        # What the client spoke to the front door (members only see HTTP/1.1 from HAProxy): /stats
        # counts it per member, so an operator can see h2 clients are served as h2.
        "    http-request set-header Streamkeep-Client-Http-Version %[req.ver]",
        # HAProxy terminates TLS: members build Location and callback URLs with the client's scheme.
        "    http-request set-header Streamkeep-Client-Scheme %[ssl_fc,iif(https,http)]",
        f"    use_backend %[{by_subscription}] if {{ path_beg {SUBSCRIPTIONS_PREFIX} }}",
        # A live read (`?live=long-poll` or `sse`) goes to the member's uncapped backend.
        f"    use_backend %[{by_slot}]{LIVE_SUFFIX} if {{ path_beg {STREAM_PREFIX} }} {{ url_param(live) -m found }}",
        f"    use_backend %[{by_slot}] if {{ path_beg {STREAM_PREFIX} }}",
        f"    default_backend {backend(placement.members[0].id)}",
        "",
    ]
    if stats_port is not None:
        lines += [
            "frontend stats",
            f"    bind 127.0.0.1:{stats_port}",
            "    stats enable",
            "    stats uri /",
            "",
        ]
    for member in placement.members:
        lines += [
            f"backend {backend(member.id)}",
            "    option httpchk GET /healthz",
            "    http-check expect status 200",
        ]
        capped = f"maxconn {member_maxconn}"
        if replicas is None:
            lines += [
                f"    server {member.id} {member.address} {capped} check inter 1s fall 2 rise 1",
                "",
                f"backend {live_backend(member.id)}",
                f"    server {member.id} {member.address} track {backend(member.id)}/{member.id}",
                "",
            ]
            continue
        # A failed owner is out after 2 checks 0.5 s apart; the promoted replica is in at its first.
        # Until a check has run, HAProxy takes both for up: a connection the follower refuses (it
        # does not listen) is retried on the other server of the backend, the same member's owner.
        # A check may take up to 2 s (HAProxy's default is the 0.5 s interval): an owner that is
        # slow for a moment on a busy machine is not taken out; a dead one refuses at once.
        lines += ["    option redispatch 1", "    timeout check 2s"]
        lines += [
            f"    server {name} {address} {capped} check inter 500ms fall 2 rise 1"
            for name, address in replicas[member.id]
        ]
        lines += ["", f"backend {live_backend(member.id)}", "    option redispatch 1"]
        lines += [
            f"    server {name} {address} track {backend(member.id)}/{name}"
            for name, address in replicas[member.id]
        ]
        lines += [
            "",
            f"frontend peer_{member.id}",
            f"    bind {member.address}",
            f"    default_backend {live_backend(member.id)}",
            "",
        ]
    return "\n".join(lines)


def write(placement: Placement, out: Path, **options: Any) -> Path:
    """Writes `slots.map` and `haproxy.cfg` (`config`'s keyword options) into `out`; returns the
    configuration's path."""
    out.mkdir(parents=True, exist_ok=True)
    map_path = out / "slots.map"
    map_path.write_text(slot_map(placement))
    path = out / "haproxy.cfg"
    path.write_text(config(placement, map_path=str(map_path.resolve()), **options))
    return path
