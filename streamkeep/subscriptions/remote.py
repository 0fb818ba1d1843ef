"""What subscriptions need from a cluster, seen from this package (None when not clustered).

A subscription lives on one member and follows streams on every member. Its links read a stream's
state through `KnownStreams` (the streams as this member knows them; not the actors' `StreamView`
of one stream): this member's storage for its own streams, and what their members last said for
the others', where a stream no member has spoken of yet is *unknown* (not gone: a link to it is
left as it is until it is heard of). `Remote` is the rest: control requests that reached the
wrong member, telling the other members what a subscription follows, fresh tails before an ack is
judged, and wake events for wake streams another member owns. `streamkeep/cluster/subscriptions.py`
implements both; this package never imports the cluster code.

Its calls may wait for another member (up to 5 s; at once refused for one known to be failing), so
the subscriptions never make them holding a subscription's lock: a hung member must not stall the
subscription's other calls (api.py, wakes.py, delivery.py).
"""

from __future__ import annotations

from typing import Any, Protocol

from streamkeep.protocol.model import Request, Response
from streamkeep.subscriptions.state import Subscription


class KnownStreams(Protocol):
    def open(self, path: str) -> Any:
        """A stream's state (`meta.stream_id`, `meta.fork_base`, `meta.soft_deleted`,
        `published_tail`, `floor`), or None if it does not exist or is not known yet."""
        ...

    def names(self) -> list[str]:
        """Every stream known to exist: this member's and the matching ones of the others."""
        ...

    def unknown(self, path: str) -> bool:
        """True for another member's stream it has not told us about yet."""
        ...


class Remote(Protocol):
    @property
    def view(self) -> KnownStreams: ...

    async def run(self, *, task_status: Any = ...) -> None:
        """The background work: learning the other members' subscriptions and telling them
        about this member's streams (`nursery.start` it: started, it answers the others)."""
        ...

    async def route(self, request: Request) -> Response | None:
        """The answer of the member that owns the subscription a control request names, or None
        if this member does."""
        ...

    async def announce(self, sub: Subscription, extra: tuple[str, ...] = ()) -> None:
        """Tells every member what `sub` follows (its pattern, its explicit streams and `extra`)
        and learns their matching streams; raises a 503 if one cannot be reached (at once for one
        known to be failing). Tells nobody if `sub` was deleted meanwhile."""
        ...

    async def catch_up(self, sub: Subscription) -> None:
        """Asks every member for the current state of the streams `sub` follows there (a claim
        that would find no work: what a client appended just before may not be reported yet)."""
        ...

    def forget(self, sub: Subscription) -> None:
        """`sub` was deleted: the other members may stop telling us about its streams."""
        ...

    async def refresh(self, sub: Subscription, acks: list[tuple[str, int]]) -> None:
        """Asks the members of remote streams acked past their last known tail for their tails."""
        ...

    def elsewhere(self, path: str) -> bool:
        """True if another member owns stream `path` (its wake events go through `append_wake`)."""
        ...

    async def append_wake(self, path: str, body: bytes) -> bool:
        """Appends a wake event to `path` on its member; False if this member owns it."""
        ...

    def stats(self) -> dict: ...
