"""Fork bookkeeping, as the actors keep it: a fork's create attaches it to its source's actor,
which checks the fork point and counts the fork (or, for a fork another cluster member owns,
saves a pin); a fork's delete detaches it again. Offset tokens of a fork carry its sources'
incarnations, since a fork shares their positions.

Each function runs inside the actor of the stream it names (the source for the attach, detach
and pin functions, the fork for `create_fork`): that actor is the stream's only writer.
"""

from __future__ import annotations

import uuid
from dataclasses import replace

import trio

from streamkeep.actors.host import StreamHost
from streamkeep.actors.messages import AttachFork, DetachFork
from streamkeep.protocol import offsets
from streamkeep.protocol.errors import ProtocolError, bad_request, not_found
from streamkeep.protocol.headers import media_type
from streamkeep.protocol.stream import CreateSpec, ForkSource, StreamMeta
from streamkeep.storage import forks
from streamkeep.storage.base import Storage, StreamLog
from streamkeep.storage.errors import below_floor

# ---- in the fork's actor ------------------------------------------------------------------


async def create_fork(host: StreamHost, name: str, spec: CreateSpec, now: float) -> StreamLog:
    """Creates the fork `name` once its source counted it (or pinned it, on another member)."""
    fork = spec.fork
    assert fork is not None
    if fork.source == name:
        raise not_found(fork.source)  # this path holds no stream, so it cannot be the source
    given = spec.content_type if spec.content_type_given else None
    stream_id = uuid.uuid4().hex[:12]
    remote = forks.remote_source(host.storage, fork.source)
    if remote is None:
        source = await host.call(fork.source, AttachFork(fork, given))
        return await _create_attached(host, name, spec, now, stream_id, source)
    # The source's member pins its data for this fork durably before the fork exists; while
    # this create runs, its reconcile hears "pending" for the pin, never "absent".
    with remote.attaching(stream_id):
        source = await remote.attach(fork, given, fork_name=name, pin=stream_id)
        return await _create_attached(host, name, spec, now, stream_id, source)


async def _create_attached(
    host: StreamHost, name: str, spec: CreateSpec, now: float, stream_id: str, source: ForkSource
) -> StreamLog:
    fork = spec.fork
    assert fork is not None
    try:
        ttl, expires = spec.ttl_seconds, spec.expires_at
        if ttl is None and expires is None:  # the inheritance table of §4.2
            if source.ttl_seconds is not None:
                ttl = source.ttl_seconds
            elif source.expires_at is not None and source.expires_at_ts is not None:
                expires = (source.expires_at, source.expires_at_ts)
        meta = StreamMeta(
            name=name,
            stream_id=stream_id,
            content_type=source.content_type,
            created_at=now,
            ttl_seconds=ttl,
            expires_at=expires[0] if expires else None,
            expires_at_ts=expires[1] if expires else None,
            closed=spec.closed,
            last_access=now,
            forked_from=fork.source,
            fork_base=source.base,
            fork_offset=fork.offset_token,
            fork_sub_offset=fork.sub_offset,
            fork_low=source.low,
            source_incarnations=source.incarnations,
        )
        return await host.storage.create(meta, spec.split(source.content_type))
    except BaseException as error:
        if getattr(error, "happened", False):
            raise  # the fork exists (if not durably): its source keeps counting it
        with trio.CancelScope(shield=True):
            try:
                await detach_from(host, fork.source, stream_id)
            except ProtocolError:
                pass
        raise


async def detach_from(host: StreamHost, source: str, stream_id: str) -> None:
    """Tells the source of a fork that is gone (`stream_id`: the fork's, its pin elsewhere)."""
    remote = forks.remote_source(host.storage, source)
    if remote is not None:
        await remote.detach(source, stream_id)
    else:
        await host.call(source, DetachFork())


# ---- in the source's actor ----------------------------------------------------------------


