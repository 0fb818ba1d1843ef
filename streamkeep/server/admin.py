"""The JSON admin API the stream browser (/ui/) reads: what streams exist and the state of each.

- `GET /v1/admin/streams[?match=GLOB&limit=N]`: one summary per stream, sorted by name (`limit`
  1,000 by default, at most 10,000; `total` and `truncated` say what was left off), and, for
  admins or with auth off, the server's totals (`server`).
- `GET /v1/admin/streams/<name>`: one stream's summary plus its producers, forks and the
  subscriptions that follow it, with their cursors.

Auth: the list shows only the streams the caller's token may read, by the gate's own rule for a
read (`Gate.allows`; any authenticated token may ask, and an empty list says it reads none); one
stream needs `read` on it, checked by the gate like a read (routes.NEEDS), so a 403 says nothing
about whether it exists. The server totals need `admin`, as /stats does.

Everything here is read from the published state the stream logs hold, without asking the
actors: it is a snapshot between two checkpoints of the trio loop, costs no mailbox slot, and
never touches a stream's sliding TTL the way a read would.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from streamkeep.auth.gate import Gate
from streamkeep.auth.tokens import Principal
from streamkeep.protocol import offsets, routes
from streamkeep.protocol.errors import bad_request, not_found
from streamkeep.protocol.globs import glob_match
from streamkeep.protocol.model import Request, Response
from streamkeep.protocol.responses import json_response
from streamkeep.storage import forks
from streamkeep.storage.base import Storage, StreamLog
from streamkeep.subscriptions.manager import SubscriptionManager

DEFAULT_LIMIT = 1000
MAX_LIMIT = 10_000
MAX_PRODUCERS = 1000  # shown per stream; `producers_total` counts them all


Readable = Callable[[str], bool]


def streams(
    storage: Storage, request: Request, readable: Readable, readers: Counter[str], appended: tuple[int, int]
) -> Response:
    """The list; `readable` is the caller's read check (`readable_by`), `readers` the live readers
    by stream, `appended` the server's acknowledged appends and their bytes."""
    principal: Principal | None = request.principal
    pattern = _one(request, "match")
    limit = parse_limit(request)
    now = time.time()
    names = sorted(storage.names())
    visible = [name for name in names if (not pattern or glob_match(pattern, name)) and readable(name)]
    rows = []
    for name in visible[:limit]:
        stream_log = storage.open(name)
        if stream_log is not None:
            rows.append(_hide_source(summary(storage, stream_log, readers[name], now), readable))
    body: dict[str, Any] = {"streams": rows, "total": len(visible), "truncated": len(visible) > limit}
    if principal is None or principal.grants.admin:
        body["server"] = {
            "streams": len(names),
            "stored_bytes": storage.budget.total_bytes,
            "appends": appended[0],
            "appended_bytes": appended[1],
            "live_readers": sum(readers.values()),
        }
    return json_response(200, body)


def merged(me: str, mine: dict[str, Any], answers: dict[str, Response | None], limit: int) -> Response:
    """A cluster's list: this member's `streams` body and the other members' answers, merged by
    name and cut at `limit`; `members` says which answered (a list missing a member is partial)."""
    bodies = [mine]
    members = {me: "ok"}
    for member, answer in sorted(answers.items()):
        if answer is None or answer.status != 200 or not isinstance(answer.body, bytes):
            members[member] = "unreachable" if answer is None else f"answered {answer.status}"
            continue
        bodies.append(json.loads(answer.body))
        members[member] = "ok"
    rows = sorted((row for body in bodies for row in body["streams"]), key=lambda row: row["name"])
    total = sum(body["total"] for body in bodies)
    out: dict[str, Any] = {
        "streams": rows[:limit],
        "total": total,
        "truncated": total > limit,
        "members": members,
    }
    if "server" in mine:
        out["server"] = {
            key: sum(body.get("server", {}).get(key, 0) for body in bodies) for key in mine["server"]
        }
    return json_response(200, out)


def readable_by(gate: Gate | None, request: Request) -> Readable:
    """Whether the caller could read a stream: what a read of it would meet at the gate."""
    principal = request.principal

    def readable(name: str) -> bool:
        return (
            principal is None
            or gate is None
            or gate.allows(principal, routes.Route(routes.READ, name), request)
        )

    return readable


def _hide_source(row: dict[str, Any], readable: Readable) -> dict[str, Any]:
    """A fork's source is named only to a caller who may read it: the name is not theirs to learn."""
    source = row.get("forked_from")
    if source is not None and not readable(source):
        row.update(forked_from=None, fork_offset=None, fork_base_offset=None)
    return row


