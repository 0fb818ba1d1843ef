"""Retention: streams that live forever on bounded storage (`[[retention]]` rules, `--retention-*`).

A background pass looks at every stream with a rule (the first whose glob matches its name) and
drops whole sealed segments from its front while they are older than `max_age` or the stream
holds more than `max_bytes` without them (Kafka's semantics: what is left stays at or above the
limit, at most one segment more); never the segment being written. It works in two steps, each
crash-safe (DiskLog.raise_floor, DiskLog.drop_held, in log_retention.py):

1. the **floor** readers see moves up, its checkpoint durable first (segments/floor.py): reads
   below it answer 410, `offset=-1` starts there;
2. what is **held** follows, up to the floor but never past a fork point: a fork pins its
   source's bytes up to where it forked until it is deleted (forks are on disk, so the pin is as
   durable as the fork); through a chain of forks, every ancestor is pinned. Bucket objects of dropped segments go through the cold tier's delete
   queue.

Each pass drops at most `max_segments_per_pass` segments and yields between streams, so a stream
with a million segments costs many short passes, never a stalled loop.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import trio

from streamkeep.health import Health
from streamkeep.protocol.globs import compile_glob
from streamkeep.storage import forks
from streamkeep.storage.base import Storage, StreamLog
from streamkeep.storage.disk.log import DiskLog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionRule:
    streams: str  # a glob over stream names (`*` one segment, `**` any)
    max_age: float | None = None  # seconds since a segment's last append
    max_bytes: int | None = None  # bytes a stream keeps (at least; at most one segment more)
    # "state": compact State Protocol streams (compaction.py) once the history since the last
    # snapshot is `compact_ratio` times the snapshot (and at least `compact_min_bytes`).
    compact: str | None = None
    compact_ratio: float = 4.0
    compact_min_bytes: int = 1 << 20

    def matches(self, name: str) -> bool:
        return compile_glob(self.streams).match(name)


def compaction_due(stream_log: DiskLog, rule: RetentionRule) -> bool:
    """Whether the history since the last snapshot outgrew it: relative to the state's size, so a
    snapshot never makes the next one due by itself."""
    if rule.compact != "state" or not stream_log.meta.json_mode or stream_log.published_closed:
        return False
    end = stream_log.snapshot_end
    snapshot = end - stream_log.floor if end is not None else 0
    history = stream_log.published_tail - (end if end is not None else stream_log.floor)
    return history >= max(rule.compact_min_bytes, rule.compact_ratio * snapshot)


def rule_for(rules: list[RetentionRule], name: str) -> RetentionRule | None:
    return next((rule for rule in rules if rule.matches(name)), None)


def planned_floor(stream_log: DiskLog, rule: RetentionRule, now_ms: float, budget: int) -> int:
    """Where `rule` puts the floor of `stream_log` now: the end of the last sealed segment it
    drops, dropping a prefix only (at most `budget` segments).

    A stream the rule compacts keeps its floor where compaction put it: dropping by age or size
    would cut its state (a snapshot, or the history before the first one), and a reader from the
    floor must materialize what a reader from the beginning did."""
    if rule.compact == "state" and stream_log.meta.json_mode:
        return stream_log.floor
    segments = stream_log.segments
    tail = stream_log.published_tail
    floor = stream_log.floor
    for index in range(len(segments) - 1):  # sealed ones only: the last is being written
        if budget <= 0:
            break
        end = segments[index + 1].start
        if end <= floor:
            continue
        segment = segments[index]
        too_big = rule.max_bytes is not None and tail - end >= rule.max_bytes
        too_old = (
            rule.max_age is not None
            and segment.last_ms is not None
            and segment.last_ms < now_ms - rule.max_age * 1000
        )
        if not (too_big or too_old):
            break
        floor = end
        budget -= 1
    return floor


def fork_pins(storage: Storage, logs: list[DiskLog]) -> dict[str, int]:
    """For each stream some fork reads through, the lowest position a fork may still read there:
    nothing at or above it may be deleted. A fork reads its source from its own floor up to its
    fork point, and through a chain of forks, every ancestor's range below the fork points."""
    pins: dict[str, int] = {}
    for stream_log in logs:
        low = forks.readable_from(storage, stream_log)
        name = stream_log.meta.name
        for _, _, pinned in stream_log.meta.remote_forks:  # forks other cluster members own
            pins[name] = min(pins.get(name, pinned), pinned)
            low = min(low, pinned)  # and what they read of this stream's own sources
        current: StreamLog = stream_log
        while current.meta.forked_from is not None and low < current.meta.fork_base:
            source = storage.open(current.meta.forked_from)
            if source is None:
                break
            pins[source.meta.name] = min(pins.get(source.meta.name, low), low)
            current = source
    return pins