def check_source(name: str, stream_log: StreamLog | None) -> None:
    """A fork's source must exist and not be soft-deleted (it takes no new forks then)."""
    if stream_log is None:
        raise ProtocolError(404, "fork_source_not_found", f"the fork source {name!r} does not exist")
    if stream_log.meta.soft_deleted:
        raise ProtocolError(409, "fork_source_deleted", f"the fork source {name!r} was deleted")


async def attach(storage: Storage, name: str, stream_log: StreamLog, message: AttachFork) -> ForkSource:
    """A new fork of the source `stream_log`: validate its fork point and count it. With a pin,
    the fork lives on another cluster member, so the count is a pin saved in the source's meta
    before the fork is created."""
    fork, content_type, pin = message.fork, message.content_type, message.pin
    meta = stream_log.meta
    if content_type is not None and media_type(content_type) != media_type(meta.content_type):
        raise ProtocolError(
            409,
            "content_type_mismatch",
            f"the source holds {meta.content_type!r}, the fork asked for {content_type!r}",
        )
    tail = stream_log.published_tail
    position = tail if fork.offset is None else fork.offset.position
    if position > tail:
        raise bad_request(
            "fork_offset_out_of_range", "Stream-Fork-Offset is past the end of the source stream"
        )
    if fork.offset is not None:
        check_incarnation(storage, name, stream_log, fork.offset.incarnation)
    floor = forks.readable_from(storage, stream_log)
    if position < floor:
        raise below_floor(floor, meta.incarnation)
    boundary, end = await forks.probe(storage, stream_log, position)
    if meta.json_mode and not boundary:
        raise bad_request(
            "invalid_fork_offset", "Stream-Fork-Offset is not at a message boundary of the source"
        )
    base = position
    if fork.sub_offset:
        if end is None:
            raise bad_request(
                "fork_sub_offset_out_of_range", "the source holds no data past Stream-Fork-Offset"
            )
        if meta.json_mode:
            result = await forks.read_range(
                storage, stream_log, position, end - position, whole_messages=True, limit=end
            )
            if fork.sub_offset > len(result.messages):
                raise bad_request(
                    "fork_sub_offset_out_of_range",
                    f"Stream-Fork-Sub-Offset {fork.sub_offset} passes the {len(result.messages)} messages "
                    "of the append at Stream-Fork-Offset",
                )
            base = position + sum(len(m) for m in result.messages[: fork.sub_offset])
        else:
            if position + fork.sub_offset > end:
                raise bad_request(
                    "fork_sub_offset_out_of_range",
                    "Stream-Fork-Sub-Offset passes the end of the append at Stream-Fork-Offset",
                )
            base = position + fork.sub_offset
    # The fork will read the source up to its fork point for as long as it lives: under a
    # relaxed fsync policy that point must be on disk first, or a power cut could take back
    # what the fork reads (and leave the fork pointing past its source's end).
    if pin is None:
        await stream_log.make_durable()
        # Counted on the meta in place now, not on `meta`: an append that failed meanwhile put
        # a copy of the durable meta in its place (log.py `_fail`), and a count on the one
        # read before would be lost, the source deleted outright under its fork (sim seed 7582).
        # (The fields read below are the source's own: no append changes them.)
        stream_log.meta.fork_count += 1
        return ForkSource(meta.content_type, meta.ttl_seconds, meta.expires_at, meta.expires_at_ts, base)
    return await _pin_fork(storage, name, stream_log, pin, position, base)


