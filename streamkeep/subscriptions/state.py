"""A subscription's state: its links (one cursor per stream), its current wake, its retry schedule,
and the codec of the state file. Only what is persisted here is ever claimed to a client; the
rest (locks, noticed stream changes, failure backoff, the glob cache) lives and dies with the
process.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import trio

from streamkeep.auth.scopes import Grants
from streamkeep.protocol import offsets
from streamkeep.subscriptions.config import SubscriptionConfig

# A link read from a state file written before links recorded their stream's incarnation: it
# tracks whichever incarnation exists when the state is loaded (what those files meant).
UNKNOWN_STREAM_ID = ""
MATCH_CACHE_SIZE = 1024


@dataclass
class Link:
    acked: int  # byte position in the incarnation below, inclusive (§7)
    explicit: bool = False
    glob: bool = False
    # The stream id (incarnation) whose positions `acked` counts; None while the stream does not
    # exist, so its next incarnation starts from its beginning.
    stream_id: str | None = None
    # Bytes the cursor skipped because retention dropped them before they were acked.
    skipped: int = 0

    @property
    def incarnation(self) -> int:
        if not self.stream_id:
            return offsets.ANY_INCARNATION
        return offsets.incarnation_of(self.stream_id)


class Tail(NamedTuple):
    """A stream's tail when a wake was issued, with the incarnation it counts in."""

    position: int
    stream_id: str | None


@dataclass(frozen=True)
class Owner:
    """Who created a subscription with auth on, and what their token could read then. A glob
    cannot be checked against streams that do not exist yet, so every stream it would link is
    checked against these grants when it is linked: a token for `a/**` subscribing to `**`
    follows `a/...` streams only."""

    subject: str | None
    grants: Grants

    def to_json(self) -> dict:
        return {"subject": self.subject, "grants": self.grants.to_list()}

    @classmethod
    def from_json(cls, raw: dict) -> Owner:
        return cls(raw.get("subject"), Grants.from_list(raw.get("grants") or []))


@dataclass
class Wake:
    wake_id: str
    generation: int
    snapshot: dict[str, Tail]  # stream path -> its tail when the wake was issued
    holder: str | None = None
    lease_until: float | None = None  # wall-clock seconds


@dataclass
class Subscription:
    id: str
    config: SubscriptionConfig
    created_at: str
    base_url: str
    owner: Owner | None = None  # None: created with auth off, follows any stream
    links: dict[str, Link] = field(default_factory=dict)
    generation: int = 0
    wake: Wake | None = None
    status: str = "active"
    attempts: int = 0
    next_attempt_at: float | None = None
    deleted: bool = False
    # ---- in memory only ----
    lock: trio.Lock = field(default_factory=trio.Lock, repr=False)
    kick: trio.Event = field(default_factory=trio.Event, repr=False)
    # Paths whose stream changed (published, created, deleted) since the links last looked.
    noticed: set[str] = field(default_factory=set, repr=False)
    # The driver's backoff after failures of its own (not the receiver's): count and until when
    # (trio clock).
    fault_count: int = 0
    fault_until: float | None = None
    _matches: dict[str, bool] = field(default_factory=dict, repr=False)

    def poke(self) -> None:
        self.kick.set()

    def matches(self, path: str) -> bool:
        """`config.matches`, remembered for recently seen paths: every publish of every stream
        asks, and mostly about paths that never match."""
        hit = self._matches.get(path)
        if hit is None:
            hit = self.config.matches(path) and (self.owner is None or self.owner.grants.allows("read", path))
            if len(self._matches) >= MATCH_CACHE_SIZE:
                del self._matches[next(iter(self._matches))]  # the oldest entry
            self._matches[path] = hit
        return hit

    def issue(self, snapshot: dict[str, Tail], now: float) -> Wake:
        """A new wake over `snapshot`, with the next generation (in memory: the caller saves)."""
        self.generation += 1
        lease = now + self.config.lease_ttl_ms / 1000 if self.config.type == "webhook" else None
        self.wake = Wake("w_" + secrets.token_urlsafe(12), self.generation, snapshot, lease_until=lease)
        return self.wake

    # ---- undo: a change that cannot be saved is rolled back -----------------------------------

    def capture(self, *, links: bool = True) -> tuple:
        """Everything a change may touch, copied; compares equal while nothing changed. Without
        `links` (for changes that never touch them), the cursors are neither copied nor undone."""
        wake = self.wake
        return (
            {path: replace(link) for path, link in self.links.items()} if links else None,
            self.generation,
            None if wake is None else replace(wake, snapshot=dict(wake.snapshot)),
            self.status,
            self.attempts,
            self.next_attempt_at,
        )

    def restore(self, captured: tuple) -> None:
        links, self.generation, self.wake, self.status, self.attempts, self.next_attempt_at = captured
        if links is not None:
            self.links = {path: replace(link) for path, link in links.items()}

    # ---- the state file ----------------------------------------------------------------------

    def to_state(self) -> dict:
        wake = self.wake
        return {
            "id": self.id,
            "config": self.config.to_json(),
            "created_at": self.created_at,
            "base_url": self.base_url,
            "owner": None if self.owner is None else self.owner.to_json(),
            "links": {
                path: [link.acked, link.explicit, link.glob, link.stream_id, link.skipped]
                for path, link in self.links.items()
            },
            "generation": self.generation,
            "wake": None
            if wake is None
            else [
                wake.wake_id,
                wake.generation,
                {path: list(tail) for path, tail in wake.snapshot.items()},
                wake.holder,
                wake.lease_until,
            ],
            "status": self.status,
            "attempts": self.attempts,
            "next_attempt_at": self.next_attempt_at,
        }

    @classmethod
    def from_state(cls, raw: dict) -> Subscription:
        sub = cls(raw["id"], SubscriptionConfig.from_json(raw["config"]), raw["created_at"], raw["base_url"])
        if raw.get("owner") is not None:
            sub.owner = Owner.from_json(raw["owner"])
        sub.links = {path: _link(value) for path, value in raw["links"].items()}
        sub.generation = raw["generation"]
        sub.status = raw["status"]
        sub.attempts = raw["attempts"]
        sub.next_attempt_at = raw["next_attempt_at"]
        # A wake in flight at a crash is over: its holder's lease is void, and pending work is
        # woken again with a new generation (acks never moved past what was acknowledged).
        return sub


def _link(value: list) -> Link:
    if len(value) == 3:  # [acked, explicit, glob]: written before links knew their incarnation
        acked, explicit, glob = value
        return Link(acked, explicit, glob, UNKNOWN_STREAM_ID)
    acked, explicit, glob, stream_id, *rest = value
    return Link(acked, explicit, glob, stream_id, rest[0] if rest else 0)
