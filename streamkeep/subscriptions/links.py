"""Which streams a subscription follows, which incarnation of each, and how far it has acked.

A link remembers the stream id (incarnation) its acked position counts in. Stream actors tell
the manager about every publish, create and delete; the path is noticed on the subscription and
absorbed under its lock before the next change, so links follow the streams:

- a stream the pattern matches that appeared after the subscription is linked at its start:
  everything in a new stream is new;
- a deleted stream (gone, or soft-deleted while forks read it) drops its glob link; an explicit
  link names the stream on purpose, so it stays, reset for the next incarnation;
- a new incarnation under a linked name restarts the link at the new stream's start.

All of this is derived from the streams themselves, so it is redone after a restart (`reconcile`)
rather than saved at every publish.

In a cluster the streams are read through `KnownStreams` (remote.py): other members' streams as
their members last told us, and a stream not heard of yet changes no link.
"""

from __future__ import annotations

from typing import Any

from streamkeep.protocol import offsets
from streamkeep.protocol.errors import ProtocolError, bad_request
from streamkeep.storage.base import Storage
from streamkeep.subscriptions.remote import KnownStreams
from streamkeep.subscriptions.state import UNKNOWN_STREAM_ID, Link, Subscription, Tail, Wake


class Links:
    def __init__(self, storage: Storage, view: KnownStreams | None = None) -> None:
        self.storage = storage
        # Alone, the storage's own methods, bound once: no extra step on the way to a stream.
        self._open = storage.open if view is None else view.open
        self._names = storage.names if view is None else view.names
        self._unknown = None if view is None else view.unknown
        self.cursor_jumps = 0  # cursors moved up to a retention floor (metrics)

    def _live(self, path: str) -> Any:
        """The stream's log (or a remote stream's last known state), None if it is gone."""
        stream_log = self._open(path)
        if stream_log is None or stream_log.meta.soft_deleted:
            return None
        return stream_log

    # ---- following the streams -------------------------------------------------------------

    def notice(self, sub: Subscription, path: str) -> bool:
        """Called at every publish, create and delete of `path`: True if `sub` cares."""
        if path in sub.links or sub.matches(path):
            sub.noticed.add(path)
            return True
        return False

    def absorb(self, sub: Subscription) -> None:
        """Brings the links of noticed paths up to date (call holding `sub.lock`)."""
        while sub.noticed:
            self.refresh(sub, sub.noticed.pop())

    def refresh(self, sub: Subscription, path: str) -> None:
        if path == sub.config.wake_stream:
            sub.links.pop(path, None)  # linked by an older version: it would wake itself forever
            return
        if self._unknown is not None and self._unknown(path):
            return  # another member's stream it has not told us about yet: it will
        link = sub.links.get(path)
        if link is None and not sub.matches(path):
            return  # unrelated: not opened (after a start that served early, opening reads it)
        try:
            stream_log = self._live(path)
        except ProtocolError:  # not readable now (read at start, failing): its next change says
            return
        if stream_log is None:
            if link is None:
                return
            if link.explicit:
                link.acked, link.stream_id = 0, None  # waits for the next incarnation
            else:
                del sub.links[path]
            return
        meta = stream_log.meta
        if link is None:
            if sub.matches(path):
                sub.links[path] = Link(meta.fork_base, glob=True, stream_id=meta.stream_id)
        elif link.stream_id == UNKNOWN_STREAM_ID:
            link.stream_id = meta.stream_id  # an old state file: it counted in this incarnation
        elif link.stream_id != meta.stream_id:
            link.acked, link.stream_id = meta.fork_base, meta.stream_id
        link = sub.links.get(path)
        if link is not None and link.acked < stream_log.floor:
            # Retention dropped what this cursor had not acked yet: it jumps to the floor, and
            # its view and the metrics say how much it missed.
            link.skipped += stream_log.floor - link.acked
            link.acked = stream_log.floor
            self.cursor_jumps += 1

    def reconcile(self, sub: Subscription) -> None:
        """After loading saved state: links follow what happened to the streams since it was
        saved, and matching streams created since then are linked at their start (any stream
        that existed when the state was saved was linked then)."""
        for path in list(sub.links):
            self.refresh(sub, path)
        if sub.config.pattern is not None:
            for path in self._names():
                if path not in sub.links:
                    self.refresh(sub, path)

    # ---- membership --------------------------------------------------------------------------

    def backfill(self, sub: Subscription) -> None:
        """A new subscription: existing matches and explicit streams are linked at their tails, so
        creating it replays nothing (§6.2)."""
        for path in self._names():
            if sub.matches(path) and (stream_log := self._live(path)) is not None:
                sub.links[path] = Link(
                    stream_log.published_tail, glob=True, stream_id=stream_log.meta.stream_id
                )
        for path in sub.config.streams:
            self.add_explicit(sub, path)

    def add_explicit(self, sub: Subscription, path: str) -> None:
        link = sub.links.get(path)
        if link is None:
            stream_log = self._live(path)
            if stream_log is None:
                link = Link(0)
            else:
                link = Link(stream_log.published_tail, stream_id=stream_log.meta.stream_id)
            sub.links[path] = link
        link.explicit = True

    def remove_explicit(self, sub: Subscription, path: str) -> None:
        link = sub.links.get(path)
        if link is None or not link.explicit:
            return
        link.explicit = False
        unknown = self._unknown is not None and self._unknown(path)
        link.glob = sub.matches(path) and (unknown or self._live(path) is not None)
        if not link.glob:
            del sub.links[path]

    # ---- cursors -----------------------------------------------------------------------------

    def tail(self, link: Link, path: str) -> int | None:
        """The stream's tail, if the stream exists in the incarnation the link counts in."""
        stream_log = self._live(path)
        if stream_log is None or stream_log.meta.stream_id != link.stream_id:
            return None
        return stream_log.published_tail

    def pending(self, sub: Subscription) -> list[str]:
        return [
            path
            for path, link in sub.links.items()
            if (tail := self.tail(link, path)) is not None and tail > link.acked
        ]

    def snapshot(self, sub: Subscription) -> dict[str, Tail]:
        return {
            path: Tail(tail, link.stream_id)
            for path, link in sub.links.items()
            if (tail := self.tail(link, path)) is not None
        }

    def apply_acks(self, sub: Subscription, acks: list[tuple[str, offsets.Offset]], wake: Wake) -> None:
        """Moves cursors forward (never back). Call inside `store.change`: a refused ack undoes
        the ones before it."""
        for path, offset in acks:
            link = sub.links.get(path)
            if link is None:
                if path in wake.snapshot:
                    continue  # deleted since the wake was issued: nothing left to ack
                raise bad_request("UNKNOWN_STREAM", f"{path!r} is not linked to this subscription")
            if offset.incarnation not in (offsets.ANY_INCARNATION, link.incarnation):
                raise ProtocolError(
                    409,
                    "STALE_OFFSET",
                    f"the offset for {path!r} belongs to an earlier incarnation of the stream (it was "
                    "deleted and created again); ack offsets read from the current stream",
                )
            tail = self.tail(link, path)
            if tail is not None and offset.position > tail:
                raise bad_request("OFFSET_OUT_OF_RANGE", f"ack for {path!r} is past the stream's tail")
            link.acked = max(link.acked, offset.position)

    def ack_snapshot(self, sub: Subscription, wake: Wake) -> None:
        """A webhook answered {"done": true}: ack every tail of the wake still in the same stream."""
        for path, tail in wake.snapshot.items():
            link = sub.links.get(path)
            if link is not None and link.stream_id == tail.stream_id:
                link.acked = max(link.acked, tail.position)

    def view(self, sub: Subscription, wake: Wake | None = None) -> list[dict]:
        """The `streams` of responses and wakes; offsets in each stream's own incarnation."""
        items = []
        for path in sorted(sub.links):
            link = sub.links[path]
            item: dict = {
                "path": path,
                "link_type": "explicit" if link.explicit else "glob",
                "acked_offset": offsets.encode(link.acked, link.incarnation),
            }
            if link.skipped:
                item["skipped_bytes"] = link.skipped  # dropped by retention before it was acked
            if wake is not None:
                snapped = wake.snapshot.get(path)
                same = snapped is not None and snapped.stream_id == link.stream_id
                tail = snapped.position if same and snapped is not None else link.acked
                # A cursor that retention moved up since the wake (to a floor past the wake's
                # tail) has nothing of the wake pending: its tail is not behind its ack.
                tail = max(tail, link.acked)
                item["tail_offset"] = offsets.encode(tail, link.incarnation)
                item["has_pending"] = tail > link.acked
            items.append(item)
        return items
