"""What `__registry__` holds and who may touch it: pure functions, no I/O.

Each entry is a State Protocol change message (seed 001) in exactly the shape the upstream
reference server's `registry-hook` appends and its `examples/test-ui` folds with
`createStreamDB` (type `stream`, primary key `path`):

    {"type":"stream","key":"chat/room-1","value":{"path":"chat/room-1","contentType":"text/plain","createdAt":1767225600000},"headers":{"operation":"insert"}}
    {"type":"stream","key":"chat/room-1","headers":{"operation":"delete"}}

`key` and `path` are the decoded stream name, without `/v1/stream/` (the name scopes, subscription
patterns and /stats use); `createdAt` is milliseconds since the epoch. A delete carries no
`value`: upstream's `delete({key})` leaves `old_value` undefined, which JSON.stringify drops. The
encoding is the one compaction's snapshot uses (protocol/state_fold.py), so a snapshot's inserts
are byte for byte what the server appended.
"""

from __future__ import annotations

import json
from typing import Any

from streamkeep.protocol import routes
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.headers import is_json
from streamkeep.protocol.names import REGISTRY_STREAM
from streamkeep.protocol.state_fold import StateFold
from streamkeep.protocol.stream import StreamMeta

NAME = REGISTRY_STREAM
CONTENT_TYPE = "application/json"
TYPE = "stream"  # the State Protocol `type` of every entry

# Requests that would change the registry; only the server writes it.
_WRITES = frozenset((routes.CREATE, routes.FORK, routes.APPEND, routes.CLOSE, routes.DELETE))


# The keys of `value`, in its order. An insert of such a value is written out (`insert`): through
# json.dumps it cost each create ~3 us of the event loop's time (issue 26).
_VALUE_KEYS = ("path", "contentType", "createdAt")
# A str as JSON, the way json.dumps(ensure_ascii=False) writes it.
_string = json.encoder.encode_basestring


def value(meta: StreamMeta) -> dict[str, Any]:
    """An entry's value for a live stream (a fork lists the content type it took from its source)."""
    return {"path": meta.name, "contentType": meta.content_type, "createdAt": int(meta.created_at * 1000)}


def is_value(name: str, entry: object) -> bool:
    """Whether `entry` is what `value` makes for stream `name` (a member's change or list is
    checked by it before the keeper writes it)."""
    if not isinstance(entry, dict) or entry.keys() != set(_VALUE_KEYS):
        return False
    path, content_type, created_at = entry["path"], entry["contentType"], entry["createdAt"]
    return path == name and type(path) is str and type(content_type) is str and type(created_at) is int


def summary(name: str, entry: dict[str, Any]) -> object:
    """What the keeper remembers of an entry it lists: enough to tell whether a change would say
    something new. A value as `value` makes it is kept as (content type, createdAt): the dict,
    with the keys table each dict carries, cost every listed stream ~216 B, a tenth of what an
    idle stream may take (issue 26); a tuple costs 88. Anything else (an adopted stream's entry)
    is kept as it is."""
    if is_value(name, entry):
        return (entry["contentType"], entry["createdAt"])
    return entry


def summaries(listed: dict[str, dict[str, Any]]) -> dict[str, object]:
    return {name: summary(name, entry) for name, entry in listed.items()}


def insert(name: str, entry: dict[str, Any]) -> bytes:
    if tuple(entry) == _VALUE_KEYS:  # as `value` makes it: written out, the bytes `_encode` makes
        path, content_type, created_at = entry.values()
        if type(path) is str and type(content_type) is str and type(created_at) is int:
            return (
                f'{{"type":"{TYPE}","key":{_string(name)},"value":{{"path":{_string(path)},'
                f'"contentType":{_string(content_type)},"createdAt":{created_at}}},'
                '"headers":{"operation":"insert"}}'
            ).encode()
    return _encode({"type": TYPE, "key": name, "value": entry, "headers": {"operation": "insert"}})


def delete(name: str) -> bytes:
    return _encode({"type": TYPE, "key": name, "headers": {"operation": "delete"}})


def listed(fold: StateFold) -> dict[str, Any]:
    """The streams a folded registry lists, by name, with their values. Entries of other types (an
    adopted stream may hold some) are left alone: they describe no stream."""
    return {key: entry for (kind, key), entry in fold.state.items() if kind == TYPE}


def changes(listed_now: dict[str, Any], live: dict[str, dict[str, Any]]) -> list[bytes]:
    """The messages that make a registry listing `listed_now` list exactly `live`: a delete per
    stream gone, an insert per stream missing or listed with another value (a stream deleted and
    created again while the server was down)."""
    messages = [delete(name) for name in sorted(listed_now) if name not in live]
    messages += [insert(name, entry) for name, entry in sorted(live.items()) if listed_now.get(name) != entry]
    return messages


def unadoptable(meta: StreamMeta) -> str | None:
    """Why a stream already named `__registry__` (made by a client before this version, or while
    the registry was off) cannot serve as the registry, or None if it can. It is adopted when it
    could have been ours: JSON, open, without TTL or expiry (it must never expire), not a fork."""
    if not is_json(meta.content_type):
        return f"its content type is {meta.content_type!r}, not application/json"
    if meta.closed:
        return "it is closed, so nothing more can be appended to it"
    if meta.ttl_seconds is not None or meta.expires_at_ts is not None:
        return "it has a TTL or an expiry time, and the registry must never expire"
    if meta.forked_from is not None:
        return f"it is a fork of {meta.forked_from!r}"
    if meta.soft_deleted:
        return "it was deleted while forks still read it"
    return None


def refuse_writes(route: routes.Route) -> None:
    """403 for a client's create, append, close, fork or delete of the registry, and for a fork of
    it (a fork would pin its history, which compaction keeps bounded). 403 rather than 409: no
    state of the stream or credential would make the request acceptable (RFC 9110 §15.5.4)."""
    if route.name == NAME and route.kind in _WRITES:
        raise ProtocolError(
            403,
            "reserved_stream",
            f"{NAME} is the server's list of streams: clients may read it, but only the server "
            "creates, appends to and deletes it (a server started with --no-registry leaves the name free)",
        )
    if route.fork_source == NAME:
        raise ProtocolError(
            403,
            "reserved_stream",
            f"{NAME} cannot be forked: a fork would keep its whole history, which the server compacts away",
        )


def _encode(message: dict[str, Any]) -> bytes:
    # No NaN or Infinity: JSON has neither, and a client's JSON.parse would refuse the registry.
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
