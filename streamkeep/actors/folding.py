"""Folding a State Protocol stream (protocol/state_fold.py) as any reader reads it, and
compaction's last step, which runs in the stream's actor so no append slips in.

Compaction's background pass (streamkeep/compaction.py) and the registry's rebuild of its list
(streamkeep/registry/keeper.py) fold with `fold_range` too: they sit above the actors and must
not import each other, so what they share lives here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

import trio

from streamkeep.actors.messages import Compact
from streamkeep.actors.replies import Snapshot, SnapshotLog
from streamkeep.protocol import offsets
from streamkeep.protocol import stream as rules
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.state_fold import NotStateMessage, StateFold
from streamkeep.storage import forks
from streamkeep.storage.base import AppendRecord, Storage, StreamLog


async def fold_range(
    storage: Storage,
    stream_log: StreamLog,
    fold: StateFold,
    position: int,
    limit: int,
    chunk: int,
    *,
    slice_seconds: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Folds the messages of `stream_log` from `position` up to `limit`, read like any reader, in
    reads of `chunk` bytes; yields to the event loop after `slice_seconds` of folding if given.
    Returns where it stopped (`limit`); 422 at a message not of the State Protocol's shape."""
    while position < limit:
        result = await forks.read_range(
            storage, stream_log, position, chunk, whole_messages=True, limit=limit
        )
        slice_end = time.perf_counter() + (slice_seconds or 0.0)
        try:
            for message in result.messages:
                fold.apply(message)
                position += len(message)
                if slice_seconds is not None and time.perf_counter() >= slice_end:
                    await trio.lowlevel.checkpoint()
                    slice_end = time.perf_counter() + slice_seconds
        except NotStateMessage as error:
            raise not_state_message(error, offsets.encode(position, stream_log.meta.incarnation)) from None
        position = result.next_position
        if progress is not None:
            progress(position)
    return position


def not_state_message(error: NotStateMessage, offset: str) -> ProtocolError:
    return ProtocolError(422, "not_state_message", f"the message at offset {offset} {error}")


def check_compactable(stream_log: StreamLog) -> None:
    """A State Protocol stream is JSON; a closed one takes no snapshot (it takes no appends)."""
    if not stream_log.meta.json_mode:
        raise ProtocolError(
            409,
            "not_a_state_stream",
            f"only JSON streams of State Protocol messages are compacted; this one is {stream_log.meta.content_type!r}",
        )
    if stream_log.meta.closed:
        raise ProtocolError(409, "stream_closed", "a closed stream takes no snapshot: nothing to compact for")


def snapshot_log(stream_log: StreamLog) -> SnapshotLog:
    """`stream_log`, if it can take a snapshot; 409 if not (memory storage)."""
    if not hasattr(stream_log, "fresh_segment"):
        raise ProtocolError(409, "compaction_needs_disk", "compaction needs disk storage (--storage disk)")
    return cast(SnapshotLog, stream_log)


async def append_snapshot(storage: Storage, name: str, stream_log: StreamLog, message: Compact) -> Snapshot:
    """Folds what came after `message.position` (what the background fold read up to), then
    appends the snapshot, starting a new segment, in records of at most `message.chunk` bytes (so
    reads of it stay chunked). Only the stream's actor may call it: nothing else may append
    meanwhile."""
    if stream_log.meta.stream_id != message.stream_id:
        raise ProtocolError(
            409, "stream_replaced", f"stream {name!r} was deleted and created again during the compaction"
        )
    check_compactable(stream_log)
    log = snapshot_log(stream_log)
    await log.drain()  # appends accepted before this message land first
    if log.published_closed:
        raise ProtocolError(409, "stream_closed", f"stream {name!r} is closed: nothing to compact for")
    fold, chunk = message.fold, message.chunk
    await fold_range(storage, log, fold, message.position, log.published_tail, chunk)
    start = await log.fresh_segment()
    # Encoding 100,000 values takes a while: in a worker thread, so other streams' requests
    # get the event loop back every few milliseconds (the GIL's switch interval).
    messages = await trio.to_thread.run_sync(fold.snapshot, offsets.encode(start, log.meta.incarnation))
    commit = log.latest_commit()
    for group in _groups(messages, chunk):
        commit = log.submit(AppendRecord(group, rules.copy_meta(log.meta), None, False, None))
    return Snapshot(commit, start, log)


def _groups(messages: list[bytes], limit: int) -> list[list[bytes]]:
    """`messages` in runs of at most `limit` bytes (a message larger than that alone)."""
    groups: list[list[bytes]] = [[]]
    size = 0
    for message in messages:
        if groups[-1] and size + len(message) > limit:
            groups.append([])
            size = 0
        groups[-1].append(message)
        size += len(message)
    return groups