async def _pin_fork(
    storage: Storage, name: str, stream_log: StreamLog, pin: tuple[str, str], position: int, base: int
) -> ForkSource:
    """Saves the pin of a fork another member will own. Counted from the start, so no retention
    pass drops what the pin is about to name while the fork point is made durable; the pin
    names the floor as it is once that is done (retention may have raised it meanwhile)."""
    meta = stream_log.meta
    before = meta.remote_forks
    again = any(p[0] == pin[0] for p in before)  # a retried attach: one pin, one count
    if not again:
        meta.fork_count += 1
    pins = before
    try:
        await stream_log.make_durable()
        low = min(forks.readable_from(storage, stream_log), base)
        if position < low:
            raise below_floor(low, meta.incarnation)
        pins = (*(p for p in before if p[0] != pin[0]), (pin[0], pin[1], low))
        await storage.save_meta(name, replace(stream_log.meta, remote_forks=pins))
    except BaseException as error:
        # On the meta in place now, as in `attach`: a failed append may have replaced it.
        if pins is not before and getattr(error, "happened", False):
            stream_log.meta.remote_forks = pins  # saved, if not durably: the fork may follow
        elif not again:
            stream_log.meta.fork_count -= 1
        raise
    stream_log.meta.remote_forks = pins
    incarnations = (meta.incarnation, *_source_incarnations(storage, stream_log))
    return ForkSource(
        meta.content_type, meta.ttl_seconds, meta.expires_at, meta.expires_at_ts, base, low, incarnations
    )


async def count_out(storage: Storage, name: str, stream_log: StreamLog, pin: str | None) -> bool:
    """A fork of the source `stream_log` is gone: counts it out. `pin`: the stream id of a fork
    another member owned (its pin goes; a second detach is a no-op). True when the source was
    soft-deleted and that was its last fork: it is to be removed now."""
    if pin is not None:
        meta = stream_log.meta
        kept = tuple(p for p in meta.remote_forks if p[0] != pin)
        if len(kept) == len(meta.remote_forks):
            return False
        try:
            await storage.save_meta(name, replace(meta, remote_forks=kept))
        except BaseException as error:
            if not getattr(error, "happened", False):
                raise  # the pin stays, in memory as on disk: a reconcile tries again
        stream_log.meta.remote_forks = kept  # the meta in place now (see `attach`)
    stream_log.meta.fork_count = max(0, stream_log.meta.fork_count - 1)
    return stream_log.meta.soft_deleted and stream_log.meta.fork_count == 0


async def raise_pin(storage: Storage, name: str, stream_log: StreamLog, pin: str, low: int) -> None:
    """A fork on another member reads from `low` up now (its own retention moved on): its pin
    on the source `stream_log` stops holding what lies below. Pins only ever rise."""
    meta = stream_log.meta
    raised = tuple(
        (i, fork, max(held, low)) if i == pin else (i, fork, held) for i, fork, held in meta.remote_forks
    )
    if raised != meta.remote_forks:
        await storage.save_meta(name, replace(meta, remote_forks=raised))
        stream_log.meta.remote_forks = raised  # the meta in place now (see `attach`)


# ---- incarnations ---------------------------------------------------------------------------


def check_incarnation(storage: Storage, name: str, stream_log: StreamLog, incarnation: int) -> None:
    """An offset token must be this stream's, or its fork sources' (a fork shares their
    positions), or carry no incarnation at all; else it belongs to a deleted predecessor."""
    if incarnation == offsets.ANY_INCARNATION:
        return
    meta: StreamMeta | None = stream_log.meta
    while meta is not None:
        if meta.incarnation == incarnation or incarnation in meta.source_incarnations:
            return
        source = storage.open(meta.forked_from) if meta.forked_from else None
        meta = source.meta if source is not None else None
    raise ProtocolError(
        410,
        "offset_of_deleted_stream",
        f"that offset belongs to an earlier stream named {name!r}, deleted since; "
        "this one is new: read it from offset=-1",
    )


def _source_incarnations(storage: Storage, stream_log: StreamLog) -> tuple[int, ...]:
    """The incarnations of this stream's sources, nearest first."""
    found: list[int] = []
    meta: StreamMeta | None = stream_log.meta
    while meta is not None and meta.forked_from is not None:
        if meta.source_incarnations:
            return (*found, *meta.source_incarnations)
        source = storage.open(meta.forked_from)
        meta = source.meta if source is not None else None
        if meta is not None:
            found.append(meta.incarnation)
    return tuple(found)
