"""Judges a history against the model, as it is recorded or afterwards.

`Checker.observe(event)` takes events in the order the history holds them (time order). An
operation is judged once it has ended *and* every operation that could still change what it saw
has ended too: one that started before it ended and changes stream state or content (a "blocking"
operation: creates, appends, closes, deletes). Until then its end waits in a queue ordered by end
time, so judgments run in end-time order and each one knows every change that preceded it. Reads
never block others, so a long SSE read does not hold the queue.

Every judgment starts with the checks common to all operations (a status the spec names for the
operation; never a 500; a 503/507 only while a fault explains it), then the operation's own judge
from the registry (ops/torture/operations.py). `finish()` judges what is left and runs the
whole-history checks; the final full reads of every live stream are ordinary read events fed
before it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

from ops.torture import contract
from ops.torture.history import AMBIGUOUS, Event, Fault, OpEnded, OpStarted, Outcome
from ops.torture.membership import PROXY_STATUSES, UNAVAILABLE_CODES
from ops.torture.model import Finding, Model, RunConfig
from ops.torture.operations import REGISTRY, Operation


@dataclass
class Summary:
    ops: Counter[str] = field(default_factory=Counter)  # "kind verdict" -> count
    faults: Counter[str] = field(default_factory=Counter)
    checks: Counter[str] = field(default_factory=Counter)
    findings: list[Finding] = field(default_factory=list)
    occurrences: Counter[str] = field(default_factory=Counter)  # every violation, by kind

    def op_kinds(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for key, count in self.ops.items():
            out[key.split()[0]] += count
        return out


class Checker:
    def __init__(self, config: RunConfig | None = None) -> None:
        self.model = Model(config)
        self.started: dict[int, OpStarted] = {}
        self._blocking: dict[int, float] = {}  # in flight: id -> start time
        self._queue: list[tuple[float, int, Event]] = []
        self._order = itertools.count()
        self.ops: Counter[str] = Counter()
        self.last_time = 0.0

    @property
    def findings(self) -> list[Finding]:
        return self.model.findings

    def operation(self, started: OpStarted) -> Operation | None:
        return REGISTRY.get(started.op)

    # ---- intake ---------------------------------------------------------------------------

    def observe(self, event: Event) -> None:
        if isinstance(event, OpStarted):
            self.last_time = max(self.last_time, event.time)
            self.started[event.id] = event
            op = self.operation(event)
            if op is not None:
                if op.blocking:
                    self._blocking[event.id] = event.time
                op.on_start(self.model, event)
        elif isinstance(event, OpEnded):
            self.last_time = max(self.last_time, event.time)
            self._blocking.pop(event.id, None)
            started = self.started[event.id]
            self._touched(started, event)
            op = self.operation(started)
            if op is not None and op.mutator:
                # A change of state is recorded as soon as it ends, so the operations that
                # overlapped it (judged once it is over) can see it. Mutators of one name never
                # overlap (the drivers lock the name), so the one before it is recorded already.
                self.model.now = max(self.model.now, event.time)
                self._judge(started, event)
            else:
                heapq.heappush(self._queue, (event.time, next(self._order), event))
        else:
            self.last_time = max(self.last_time, event.time)
            # Its window is known at once: a mutator is judged as soon as it ends (above), before
            # the queue reaches a fault that began while it ran (the queue waits for the earliest
            # blocking operation in flight, which may be that mutator itself), and a 507 caused by
            # a disk filled mid-operation must find the fault. Windows are by time, so knowing of a
            # fault early changes no judgment of an operation that ended before it; the fault's
            # effects on the model's state still apply in time order, from the queue.
            assert isinstance(event, Fault)
            self.model.faults.add(event)
            if event.kind == "restart":
                self.model.restarted(event)  # again in time order, from the queue
            self.model.member_lost(event)  # likewise: a member's failover forgets reads' touches
            heapq.heappush(self._queue, (event.time, next(self._order), event))
        self._drain()

    def observe_all(self, events: list[Event]) -> None:
        for event in events:
            self.observe(event)

    def _drain(self, horizon: float | None = None) -> None:
        if horizon is None:
            horizon = min(self._blocking.values(), default=math.inf)
        while self._queue and self._queue[0][0] < horizon:
            _, _, event = heapq.heappop(self._queue)
            self.model.now = max(self.model.now, getattr(event, "time", 0.0))
            if isinstance(event, Fault):
                self.model.fault(event)
            else:
                assert isinstance(event, OpEnded)
                self._judge(self.started[event.id], event)

    def _touched(self, started: OpStarted, ended: OpEnded) -> None:
        """Any request about a stream may have restarted its sliding TTL (upper bound), known at
        once so expiry is never assumed too early."""
        if started.name is None or started.op == "head":
            return
        for state in self.model.name(started.name).current():
            if state.inc is not None:
                state.inc.touched_hi = max(state.inc.touched_hi, ended.time)

    # ---- judging --------------------------------------------------------------------------

    def _judge(self, started: OpStarted, ended: OpEnded) -> None:
        outcome = ended.outcome
        self.ops[f"{started.op} {outcome.verdict}"] += 1
        op = self.operation(started)
        status = outcome.status
        model = self.model
        if status is not None and (op is None or op.from_server):
            model.check(
                "no-500",
                status != 500,
                "500",
                f"{started.op} {started.name}: 500 {outcome.body[:200]}",
                [started.id],
            )
            if status in contract.FAULT_STATUSES:
                states = model.states(started.name, started.time, ended.time) if started.name else set()
                inc = next((s.inc for s in states if s.inc is not None and s.inc.cold_wiped_at), None)
                model.check(
                    "fault-status",
                    model.fault_explains(status, outcome.body, started, ended, inc),
                    "unexplained-503",
                    f"{started.op} {started.name}: {status} with no fault to explain it "
                    f"({contract.fault_reason(status, outcome.body)}): {outcome.body[:200]}",
                    [started.id],
                )
                if model.cluster is not None and contract.error_code(outcome.body) in UNAVAILABLE_CODES:
                    model.check(  # a client is told when to try again (HAProxy's, or a member's)
                        "retry-after",
                        "retry-after" in outcome.headers,
                        "no-retry-after",
                        f"{started.op} {started.name}: 503 without Retry-After: {outcome.body[:200]}",
                        [started.id],
                    )
            elif model.cluster is not None and status in PROXY_STATUSES:
                model.check(
                    "proxy-status",
                    model.fault_explains(status, outcome.body, started, ended, None),
                    "unexplained-proxy-error",
                    f"{started.op} {started.name}: {status} from the load balancer while the member "
                    f"owning it was up: {outcome.body[:200]}",
                    [started.id],
                )
            elif status != 500:
                model.check(
                    "named-status",
                    contract.named(op.status_kind if op else started.op, status),
                    "unnamed-status",
                    f"{started.op} {started.name}: {status} is not a status the spec names for it: "
                    f"{outcome.body[:200]}",
                    [started.id],
                )
        if op is not None:
            op.judge(model, started, ended)

    # ---- the end --------------------------------------------------------------------------

    def finish(self) -> list[Finding]:
        """Judges everything left (operations that never ended count as ambiguous) and runs the
        whole-history checks."""
        for event_id in list(self._blocking):
            started = self.started[event_id]
            ended = OpEnded(event_id, self.last_time, Outcome(None, error="never ended", verdict=AMBIGUOUS))
            self._blocking.pop(event_id)
            heapq.heappush(self._queue, (ended.time, next(self._order), ended))
            del started
        self._drain(math.inf)
        self.model.finish()
        return self.model.findings

    def summary(self) -> Summary:
        return Summary(
            ops=Counter(self.ops),
            faults=Counter(self.model.faults.counts),
            checks=Counter(self.model.checks),
            findings=list(self.model.findings),
            occurrences=Counter(self.model.occurrences),
        )


def check_history(events: list[Event], config: RunConfig | None = None) -> Summary:
    """Judges a whole recorded history (a dump re-checked offline, a hand-made test history)."""
    checker = Checker(config)
    checker.observe_all(events)
    checker.finish()
    return checker.summary()
