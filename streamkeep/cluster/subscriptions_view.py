"""The data of subscriptions across members: who keeps a subscription, what a member knows of the
other members' streams, and what it knows of the other members' subscriptions. No I/O here: the
calls that fill these tables are in `subscriptions.py`.

Every report is stamped `(boot, n)` by the member that makes it: `boot` names that process (its
start time in nanoseconds), `n` counts up within it, and the stamp is taken when the state is read.
So a later reading always carries a larger `n`, even when two reports overtake each other on the
way (a push sent while the answer to an older question is still in flight). A boot not seen before
is a restart: its first word outranks everything the member's previous lives said, whatever the
clock did meanwhile, and a late word of a previous life is dropped. Stale reports are never applied.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, NamedTuple

from streamkeep.cluster.placement import Member, Placement, slot
from streamkeep.protocol.globs import Glob, compile_glob
from streamkeep.storage.base import Storage

Stamp = tuple[int, int]
# What a member says of one of its streams: None (gone: deleted, or soft-deleted while forks read
# it) or [published tail, stream id, fork base, retention floor].
WireState = list[Any] | None
# What a member says one of its subscriptions follows: [pattern, wake stream, explicit paths].
WireInterest = list[Any]

GONE_KEPT_S = 600.0  # how long a stream's deletion is remembered (its links have long absorbed it)
MATCH_CACHE_SIZE = 4096


def subscription_owner(placement: Placement, sub_id: str) -> Member:
    """The member that keeps subscription `sub_id`: the one HAProxy sends its control requests to,
    `path,field(6,/),crc32,mod(4096)` of `/v1/stream/__ds/subscriptions/<id>/...` (haproxy.py).
    Ids are unreserved characters only (config.check_id), which clients send as they are, so the
    decoded id hashes as HAProxy hashes what it receives. Not `placement.owner(sub_id)`: that
    hashes a stream's whole path."""
    return placement.owner_of_slot(slot(sub_id))


def state_of(storage: Storage, path: str) -> WireState:
    """What this member says of its stream `path`."""
    stream_log = storage.open(path)
    if stream_log is None or stream_log.meta.soft_deleted:
        return None
    meta = stream_log.meta
    return [stream_log.published_tail, meta.stream_id, meta.fork_base, stream_log.floor]


class Boots:
    """Which process of each member speaks now; stamps of the same process compare by `n`."""

    def __init__(self) -> None:
        self._current: dict[str, int] = {}
        self._retired: dict[str, set[int]] = {}

    def newer(self, member: str, held: Stamp | None, stamp: Stamp) -> bool:
        """Whether `stamp` (from `member`) supersedes `held` (None: nothing held)."""
        boot = stamp[0]
        current = self._current.get(member)
        if current != boot:
            if boot in self._retired.get(member, ()):
                return False  # a word of a previous life, arriving late
            if current is not None:
                self._retired.setdefault(member, set()).add(current)
            self._current[member] = boot
        return held is None or held[0] != boot or stamp[1] >= held[1]


class RemoteMeta(NamedTuple):
    stream_id: str
    fork_base: int
    soft_deleted: bool = False


class RemoteStream:
    """Another member's stream as it last told us: what `Links` reads of a stream's log."""

    __slots__ = ("floor", "member", "meta", "published_tail")

    def __init__(self, member: str, state: list[Any]) -> None:
        tail, stream_id, fork_base, floor = state
        self.member = member
        self.published_tail = int(tail)
        self.meta = RemoteMeta(str(stream_id), int(fork_base))
        self.floor = int(floor)

    def same(self, other: RemoteStream | None) -> bool:
        return (
            other is not None
            and other.published_tail == self.published_tail
            and other.meta == self.meta
            and other.floor == self.floor
        )


