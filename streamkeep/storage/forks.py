"""Reads of forked streams (§4.2): below its fork base a fork shows its source's bytes.

Nothing is copied at fork time. A fork's own log starts at its fork base; positions below it are
read from the source, trimmed at the base, recursively up a chain of forks. These functions work
on any storage through the `StreamLog` interface.
"""

from __future__ import annotations

from streamkeep.storage.base import ReadResult, Storage, StreamLog
from streamkeep.storage.errors import StorageUnavailable


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
        source = _source(storage, log)
        head = await read_range(storage, source, start, max_bytes, whole_messages=whole_messages, limit=cap)
        if not head.messages and head.next_position <= start:
            # The source ends before the fork point: never answer "nothing here, but read on".
            raise StorageUnavailable(
                f"fork {meta.name!r} inherits up to position {base} of {source.meta.name!r}, which ends at "
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
        source = storage.open(meta.forked_from)
        if source is not None:
            low = max(low, min(held_low(storage, source), meta.fork_base))
    return low


def held_low(storage: Storage, log: StreamLog) -> int:
    """The earliest position whose bytes `log` can still serve (its own, or its sources')."""
    own = getattr(log, "held_from", log.meta.fork_base)
    meta = log.meta
    if meta.forked_from is not None and own <= meta.fork_base:
        source = storage.open(meta.forked_from)
        if source is not None:
            return min(held_low(storage, source), meta.fork_base)
    return own


def is_boundary(storage: Storage, log: StreamLog, position: int) -> bool:
    meta = log.meta
    if meta.forked_from is not None and position < meta.fork_base:
        return is_boundary(storage, _source(storage, log), position)
    return log.is_boundary(position)


def next_append_end(storage: Storage, log: StreamLog, position: int) -> int | None:
    """The end of the append holding `position`, capped at each fork base on the way down."""
    meta = log.meta
    if meta.forked_from is not None and position < meta.fork_base:
        end = next_append_end(storage, _source(storage, log), position)
        return None if end is None else min(end, meta.fork_base)
    return log.next_append_end(position)
