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

The middle generation is collected every 30 young collections, not 10: an actor woken for one
append lives `--hibernate-after` seconds, so at 10 it survived a middle collection and was promoted
into the oldest generation, and those promotions set off full collections again. At 100,000 idle
streams, 20,000 appends to hibernated ones spent ~0.9 s in the collector (a 0.6 s full collection
among them, ~45 µs an append) where 20,000 to 1,024 awake streams spent none; at 30, 0.12 s (young
collections only), and 100,000 creates 3.7 s instead of 4.5 s. At 100 the creates took 2.0 s, but
cyclic garbage waited so long for a middle collection that the 5-minute soak's RSS grew 3,637
bytes per stream created (217 at 10, 787 at 30; its verdict flat at 10 and 30, not at 100).
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000
MIDDLE_THRESHOLD = 30


def tune() -> None:
    """Sets the young and middle generations' thresholds for a server process (`streamkeep serve`)."""
    _, _, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_THRESHOLD, old)