def stream(
    storage: Storage,
    name: str,
    request: Request,
    readable: Readable,
    live_readers: int,
    subscriptions: SubscriptionManager | None,
) -> Response:
    principal: Principal | None = request.principal
    stream_log = storage.open(name)
    if stream_log is None:
        raise not_found(name)
    body = summary(storage, stream_log, live_readers, time.time())
    meta = stream_log.meta
    producers = sorted(stream_log.producers.items())
    body.update(
        stream_id=meta.stream_id,
        fork_offset=meta.fork_offset,
        fork_base_offset=_fork_point(storage, stream_log),
        last_stream_seq=meta.last_stream_seq,
        producers=[
            {"id": producer_id, "epoch": state.epoch, "last_seq": state.last_seq}
            for producer_id, state in producers[:MAX_PRODUCERS]
        ],
        producers_total=len(producers),
        # Forks are few and a stream does not list its own: one pass over the streams finds them
        # (those read so far, in the seconds after a start that served early), and the pins name
        # those other cluster members own.
        forks=sorted(
            {
                log.meta.name
                for log in storage.logs()
                if log.meta.forked_from == name and readable(log.meta.name)
            }
            | {fork for _, fork, _ in meta.remote_forks if readable(fork)}
        ),
        segments=len(stream_log.segments) if hasattr(stream_log, "segments") else None,  # disk only
        read_only=_read_only(stream_log),
        subscriptions=[] if subscriptions is None else subscriptions.linked_to(name, principal),
    )
    return json_response(200, _hide_source(body, readable))


def summary(storage: Storage, stream_log: StreamLog, live_readers: int, now: float) -> dict[str, Any]:
    """What the list shows of one stream. `size` is what a reader from `offset=-1` gets (a fork's
    inherited bytes included); `hot_bytes`/`cold_bytes` are its own segment files' bytes on local
    disk and only in the bucket (memory storage: all hot)."""
    meta = stream_log.meta
    incarnation = meta.incarnation
    tail = stream_log.published_tail
    earliest = forks.readable_from(storage, stream_log)
    tiers = stream_log.tier_bytes() if hasattr(stream_log, "tier_bytes") else {"hot": 0, "cold": 0}
    return {
        "name": meta.name,
        "content_type": meta.content_type,
        "created_at": int(meta.created_at * 1000),
        "next_offset": offsets.encode(tail, incarnation),
        "earliest_offset": offsets.encode(earliest, incarnation),
        "size": tail - earliest,
        "hot_bytes": tiers["hot"],
        "cold_bytes": tiers["cold"],
        "closed": stream_log.published_closed,
        "expired": meta.expired(now),
        "deleted": meta.soft_deleted,  # deleted while forks still read it: 410 to readers
        "ttl_seconds": meta.ttl_seconds,
        "expires_at": meta.expires_at,
        "forked_from": meta.forked_from,
        "fork_count": meta.fork_count,
        "appends": getattr(stream_log, "record_count", 0),
        "live_readers": live_readers,
    }


def _fork_point(storage: Storage, stream_log: StreamLog) -> str | None:
    """Where a fork's own data starts, as its source's offset token (the position a reader of the
    source would name; the fork accepts it too)."""
    meta = stream_log.meta
    if meta.forked_from is None:
        return None
    source = storage.open(meta.forked_from)
    if source is not None:
        incarnation = source.meta.incarnation
    else:  # on another cluster member: its incarnation came with the fork
        incarnation = meta.source_incarnations[0] if meta.source_incarnations else meta.incarnation
    return offsets.encode(meta.fork_base, incarnation)


def _read_only(stream_log: StreamLog) -> str | None:
    """Why the stream takes no appends until a restart (disk storage, records failing checks)."""
    # `kept_writer` on disk: looking must not make a writer for an idle stream (a memory log has none)
    writer = getattr(stream_log, "kept_writer", None)
    reason = getattr(writer, "read_only", None)
    return None if reason is None else str(reason)


def _one(request: Request, name: str) -> str | None:
    values = request.query(name)
    return values[0] if values and values[0] else None


def parse_limit(request: Request) -> int:
    raw = _one(request, "limit")
    if raw is None:
        return DEFAULT_LIMIT
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise bad_request("invalid_limit", f"limit must be a whole number from 1 to {MAX_LIMIT}")
    return int(raw)