class RemoteStreams:
    """The subscriptions' view of every stream (remote.KnownStreams): this member's from its
    storage, the others' as their members last reported them."""

    def __init__(self, placement: Placement, member_id: str, storage: Storage) -> None:
        self.placement = placement
        self.member_id = member_id
        self.storage = storage
        self.known: dict[str, RemoteStream | None] = {}  # None: gone
        self._stamps: dict[str, Stamp] = {}
        self._boots = Boots()
        self._gone_at: dict[str, float] = {}
        self._pruned_at = time.monotonic()
        self.applied = 0
        self.stale = 0  # reports older than one already applied

    # ---- remote.KnownStreams -----------------------------------------------------------------

    def open(self, path: str) -> Any:
        stream_log = self.storage.open(path)
        if stream_log is not None:
            return stream_log
        return self.known.get(path)

    def names(self) -> list[str]:
        return [*self.storage.names(), *(path for path, state in self.known.items() if state is not None)]

    def unknown(self, path: str) -> bool:
        return path not in self.known and self.placement.owner(path).id != self.member_id

    # ---- reports -----------------------------------------------------------------------------

    def apply(self, member: str, stamp: Stamp, path: str, state: WireState) -> bool:
        """Takes `member`'s report on `path`; True if it changed what we know (the links must look)."""
        if not isinstance(path, str) or self.placement.owner(path).id != member:
            return False  # only a stream's own member speaks for it
        stream = None if state is None else RemoteStream(member, state)  # a malformed one raises here
        if not self._boots.newer(member, self._stamps.get(path), stamp):
            self.stale += 1
            return False
        self._stamps[path] = stamp
        self.applied += 1
        before = self.known.get(path, False)
        if stream is None:
            self.known[path] = None
            self._gone_at[path] = time.monotonic()
            self._prune()
            return before is not None
        self.known[path] = stream
        self._gone_at.pop(path, None)
        return before is False or not stream.same(before)  # type: ignore[arg-type]

    def known_of(self, member: str, also: Iterable[str] = ()) -> list[str]:
        """The paths of `member`'s streams we know of or follow (`also`): after a restart of
        either side it reports on each, gone ones included."""
        paths = {path for path, state in self.known.items() if state is not None and state.member == member}
        paths.update(path for path in also if path not in paths and self.placement.owner(path).id == member)
        return sorted(paths)

    def _prune(self) -> None:
        now = time.monotonic()
        if now - self._pruned_at < GONE_KEPT_S / 10:
            return
        self._pruned_at = now
        for path, since in list(self._gone_at.items()):
            if now - since > GONE_KEPT_S:
                del self._gone_at[path]
                if self.known.get(path, False) is None:
                    del self.known[path]
                    self._stamps.pop(path, None)

    def stats(self) -> dict[str, int]:
        live = sum(1 for state in self.known.values() if state is not None)
        return {"remote_streams": live, "remote_gone": len(self.known) - live, "reports_applied": self.applied,
                "reports_stale": self.stale}  # fmt: skip


class Interest:
    """Which streams one subscription follows, as its member told the others: the pattern (never
    its wake stream) and explicit paths. The owner applies the creator's grants itself; a member
    telling it about a stream it may not link costs a message, nothing more."""

    __slots__ = ("_glob", "pattern", "streams", "wake_stream")

    def __init__(self, pattern: str | None, wake_stream: str | None, streams: Iterable[str]) -> None:
        self.pattern = pattern
        self.wake_stream = wake_stream
        self.streams = frozenset(streams)
        self._glob: Glob | None = None if pattern is None else compile_glob(pattern)

    @classmethod
    def from_wire(cls, raw: Any) -> Interest:
        pattern, wake_stream, streams = raw
        if pattern is not None and (not isinstance(pattern, str) or len(pattern) > 1024):
            raise ValueError("a pattern is a string of at most 1 KiB")
        if not isinstance(streams, list) or not all(isinstance(path, str) for path in streams):
            raise ValueError("streams is a list of paths")
        return cls(pattern, wake_stream if isinstance(wake_stream, str) else None, streams)

    def to_wire(self) -> WireInterest:
        return [self.pattern, self.wake_stream, sorted(self.streams)]

    def matches(self, path: str) -> bool:
        if path in self.streams:
            return True
        return self._glob is not None and path != self.wake_stream and self._glob.match(path)


class Interests:
    """The other members' subscriptions, by member: which of this member's streams each wants to
    hear about. Entries carry the stamp of the word that set them; a deleted subscription leaves a
    tombstone, so a late word of an older version cannot bring it back."""

    def __init__(self) -> None:
        self._by_member: dict[str, dict[str, tuple[Stamp, Interest | None]]] = {}
        self._cache: dict[str, tuple[str, ...]] = {}  # path -> members interested
        self._boots = Boots()

    def update(self, member: str, stamp: Stamp, sub_id: str, interest: Interest | None) -> None:
        entries = self._by_member.setdefault(member, {})
        held = entries.get(sub_id)
        if not self._boots.newer(member, None if held is None else held[0], stamp):
            return
        entries[sub_id] = (stamp, interest)
        self._cache.clear()

    def replace(self, member: str, stamp: Stamp, interests: dict[str, Interest]) -> None:
        """All of `member`'s subscriptions as of `stamp`: newer single words are kept."""
        entries = self._by_member.setdefault(member, {})
        if not self._boots.newer(member, None, stamp):
            return
        for sub_id, (held, _) in list(entries.items()):
            if sub_id not in interests and self._boots.newer(member, held, stamp):
                entries[sub_id] = (stamp, None)
        for sub_id, interest in interests.items():
            held_entry = entries.get(sub_id)
            if self._boots.newer(member, None if held_entry is None else held_entry[0], stamp):
                entries[sub_id] = (stamp, interest)
        self._cache.clear()

    def of(self, member: str) -> list[Interest]:
        return [interest for _, interest in self._by_member.get(member, {}).values() if interest is not None]

    def matches(self, member: str, path: str) -> bool:
        return any(interest.matches(path) for interest in self.of(member))

    def members_for(self, path: str) -> tuple[str, ...]:
        """The members with a subscription that follows `path`: on every publish, so remembered."""
        hit = self._cache.get(path)
        if hit is None:
            hit = tuple(member for member in self._by_member if self.matches(member, path))
            if len(self._cache) >= MATCH_CACHE_SIZE:
                del self._cache[next(iter(self._cache))]
            self._cache[path] = hit
        return hit

    def count(self) -> dict[str, int]:
        return {member: len(self.of(member)) for member in self._by_member}
