"""How the cyclic garbage collector runs in a server process, which holds a large, long-lived heap.

Every stream keeps a few objects for as long as the process runs (its log, meta, segments: ~2 KiB,
docs/architecture.md section 4), and an actor woken by a request lives seconds, long enough to be
promoted into the oldest generation. At CPython's default young threshold (700 allocations) those
promotions set off full collections that walk every stream's objects: with 20,000 idle streams the
collector took 4.8 s of CPU for 20,000 creates (~240 us each, a tenth of a create) and 5.9 s for
20,000 appends to hibernated streams (~300 us each). A young threshold of 20,000 lets most of a
request's garbage die before it is scanned and promotes far less: 1.1 s and 1.5 s for the same work
(docs/benchmarks.md, "Many streams", issue 26). Reference counting frees everything without a cycle
as before; only cyclic garbage waits a little longer, at most 20,000 allocations.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000


def tune() -> None:
    """Sets the young generation's threshold for a server process (`streamkeep serve`)."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
