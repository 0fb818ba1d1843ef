"""A bound on the segment descriptors a disk storage keeps open for writing.

A stream that was written keeps its active segment's write descriptor while its actor is awake
(`DiskLog.release_descriptor` closes it when the actor hibernates). Streams written faster than
they hibernate held one each: 4,000 distinct streams a second with `--hibernate-after 5` is 20,000
descriptors, the whole limit of the dev VM, and appends then failed 503 with EMFILE (issue 26,
`ops.bench_streams` at 100,000 streams). The budget keeps the most recently written ones and, when
a round goes past it, gives back the least recently written; the next write to such a stream opens
its segment again (writer.py `_active_fd`). A stream busy with its descriptor (queued, being
written or synced) keeps it and is asked again at the next trim.

A stream holding writes not yet synced (`dirty`: under fsync=interval until its next sync, under
fsync=never until one is asked for) gives its descriptor back only once synced: a descriptor opened
later may never hear of a writeback error on the pages it did not write, so the clean stop's sync
through it could call lost bytes durable. The trim lists such streams (`take_unsynced`) and tells
the storage (`on_unsynced`), which syncs them and gives them back (`synced`). Before, fsync=never
gave nothing back, and 12,000 streams written under a 4,096-descriptor limit answered 7,899 appends
5xx (EMFILE).
"""

from __future__ import annotations

import resource
from collections import OrderedDict
from collections.abc import Callable
from itertools import islice
from typing import Protocol

# A trim runs once this many streams joined since the last one (fewer for a small budget), and
# looks at twice as many of the oldest at most: its work stays a few steps per write, even when the
# oldest are all busy (dirty under fsync=interval) and give nothing back.
SLACK = 64


class HoldsDescriptor(Protocol):
    dirty: bool  # holds writes not yet synced: its descriptor goes back only after a sync

    def descriptor_open(self) -> bool: ...

    def release_descriptor(self) -> None:
        """Closes the descriptor if nothing of the stream needs it now."""
        ...


class DescriptorBudget:
    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        # A small budget (the simulation's) is kept exactly: a trim at every stream that joins.
        self.slack = max(1, min(SLACK, self.limit // 8))
        self._holders: OrderedDict[HoldsDescriptor, None] = OrderedDict()
        self._joined = 0  # holders added since the last trim
        self._unsynced: dict[HoldsDescriptor, None] = {}  # kept by unsynced writes: to sync, in order
        self.on_unsynced: Callable[[], None] | None = None  # told when `_unsynced` gets a holder
        self.given_back = 0  # descriptors closed to stay within the budget, for /stats

    def wrote(self, holder: HoldsDescriptor) -> None:
        """`holder` wrote through its descriptor (on the event loop, after its round)."""
        holders = self._holders
        if holder in holders:
            holders.move_to_end(holder)
            return
        holders[holder] = None
        self._joined += 1
        if self._joined >= self.slack and len(holders) > self.limit:
            self._trim()

    def released(self, holder: HoldsDescriptor) -> None:
        """`holder` closed its descriptor (hibernation, a delete, or this budget)."""
        self._holders.pop(holder, None)

    @property
    def held(self) -> int:
        return len(self._holders)

    def take_unsynced(self) -> list[HoldsDescriptor]:
        """The holders a trim could not give back for their unsynced writes, oldest first."""
        unsynced, self._unsynced = list(self._unsynced), {}
        return unsynced

    def synced(self, holder: HoldsDescriptor, was_open: bool) -> None:
        """`holder` (from `take_unsynced`, its descriptor open before the sync if `was_open`) was
        synced: its descriptor goes back, unless it is busy with it again (the next trim asks
        again). A sync of an idle stream gives it back itself (log_state.py `exclusive`)."""
        if holder.descriptor_open():
            holder.release_descriptor()
        if was_open and not holder.descriptor_open():
            self.given_back += 1

    def _trim(self) -> None:
        self._joined = 0
        holders = self._holders
        oldest = list(islice(holders, min(len(holders) - self.limit + self.slack, 2 * SLACK)))
        asked = False
        for holder in oldest:
            if holder.descriptor_open():
                holder.release_descriptor()
                if holder.descriptor_open():
                    holders.move_to_end(holder)  # busy with it: asked again after the others
                    if holder.dirty and holder not in self._unsynced:
                        self._unsynced[holder] = None  # only a sync lets it go
                        asked = True
                    continue
                self.given_back += 1
            holders.pop(holder, None)
        if asked and self.on_unsynced is not None:
            self.on_unsynced()


def default_limit() -> int:
    """Half the process's descriptor limit: the rest is for connections, reads and the cold tier."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(64, soft // 2)