class Retention:
    def __init__(
        self,
        storage: Storage,
        rules: list[RetentionRule],
        *,
        interval: float = 30.0,
        max_segments_per_pass: int = 1000,
        notify: Callable[[str], None] | None = None,
        compact: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.storage = storage
        self.rules = rules
        self.interval = interval
        self.max_segments_per_pass = max_segments_per_pass
        self.notify = notify
        self.compact = compact  # starts a compaction in the background (compaction.Compactor)
        self.clock = clock
        self.health = Health()
        self.passes = 0
        self.floors_raised = 0
        self.segments_dropped = 0
        self.bytes_dropped = 0

    async def run(self) -> None:
        await self.storage.recovered()  # what a fork not read yet needs must not be dropped
        while True:
            await trio.sleep(self.interval)
            await self.pass_once()

    async def pass_once(self) -> None:
        """One pass over every stream; a failure on one stream is logged once and retried next pass."""
        storage = self.storage
        logs: list[DiskLog] = storage.logs()  # type: ignore[assignment]  # disk storage's
        pins = fork_pins(storage, logs)
        # Forks that exist on disk, per source. A source counting more is having one created
        # right now (attached, files not yet written): nothing of it is dropped this pass.
        visible = Counter(log.meta.forked_from for log in logs if log.meta.forked_from is not None)
        for stream_log in logs:
            visible[stream_log.meta.name] += len(stream_log.meta.remote_forks)  # pinned before created
        budget = self.max_segments_per_pass
        now_ms = self.clock() * 1000
        for stream_log in logs:
            if budget <= 0:
                break
            if stream_log.deleted:
                continue
            name = stream_log.meta.name
            try:
                rule = rule_for(self.rules, name) if self.rules else None
                if rule is not None and self.compact is not None and compaction_due(stream_log, rule):
                    self.compact(name)
                if rule is not None:
                    floor = planned_floor(stream_log, rule, now_ms, budget)
                    if floor > stream_log.floor and await stream_log.raise_floor(floor):
                        self.floors_raised += 1
                        if self.notify is not None:
                            self.notify(name)
                limit = min(stream_log.floor, pins.get(name, math.inf))
                if stream_log.held_from < limit and stream_log.meta.fork_count <= visible[name]:
                    before = len(stream_log.segments)
                    freed, keys = await stream_log.drop_held(int(limit))
                    dropped = before - len(stream_log.segments)
                    budget -= dropped
                    self.segments_dropped += dropped
                    self.bytes_dropped += freed
                    cold = getattr(storage, "cold", None)
                    if keys and cold is not None:
                        cold.forget(None, keys)
            except Exception as error:  # a full or failing disk: the next pass tries again
                self.health.failed("retention", f"{name}: {error}")
            else:
                self.health.ok("retention")
            await trio.lowlevel.checkpoint()
        self.passes += 1

    def stats(self) -> dict:
        return {
            "rules": len(self.rules),
            "passes": self.passes,
            "floors_raised": self.floors_raised,
            "segments_dropped": self.segments_dropped,
            "bytes_dropped": self.bytes_dropped,
            **self.health.stats(),
        }
