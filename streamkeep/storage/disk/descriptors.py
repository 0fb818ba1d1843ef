"""A bound on the segment descriptors a disk storage keeps open for writing.

A stream that was written keeps its active segment's write descriptor while its actor is awake
(`DiskLog.release_descriptor` closes it when the actor hibernates). Streams written faster than
they hibernate held one each: 4,000 distinct streams a second with `--hibernate-after 5` is 20,000
descriptors, the whole limit of the dev VM, and appends then failed 503 with EMFILE (issue 26,
`ops.bench_streams` at 100,000 streams). The budget keeps the most recently written ones and, when
a round goes past it, gives back the least recently written; the next write to such a stream opens
its segment again (writer.py `_active_fd`). A stream busy with its descriptor (queued, being
written or synced, dirty under fsync=interval) keeps it and is asked again at the next trim.
Under fsync=never nothing gives a descriptor back (not even hibernation: a clean stop syncs
through it), so that mode keeps one per stream ever written, and is not counted here.
"""

from __future__ import annotations

import resource
from collections import OrderedDict
from itertools import islice
from typing import Protocol

# A trim runs once this many streams joined since the last one (fewer for a small budget), and
# looks at twice as many of the oldest at most: its work stays a few steps per write, even when the
# oldest are all busy (dirty under fsync=interval) and give nothing back.
SLACK = 64


class HoldsDescriptor(Protocol):
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

    def _trim(self) -> None:
        self._joined = 0
        holders = self._holders
        oldest = list(islice(holders, min(len(holders) - self.limit + self.slack, 2 * SLACK)))
        for holder in oldest:
            if holder.descriptor_open():
                holder.release_descriptor()
                if holder.descriptor_open():
                    holders.move_to_end(holder)  # busy with it: asked again after the others
                    continue
                self.given_back += 1
            holders.pop(holder, None)


def default_limit() -> int:
    """Half the process's descriptor limit: the rest is for connections, reads and the cold tier."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(64, soft // 2)
