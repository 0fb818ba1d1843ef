"""A server process runs the garbage collector with a young threshold for a large, long-lived heap
(streamkeep/collector.py: at CPython's default, full collections over every stream's objects cost a
tenth of each create with 20,000 streams)."""

from __future__ import annotations

import gc

from streamkeep import collector


def test_tune_raises_the_young_and_middle_thresholds_and_keeps_the_oldest() -> None:
    before = gc.get_threshold()
    try:
        collector.tune()
        assert gc.get_threshold() == (collector.YOUNG_THRESHOLD, collector.MIDDLE_THRESHOLD, before[2])
        assert collector.YOUNG_THRESHOLD > before[0] and collector.MIDDLE_THRESHOLD > before[1]
        assert gc.isenabled()  # tuned, never turned off: cycles are still collected
    finally:
        gc.set_threshold(*before)
