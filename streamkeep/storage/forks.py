"""Reads of forked streams (§4.2): below its fork base a fork shows its source's bytes.

Nothing is copied at fork time. A fork's own log starts at its fork base; positions below it are
read from the source, trimmed at the base, recursively up a chain of forks. These functions work
on any storage through the `StreamLog` interface.

In a cluster a source may live on another member (`storage.remote`): its range is then read by
that member, which follows the rest of the chain itself, and what cannot be asked without a round
trip (is a position a message boundary) is asked there at the time of the read.
"""

from __future__ import annotations

from streamkeep.storage.base import ReadResult, RemoteSources, Storage, StreamLog
from streamkeep.storage.errors import StorageUnavailable


def remote_source(storage: Storage, name: str | None) -> RemoteSources | None:
    """How to reach fork source `name` when another cluster member owns it, else None."""
    remote = getattr(storage, "remote", None)
    return remote if remote is not None and name is not None and remote.elsewhere(name) else None


def _source(storage: Storage, log: StreamLog) -> StreamLog:
    source = storage.open(log.meta.forked_from or "")
    if source is None:
        raise StorageUnavailable(
            f"the source of fork {log.meta.name!r} is missing; see the startup log", status=503
        )
    return source


async def read_range(
    storage: Storage,
    log: StreamLog,
    start: int,
    max_bytes: int,
    *,
    whole_messages: bool,
    limit: int | None = None,
) -> ReadResult:
    """Messages from `start`, at most up to `limit` (a position), stitched across a fork chain."""
    meta = log.meta
    if meta.forked_from is not None and start < meta.fork_base:
        base = meta.fork_base
        cap = base if limit is None else min(limit, base)
        remote = remote_source(storage, meta.forked_from)
        if remote is not None:
            assert meta.forked_from is not None
            head = await remote.read_range(
                meta.forked_from, start, max_bytes, whole_messages=whole_messages, limit=cap
            )
            source_name = meta.forked_from
        else:
            source = _source(storage, log)
            head = await read_range(
                storage, source, start, max_bytes, whole_messages=whole_messages, limit=cap
            )
            source_name = source.meta.name
        if not head.messages and head.next_position <= start:
            # The source ends before the fork point: never answer "nothing here, but read on".
            raise StorageUnavailable(
                f"fork {meta.name!r} inherits up to position {base} of {source_name!r}, which ends at "
                f"{head.next_position}: its data up to the fork point is missing; see the startup log",
                status=503,
            )
        used = sum(len(m) for m in head.messages)
        if head.next_position < base or head.next_position == limit or used >= max_bytes:
            return head
        # The inherited range is done and the chunk has room: go on with this fork's own data.
        rest = await read_range(
            storage, log, base, max_bytes - used, whole_messages=whole_messages, limit=limit
        )
        return ReadResult(head.messages + rest.messages, rest.next_position)
    result = await log.read(start, max_bytes, whole_messages=whole_messages)
    if limit is None or result.next_position <= limit:
        return result
    kept: list[bytes] = []
    position = start
    for message in result.messages:
        if position + len(message) <= limit:
            kept.append(message)
            position += len(message)
        else:
            if not whole_messages and position < limit:
                kept.append(message[: limit - position])
                position = limit
            break
    return ReadResult(kept, position)


def readable_from(storage: Storage, log: StreamLog) -> int:
    """The earliest position a reader of `log` can ask for: its own floor, or higher while the
    range it inherits from its source is not all there (a fork made after the source's retention
    moved on, or one whose source dropped what no pin held). `offset=-1` starts here; below it, 410."""
    low = log.floor
    meta = log.meta
    if meta.forked_from is not None and low < meta.fork_base:
        if remote_source(storage, meta.forked_from) is not None:
            return max(low, min(meta.fork_low, meta.fork_base))  # its pin holds it from there
        source = storage.open(meta.forked_from)
        if source is not None:
            low = max(low, min(held_low(storage, source), meta.fork_base))
    return low


def held_low(storage: Storage, log: StreamLog) -> int:
    """The earliest position whose bytes `log` can still serve (its own, or its sources')."""
    own = getattr(log, "held_from", log.meta.fork_base)
    meta = log.meta
    if meta.forked_from is not None and own <= meta.fork_base:
        if remote_source(storage, meta.forked_from) is not None:
            return min(meta.fork_low, meta.fork_base)
        source = storage.open(meta.forked_from)
        if source is not None:
            return min(held_low(storage, source), meta.fork_base)
    return own


def is_boundary(storage: Storage, log: StreamLog, position: int) -> bool:
    """Whether `position` starts a message. True where the source lives on another member: the
    read of that range asks its owner (`fork.read` refuses a position inside a message)."""
    meta = log.meta
    if meta.forked_from is not None and position < meta.fork_base:
        if remote_source(storage, meta.forked_from) is not None:
            return True
        return is_boundary(storage, _source(storage, log), position)
    return log.is_boundary(position)


async def probe(storage: Storage, log: StreamLog, position: int) -> tuple[bool, int | None]:
    """Whether `position` starts a message, and the end of the append holding it (None past the
    tail), capped at each fork base on the way down; asks a source's owner where it must."""
    meta = log.meta
    if meta.forked_from is not None and position < meta.fork_base:
        remote = remote_source(storage, meta.forked_from)
        if remote is not None:
            boundary, end = await remote.probe(meta.forked_from, position)
        else:
            boundary, end = await probe(storage, _source(storage, log), position)
        return boundary, None if end is None else min(end, meta.fork_base)
    return log.is_boundary(position), log.next_append_end(position)
