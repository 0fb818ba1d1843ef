"""What the model knows of a cluster run (ops/torture/cluster.py): which member owns a stream, which
answers a member being down explains, and which sources may keep the pin of a fork that is gone.

- Owners: `Placement.owner` from the member ids alone (the placement depends on nothing else), so a
  dumped history is judged again offline exactly as during the run.
- Unavailable answers. While a member is down its streams answer 503 `owner_unavailable` from
  HAProxy (never forwarded: nothing happened), a request it was serving when it died answers 502
  (ambiguous), and a member that cannot reach another answers 503 `member_unavailable` naming it
  (a fork reading its source's range, a fork create attaching to its source). A member stopping
  (`shutting_down`) or recovering (`not_ready`) answers its peers so too, and they pass it on.
  Each is explained only by the window of the member it blames; the other member's streams must
  keep working.
- Leaked pins (streamkeep/cluster/forks.py). A source's member pins a cross-member fork before the
  fork exists, and a deleted fork tells its source over the network; a member dying in between,
  or unreachable then, leaves a pin without its fork until a reconcile (at start, every 300 s)
  drops it. Meanwhile the source counts that fork: deleting it soft-deletes it (and a re-create
  answers 409), as does its expiry. Those answers are allowed for a source that may hold such a
  pin: an incarnation that was the source of a cross-member fork attempt, where some member went
  down after the attempt began. The exact check of leaks is the end-of-run pin count, after both
  members started again (the reconcile at start), in ops/torture/operations/cluster.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ops.torture import contract
from streamkeep.cluster.placement import Member, Placement

# Answers that say a member is (or was just) unreachable, and who is to blame. "owner": the member
# owning the stream asked for; "named": the member the message names; "any": any member (a peer's
# answer passed on: the stream's owner is up, the one it asked was stopping or recovering).
UNAVAILABLE_CODES = {
    "owner_unavailable": "owner",
    "member_unavailable": "named",
    "shutting_down": "any",
    "not_ready": "any",
}
PROXY_STATUSES = frozenset({502, 504})  # HAProxy: the member died (or hung) while serving the request
# HAProxy checks members every second and takes one good check to send traffic again (haproxy.py:
# `inter 1s fall 2 rise 1`), so a member's streams may answer 503 a little after it listens again.
GRACE = 3.0
_NAMED = re.compile(r"cluster member '([^']+)'")


@dataclass
class Membership:
    members: tuple[str, ...]
    placement: Placement = field(init=False)
    # Cross-member fork attempts: (source name, start, end), in the order they were judged.
    cross_forks: list[tuple[str, float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.placement = Placement.of([Member(m, "127.0.0.1:1") for m in self.members], 1)

    def owner(self, name: str) -> str:
        return self.placement.owner(name).id

    def cross(self, source: str, target: str) -> bool:
        return self.owner(source) != self.owner(target)

    # ---- unavailable answers -----------------------------------------------------------------

    def blamed(self, status: int, body: str, name: str | None) -> list[str] | None:
        """The members whose being down would explain this answer; None: not a cluster answer."""
        if status in PROXY_STATUSES:
            return [self.owner(name)] if name else list(self.members)
        how = UNAVAILABLE_CODES.get(contract.error_code(body))
        if how is None:
            return None
        if how == "owner" and name:
            return [self.owner(name)]
        if how == "named" and (found := _NAMED.search(body)) and found.group(1) in self.members:
            return [found.group(1)]
        return list(self.members)

    # ---- pins that may outlive their fork --------------------------------------------------------

    def note_fork(self, source: str, target: str, start: float, end: float) -> None:
        if self.cross(source, target):
            self.cross_forks.append((source, start, end))

    def maybe_leaky(
        self, name: str, created_at: float, time: float, down_since: Callable[[float, float], bool]
    ) -> bool:
        """Whether the incarnation of `name` created at `created_at` may hold a pin whose fork is
        gone by `time`: it may have been the source of a cross-member fork attempt, and a member
        was down at some point between that attempt's start and `time`."""
        return any(
            source == name and created_at <= end and down_since(start, time)
            for source, start, end in self.cross_forks
        )
