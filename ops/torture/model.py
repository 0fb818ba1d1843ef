"""The reference model of the protocol that every torture answer is judged against.

It does not simulate the server; it learns from the answers and keeps what they commit the server
to, with the uncertainty that real time and faults leave:

- Names and incarnations. Each stream name has a timeline of states (`State`: which incarnation,
  closed, soft-deleted, or absent). Operations that change a name's state (create, fork, close,
  delete: "mutators") are serialized per name by both tiers' drivers, so their order is known; an
  operation that overlaps a mutator may see the state before or after it, one that ended ambiguous
  leaves both possible until an answer tells which (`narrow`). TTL and expiry add "maybe expired".
  Offset tokens name their incarnation (`<incarnation>_<position>`), so every answer that carries
  one says exactly which incarnation served it.
- Content. Per incarnation, what readers were shown (`ByteMap` of stored bytes by position; a fork
  shows its source's bytes below its fork point, so those observations go to the source), what
  acknowledgements promised (`acks`: this append's bytes end at this position), and tails that must
  never go backwards (`TailLog`: every acknowledged append and every up-to-date answer raises the
  floor for operations that start later). Appends are self-identifying (ops/torture/payloads.py),
  so the observed content parses back into appends: each one sent, stored at most once, and
  exactly once if acknowledged; definite failures never; producers' seqs contiguous.
- Retention and compaction (issue 13). Each incarnation keeps the floors answers reported
  (`floors`: a 410 `offset_before_floor` and HEAD's `Stream-Earliest-Offset`, the start of an
  `offset=-1` read), which never go down. Bytes below a floor cannot be read any more: parsing in
  order jumps to the floor (producer seqs are then learnt afresh), and the end-of-run check
  excuses appends below the final floor. JSON appends are State Protocol changes
  (payloads.json_message), so compaction's snapshots are judged: read in order, a snapshot must
  hold exactly the state the changes before it fold to (key -> the id of the change that set it).
- Faults. Fault windows (disk full, S3 down, server down) decide whether a 503/507 or a refused
  connection is explained; the durability contract (ops/torture/contract.py) decides what a
  process fault may take back (nothing, in this server, short of a power cut).

Both tiers feed it through `ops.torture.checker.Checker`, which orders the events and calls the
operation's judge (ops/torture/operations.py). Each violation is a `Finding` with the ids of the
events that show it.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from ops.torture import contract, payloads
from ops.torture.history import AMBIGUOUS, FAILED, OK, Fault, OpEnded, OpStarted
from ops.torture.membership import GRACE as MEMBER_GRACE
from ops.torture.membership import Membership

ANY_INCARNATION = 0
PER_KIND = 5  # findings kept per kind (all are counted)


@dataclass
class Finding:
    kind: str
    message: str
    events: list[int]
    time: float

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message} (events {', '.join(map(str, self.events[:8]))})"


def parse_token(token: str | None) -> tuple[int, int] | None:
    """(incarnation, position) of a server token; None for anything else."""
    if not token or len(token) != 33 or token[16] != "_":
        return None
    head, tail = token[:16], token[17:]
    if not (head.isdigit() and tail.isdigit()):
        return None
    return int(head), int(tail)


def last_error(output: str) -> str:
    """The last exception line of a server's output, with the frame that raised it."""
    lines = [line.strip(" |+-") for line in output.splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        head = line.split(":")[0]
        if line and " " not in head and ("Error" in head or "Exception" in head) and "Group" not in head:
            frames = [x for x in lines[:i] if x.startswith("File ")]
            where = frames[-1] if frames else ""
            return f"{line[:300]} (at {where[:200]})"
    return output[-300:]


# ---- content ------------------------------------------------------------------------------------


class ByteMap:
    """Observed bytes by position: disjoint, sorted intervals, each remembering the event that
    first showed it (for reports)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.pieces: list[tuple[bytes, int]] = []  # (data, event id), parallel to starts

    def observe(self, position: int, data: bytes, event: int) -> tuple[int, int] | None:
        """Records `data` at `position`; returns (position, event) of the first byte that differs
        from earlier knowledge (nothing is recorded then), else None."""
        if not data:
            return None
        end = position + len(data)
        i = bisect.bisect_right(self.starts, position) - 1
        if i < 0 or self.starts[i] + len(self.pieces[i][0]) < position:
            i += 1
        j = i
        merged_start, merged = position, bytearray(data)
        first_event = event
        while j < len(self.starts) and self.starts[j] <= end:
            start, (old, old_event) = self.starts[j], self.pieces[j]
            lo, hi = max(start, position), min(start + len(old), end)
            if lo < hi and old[lo - start : hi - start] != data[lo - position : hi - position]:
                for k in range(lo, hi):
                    if old[k - start] != data[k - position]:
                        return k, old_event
            if start < merged_start:
                merged = bytearray(old[: merged_start - start]) + merged
                merged_start = start
                first_event = old_event
            if start + len(old) > merged_start + len(merged):
                merged += old[merged_start + len(merged) - start :]
            j += 1
        self.starts[i:j] = [merged_start]
        self.pieces[i:j] = [(bytes(merged), first_event)]
        return None

    def get(self, start: int, end: int) -> bytes | None:
        i = bisect.bisect_right(self.starts, start) - 1
        if i < 0:
            return None
        begin, (data, _) = self.starts[i], self.pieces[i]
        if begin + len(data) < end:
            return None
        return data[start - begin : end - begin]

    def known_end(self, origin: int) -> int:
        """End of the contiguous knowledge that starts at or before `origin` (origin if none)."""
        i = bisect.bisect_right(self.starts, origin) - 1
        if i < 0 or self.starts[i] + len(self.pieces[i][0]) < origin:
            return origin
        return self.starts[i] + len(self.pieces[i][0])

    def truncate(self, position: int) -> None:
        """Forgets everything at and after `position` (a power cut may rewrite it)."""
        keep_s, keep_p = [], []
        for start, (data, event) in zip(self.starts, self.pieces, strict=True):
            if start >= position:
                break
            keep_s.append(start)
            keep_p.append((data[: position - start], event))
        self.starts, self.pieces = keep_s, keep_p

    def size(self) -> int:
        return sum(len(d) for d, _ in self.pieces)


class TailLog:
    """Tails an incarnation has been seen to reach, by time: nothing durable may go back below
    them. `floor(t)` is the highest tail reached by an answer that ended before `t`."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.best: list[tuple[int, int]] = []  # running max (position, event)

    def add(self, time: float, position: int, event: int) -> None:
        # Mostly in time order (answers are judged in end-time order); a state change is judged
        # as soon as it ends, so it can come before answers that ended a little earlier.
        i = bisect.bisect_right(self.times, time)
        self.times.insert(i, time)
        self.best.insert(i, (position, event))
        best = self.best[i - 1] if i else (-1, 0)
        for j in range(i, len(self.best)):
            new = max(best, self.best[j])
            if j > i and new == self.best[j]:
                break  # the running maximum is unchanged from here on
            self.best[j] = best = new

    def floor(self, before: float) -> tuple[int, int]:
        i = bisect.bisect_left(self.times, before)
        return self.best[i - 1] if i else (0, 0)

    def cut_after(self, time: float) -> None:
        i = bisect.bisect_right(self.times, time)
        del self.times[i:], self.best[i:]


# ---- appends ------------------------------------------------------------------------------------


@dataclass(eq=False)
class SentAppend:
    """One logical append: every attempt (a producer retries the same one) and what came of them."""

    key: str  # its first record id
    name: str
    stored: bytes  # what it adds to the stored content
    record_ids: list[str]
    producer: tuple[str, int, int] | None
    first_start: float
    attempts: list[int] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)  # per ended attempt
    in_flight: int = 0
    acked: tuple[Incarnation, int, float, int] | None = None  # (inc, end position, time, event)
    duplicate_of: list[tuple[Incarnation, int]] = field(default_factory=list)  # 204 dup answers
    found: tuple[Incarnation, int] | None = None  # where the content shows it
    may_be_lost: bool = False  # its ack fell in a window the durability contract lets a fault undo

    @property
    def state(self) -> str:
        if self.acked is not None or self.duplicate_of or OK in self.verdicts:
            return OK
        if self.in_flight or any(v == AMBIGUOUS for v in self.verdicts):
            return AMBIGUOUS
        return FAILED if self.verdicts else AMBIGUOUS


# ---- names and incarnations -----------------------------------------------------------------------


@dataclass(eq=False)
class Incarnation:
    name: str
    number: int | None  # None until an answer shows it (a create that ended ambiguous)
    json: bool
    content_type: str
    created_by: int
    created_at: float
    source: Incarnation | None = None
    base: int = 0  # first position of its own data (a fork's fork point)
    ttl: int | None = None
    expires_at: float | None = None
    foreign: bool = False  # written by the server itself (wake streams): no records to parse
    # Its fork point is unknown (a fork whose create ended ambiguous): nothing can be placed in it.
    opaque: bool = False
    forks: list[Incarnation] = field(default_factory=list)
    seen: ByteMap = field(default_factory=ByteMap)
    acks: dict[int, SentAppend] = field(default_factory=dict)  # start position -> append
    tails: TailLog = field(default_factory=TailLog)
    final_tail: tuple[int, int] | None = None  # (position, event) of its close
    last_tail: int = 0  # highest tail any answer reported
    final_read: tuple[int, int] | None = None  # (tail, event) of the run's final full read
    parsed_upto: int = -1  # own content parsed into records up to here
    islands: dict[int, int] = field(default_factory=dict)  # content parsed apart: start -> end
    found: dict[str, int] = field(default_factory=dict)  # record id -> position
    producer_last: dict[tuple[str, int], int] = field(default_factory=dict)  # (id, epoch) -> seq
    # TTL: bounds on the server's last access (the sliding window restarts there).
    touched_lo: float = 0.0  # surely touched at or after (an answered write or read)
    touched_lo_write: float = 0.0  # the same, counting only what a restart keeps (appends)
    touched_hi: float = 0.0  # maybe touched until
    cold_wiped_at: float | None = None  # the bucket was wiped while this incarnation lived
    floors: TailLog = field(default_factory=TailLog)  # floors reported (never go down)
    final_floor: int = 0  # where the end-of-run read from -1 began
    # Parsing in order jumped over bytes retained away: the next seq of a producer is learnt.
    resynced: bool = False
    # A JSON stream's state as its changes read in order fold it (key -> id of the change that set
    # it); None while unknown (a fork's source part, after a jump to a floor).
    fold: dict[str, str] | None = None
    snapshot: dict[str, str] | None = None  # a snapshot being read in order: key -> id
    snapshot_fold: dict[str, str] | None = None  # the fold where that snapshot began
    snapshot_offset: str | None = None  # the offset its snapshot-start named
    replaced: bool = False  # its data directory was replaced by an empty one (a bricked server)

    def label(self) -> str:
        number = f"{self.number:016d}" if self.number is not None else f"?{self.created_by}"
        return f"{self.name}#{number}"

    def chain(self) -> Iterable[Incarnation]:
        inc: Incarnation | None = self
        while inc is not None:
            yield inc
            inc = inc.source

    def maybe_expired_by(self, time: float, slack: float = 0.5) -> bool:
        if self.expires_at is not None and time >= self.expires_at - slack:
            return True
        return self.ttl is not None and time >= self.touched_lo + self.ttl - slack

    def surely_expired_at(self, time: float, slack: float = 1.5) -> bool:
        if self.expires_at is not None and time >= self.expires_at + slack:
            return True
        return self.ttl is not None and time >= self.touched_hi + self.ttl + slack


class State(NamedTuple):
    inc: Incarnation | None  # None: no stream here (404)
    closed: bool = False
    soft: bool = False  # deleted while forks read it (410)


ABSENT = State(None)


@dataclass
class Change:
    start: float
    end: float
    after: frozenset[State]
    event: int


@dataclass
class Name:
    name: str
    changes: list[Change] = field(default_factory=list)
    initial: frozenset[State] = frozenset({ABSENT})

    def current(self) -> frozenset[State]:
        return self.changes[-1].after if self.changes else self.initial

    def add(self, change: Change) -> None:
        i = self._first_ending_at_or_after(change.end + 1e-9)
        self.changes.insert(i, change)

    def _first_ending_at_or_after(self, time: float) -> int:
        # Changes are recorded in end-time order (the checker judges in that order).
        lo, hi = 0, len(self.changes)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.changes[mid].end < time:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def during(self, start: float, end: float) -> set[State]:
        """States the name may have had at some instant of [start, end]."""
        i = self._first_ending_at_or_after(start)
        current = self.changes[i - 1].after if i else self.initial
        out: set[State] = set(current)
        for change in self.changes[i:]:
            if change.start > end:
                continue  # after the window (a later change may still have started inside it)
            out |= change.after
        return out

    def at_start(self, start: float) -> frozenset[State]:
        """States in effect when an operation starting at `start` began (changes ended before)."""
        i = self._first_ending_at_or_after(start)
        return self.changes[i - 1].after if i else self.initial


# ---- faults --------------------------------------------------------------------------------------


class FaultLog:
    """Fault windows by class (contract.WINDOWS) and point faults, from the fault events."""

    def __init__(self) -> None:
        self.windows: dict[str, list[list[float]]] = {k: [] for k in contract.WINDOWS}
        self.points: dict[str, list[float]] = {}
        self.counts: Counter[str] = Counter()
        # A cluster run's process faults name their member: each member's own "down" windows.
        self.by_member: dict[str, list[list[float]]] = {}

    def add(self, fault: Fault) -> None:
        self.counts[fault.kind] += 1
        for cls, (begins, ends) in contract.WINDOWS.items():
            spans = self.windows[cls]
            if fault.kind in begins:
                if not spans or spans[-1][1] != math.inf:
                    spans.append([fault.time, math.inf])
            elif fault.kind in ends and spans and spans[-1][1] == math.inf:
                spans[-1][1] = fault.time
        member = fault.detail.get("member")
        begins, ends = contract.WINDOWS["down"]
        if member is not None and (fault.kind in begins or fault.kind in ends):
            spans = self.by_member.setdefault(member, [])
            if fault.kind in begins and (not spans or spans[-1][1] != math.inf):
                spans.append([fault.time, math.inf])
            elif fault.kind in ends and spans and spans[-1][1] == math.inf:
                spans[-1][1] = fault.time
        self.points.setdefault(fault.kind, []).append(fault.time)

    def active(self, cls: str, start: float, end: float, grace: float = 0.0) -> bool:
        return any(lo <= end and start <= hi + grace for lo, hi in self.windows[cls])

    def member_down(self, member: str, start: float, end: float, grace: float = 0.0) -> bool:
        return any(lo <= end and start <= hi + grace for lo, hi in self.by_member.get(member, ()))

    def happened(self, kind: str, after: float, before: float) -> bool:
        return any(after <= t <= before for t in self.points.get(kind, ()))


# ---- the model -----------------------------------------------------------------------------------


@dataclass
class RunConfig:
    """What the durability contract and the fault rules need to know about the run."""

    fsync: str = "always"
    fsync_interval: float = 1.0
    cold: bool = True
    retention: bool = False  # retention rules and compaction run (ops/torture/retention.py)
    members: tuple[str, ...] = ()  # a cluster run's member ids (ops/torture/cluster.py); () one server


class Model:
    def __init__(self, config: RunConfig | None = None) -> None:
        self.config = config or RunConfig()
        self.names: dict[str, Name] = {}
        self.incs: dict[int, Incarnation] = {}
        self.all_incs: list[Incarnation] = []
        self.appends: dict[str, SentAppend] = {}  # by every record id
        self.faults = FaultLog()
        self.findings: list[Finding] = []
        self.checks: Counter[str] = Counter()
        self.restarts: list[float] = []
        self.replaced_at = -math.inf  # when the data directory was last replaced (a bricked server)
        self.now = 0.0
        # State that operations keep for themselves (subscriptions, ...), by operation family.
        self.extra: dict[str, object] = {}
        self._finding_keys: set[tuple[str, str]] = set()
        self.occurrences: Counter[str] = Counter()
        self.recent_down = 0  # failed health probes not yet explained by a fault
        # Deletes started and not yet judged, by event: (name, start). A mutator is judged when it
        # ends, so one on another name still running may already have happened (sim seed 3098: a
        # fork's delete reaped its soft-deleted source before the source's own delete, which
        # ended first, answered 404).
        self.deletes_in_flight: dict[int, tuple[str, float]] = {}
        # Changes answered 503 not_durable since the last power cut, with the states before them:
        # done, but a power cut may still take them back, whatever answers narrowed since (sim
        # seed 5161: a delete so answered, a 404 read after it, then a power cut brought the
        # stream back).
        self.undurable: list[tuple[str, frozenset[State], int]] = []
        # Whole-run checks operation families add (the registry's), run by `finish` last.
        self.finishers: dict[str, Callable[[Model], None]] = {}
        self.cluster = Membership(self.config.members) if self.config.members else None

    # ---- findings ------------------------------------------------------------------------

    def finding(self, kind: str, message: str, events: Iterable[int]) -> None:
        """Records a violation. One bug tends to show many times: each (kind, subject) is kept
        once (the subject is what the message is about: the text before its first colon), and at
        most `PER_KIND` of a kind; `occurrences` counts them all."""
        self.occurrences[kind] += 1
        key = (kind, message.split(":")[0])
        if key in self._finding_keys or sum(1 for f in self.findings if f.kind == kind) >= PER_KIND:
            return
        self._finding_keys.add(key)
        self.findings.append(Finding(kind, message, sorted(set(events)), self.now))

    def check(self, what: str, ok: bool, kind: str, message: str, events: Iterable[int]) -> bool:
        self.checks[what] += 1
        if not ok:
            self.finding(kind, message, events)
        return ok

    # ---- names ---------------------------------------------------------------------------

    def name(self, name: str) -> Name:
        found = self.names.get(name)
        if found is None:
            found = self.names[name] = Name(name)
        return found

    def states(self, name: str, start: float, end: float) -> set[State]:
        """States possible during [start, end], with expiry and reaping taken into account."""
        out: set[State] = set()
        for state in self.name(name).during(start, end):
            inc = state.inc
            if inc is None:
                out.add(state)
                continue
            # An expired stream is deleted like any other: soft-deleted while forks read it.
            kept = inc.forks or self.maybe_leaky(inc, end)  # a pin of a fork that is gone counts too
            expired = [ABSENT, state._replace(soft=True)] if kept else [ABSENT]
            if inc.surely_expired_at(start):
                out.update(expired)
                continue
            out.add(state)
            if inc.maybe_expired_by(end):
                out.update(expired)
            if state.soft and all(self.maybe_gone(f, end) for f in inc.forks):
                out.add(ABSENT)  # the last fork may have gone: the source may be reaped (later)
        return out

    def maybe_vacant(self, state: State, time: float) -> bool:
        """Whether the path may hold no stream by `time` although the timeline says `state`: no
        stream, one that may have expired, or a soft-deleted one whose forks may all be gone (the
        server reaps it then). `states` adds those as ABSENT when judging an answer, but the
        timeline never holds them, so a create or fork whose answer was lost must ask here: a
        create that may have landed on a reaped path would otherwise be forgotten, and the stream
        it made judged an unknown incarnation (seeds 102 and 249: a 503 not_durable create on the
        path of a soft-deleted stream whose last fork had gone)."""
        inc = state.inc
        if inc is None:
            return True
        if inc.maybe_expired_by(time):
            return True
        return state.soft and all(self.maybe_gone(f, time) for f in inc.forks)

    def maybe_live(self, inc: Incarnation, time: float) -> bool:
        return any(s.inc is inc for s in self.states(inc.name, time, time))

    def maybe_gone(self, inc: Incarnation, time: float) -> bool:
        """The incarnation may no longer hold its source's data (deleted, reaped or expired)."""
        if any(name == inc.name and start <= time for name, start in self.deletes_in_flight.values()):
            return True
        return any(s.inc is not inc for s in self.states(inc.name, time, time))

    def maybe_leaky(self, inc: Incarnation, time: float) -> bool:
        """A cluster run: `inc` may hold the pin of a cross-member fork that is gone (membership.py)."""
        if self.cluster is None:
            return False
        return self.cluster.maybe_leaky(inc.name, inc.created_at, time, self.any_member_down)

    def any_member_down(self, start: float, end: float) -> bool:
        return any(self.faults.member_down(m, start, end) for m in self.faults.by_member)

    def surely_live(self, inc: Incarnation, time: float) -> bool:
        states = self.states(inc.name, time, time)
        return bool(states) and all(s.inc is inc for s in states)

    def change(
        self,
        name: str,
        started: OpStarted,
        ended: OpEnded,
        effect: Callable[[State], Iterable[State]],
        verdict: str | None = None,
    ) -> None:
        """Records a mutator: its effect if it surely happened, both if it may have."""
        record = self.name(name)
        before = record.at_start(started.time)
        verdict = verdict or ended.outcome.verdict
        if verdict == FAILED:
            return
        after: set[State] = set()
        for state in before:
            after.update(effect(state))
        if verdict != OK:
            after |= before
        if ended.outcome.status == 503 and contract.error_code(ended.outcome.body) == contract.NOT_DURABLE:
            self.undurable.append((name, frozenset(before), started.id))
        record.add(Change(started.time, ended.time, frozenset(after), started.id))

    def narrow(self, name: str, start: float, end: float, keep: Callable[[State], bool]) -> None:
        """An answer consistent with only some of the states the name may be in, from an operation
        no change overlapped: keep those."""
        record = self.name(name)
        if record.changes and record.changes[-1].end >= start:
            return  # a change overlapped the operation: it says nothing about one state
        current = record.current()
        kept = frozenset(s for s in current if keep(s))
        if kept and kept != current:
            if record.changes:
                record.changes[-1].after = kept
            else:
                record.initial = kept

    # ---- incarnations --------------------------------------------------------------------

    def new_inc(self, name: str, number: int | None, started: OpStarted, **fields: object) -> Incarnation:
        inc = Incarnation(name=name, number=number, created_by=started.id, created_at=started.time, **fields)  # type: ignore[arg-type]
        inc.touched_lo = inc.touched_lo_write = inc.touched_hi = started.time
        if inc.json and inc.source is None:
            inc.fold = {}  # a fork's state begins with its source's, which this fork never parses
        if number is not None:
            self.incs[number] = inc
        self.all_incs.append(inc)
        return inc

    def inc_of_token(
        self, name: str, token: str | None, candidates: Iterable[State], event: int
    ) -> Incarnation | None:
        """The incarnation an answer's token names. An unknown number binds to an incarnation
        created ambiguously (its create's answer was lost); failing that it is a finding."""
        parsed = parse_token(token)
        if parsed is None:
            self.finding(
                "bad-offset", f"{name}: answer carried offset {token!r}, not a server token", [event]
            )
            return None
        number = parsed[0]
        inc = self.incs.get(number)
        if inc is not None:
            if inc.name != name:
                self.finding(
                    "wrong-incarnation",
                    f"{name}: answer carried a token of {inc.label()}, another stream",
                    [event, inc.created_by],
                )
                return None
            return inc
        unbound = [s.inc for s in candidates if s.inc is not None and s.inc.number is None]
        if unbound:
            inc = unbound[-1]
            inc.number = number
            self.incs[number] = inc
            return inc
        self.finding(
            "unknown-incarnation",
            f"{name}: answer carried incarnation {number:016d}, which no create of this run made",
            [event],
        )
        return None

    # ---- content -------------------------------------------------------------------------

    def observe(self, inc: Incarnation, position: int, data: bytes, event: int) -> None:
        """Bytes a reader was shown at `position` of `inc` (a fork's lower positions are its
        source's)."""
        if any(i.opaque for i in inc.chain()):
            self.checks["unplaceable-reads"] += 1
            return
        while data:
            owner = inc
            while owner.source is not None and position < owner.base:
                owner = owner.source
            # Within owner's own range, up to where the next fork up the chain takes over.
            limit = position + len(data)
            for child in self._children_on_path(inc, owner):
                limit = min(limit, child.base)
            piece, data = data[: limit - position], data[limit - position :]
            self.checks["bytes-compared"] += len(piece)
            conflict = owner.seen.observe(position, piece, event)
            if conflict is not None:
                at, other = conflict
                self.finding(
                    "content-changed",
                    f"{owner.label()}: position {at} showed different bytes to two readers",
                    [event, other],
                )
                return
            self._check_acks(owner, position, position + len(piece), event)
            self._parse(owner)
            position += len(piece)

    @staticmethod
    def _children_on_path(inc: Incarnation, owner: Incarnation) -> list[Incarnation]:
        """The forks between `inc` and its ancestor `owner`: where owner's range ends for `inc`."""
        path: list[Incarnation] = []
        node: Incarnation | None = inc
        while node is not None and node is not owner:
            path.append(node)
            node = node.source
        return path

    def _check_acks(self, inc: Incarnation, start: int, end: int, event: int) -> None:
        for position, append in list(inc.acks.items()):
            stop = position + len(append.stored)
            if stop <= start or position >= end or append.may_be_lost:
                continue
            shown = inc.seen.get(position, stop)
            if shown is None:
                continue
            ack_event = append.acked[3] if append.acked else 0
            self.check(
                "ack-at-position",
                shown == append.stored,
                "ack-not-at-position",
                f"{inc.label()}: append {append.key} was acknowledged at [{position}, {stop}) but "
                f"readers see other bytes there",
                [event, ack_event],
            )

    def ack(self, append: SentAppend, inc: Incarnation, end: int, ended: OpEnded, started: OpStarted) -> None:
        """An attempt of `append` answered success with the stream's tail `end` after it."""
        start = end - len(append.stored)
        if inc.opaque:
            append.acked = (inc, end, ended.time, ended.id)
            return
        if append.acked is not None and not append.may_be_lost:
            first_inc, first_end, _, first_event = append.acked
            self.finding(
                "acked-twice",
                f"{inc.label()}: append {append.key} was acknowledged as new data twice "
                f"(at {first_inc.label()}:{first_end} and {end})",
                [first_event, ended.id],
            )
            return
        append.acked = (inc, end, ended.time, ended.id)
        append.may_be_lost = False
        self.checks["acks"] += 1
        if start < inc.base:
            self.finding(
                "ack-offset",
                f"{inc.label()}: append {append.key} of {len(append.stored)} bytes acknowledged with "
                f"next offset {end}, below the stream's own start {inc.base}",
                [ended.id],
            )
            return
        other = inc.acks.get(start)
        overlapping = [
            a
            for p, a in inc.acks.items()
            if p < end and start < p + len(a.stored) and a is not append and not a.may_be_lost
        ]
        if overlapping:
            self.finding(
                "acks-overlap",
                f"{inc.label()}: appends {append.key} and {overlapping[0].key} were acknowledged at "
                "overlapping positions",
                [ended.id, overlapping[0].acked[3] if overlapping[0].acked else 0],
            )
        elif other is None:
            inc.acks[start] = append
        self._check_acks(inc, start, end, ended.id)
        self.tail_floor(inc, end, started, ended, "ack")

    def tail_floor(
        self,
        inc: Incarnation,
        tail: int,
        started: OpStarted,
        ended: OpEnded,
        what: str,
        since: float | None = None,
        kind: str = "tail-went-back",
    ) -> None:
        """An answer that reports `tail` as the stream's tail (an ack, an up-to-date read, a HEAD):
        it may not be below a tail reached by an answer that ended before this operation began,
        nor past the end of a closed stream."""
        before = started.time if since is None else since
        floor, floor_event = inc.tails.floor(before)
        self.check(
            "tail-floor",
            tail >= floor,
            kind,
            f"{inc.label()}: {what} reported {tail} as the tail, but an answer that ended before it "
            f"began had reached {floor}: acknowledged or shown data is gone, or the answer is stale",
            [started.id, floor_event],
        )
        if inc.final_tail is not None:
            final, close_event = inc.final_tail
            self.check(
                "final-tail",
                tail <= final,
                "append-after-close",
                f"{inc.label()}: {what} reported tail {tail}, past the closed stream's final offset {final}",
                [started.id, close_event],
            )
        inc.tails.add(ended.time, tail, ended.id)
        inc.last_tail = max(inc.last_tail, tail)

    def floor_seen(self, inc: Incarnation, floor: int, started: OpStarted, ended: OpEnded, what: str) -> None:
        """An answer that reports `floor` as the earliest position readers may ask for: it may not
        be below a floor reported by an answer that ended before this one began (the floor never
        goes down, across restarts too), nor past a tail that was already reported."""
        before, before_event = inc.floors.floor(started.time)
        self.check(
            "floor-monotonic",
            floor >= before,
            "floor-went-back",
            f"{inc.label()}: {what} reported the floor at {floor}, but an answer that ended before it "
            f"began had reported {before}",
            [started.id, before_event],
        )
        self.check(
            "floor-below-tail",
            floor <= max(inc.last_tail, inc.seen.known_end(floor)),
            "floor-past-tail",
            f"{inc.label()}: {what} reported the floor at {floor}, past every tail reported ({inc.last_tail})",
            [started.id],
        )
        inc.floors.add(ended.time, floor, ended.id)

    def latest_floor(self, inc: Incarnation) -> int:
        return inc.floors.floor(math.inf)[0]

    def close_at(self, inc: Incarnation, tail: int, event: int) -> None:
        if inc.final_tail is not None and inc.final_tail[0] != tail:
            self.finding(
                "final-tail-moved",
                f"{inc.label()}: closed at {inc.final_tail[0]}, later reported closed at {tail}",
                [inc.final_tail[1], event],
            )
            return
        inc.final_tail = (tail, event)

    # ---- parsing the content into appends ------------------------------------------------

    def _parse(self, inc: Incarnation) -> None:
        """Parses newly known content into appends: the prefix from the stream's start in order
        (producer seqs are judged along it), and islands a reader saw further on from a position
        known to start an append (an acknowledged append's start or end)."""
        if inc.foreign:
            return
        origin = inc.base if inc.parsed_upto < 0 else inc.parsed_upto
        end = inc.seen.known_end(origin)
        floor = self.latest_floor(inc)
        if end == origin and floor > origin:
            # What lies below the floor can never be read again: parse in order from there.
            origin = end = floor
            inc.parsed_upto = floor
            inc.resynced = True
            inc.producer_last.clear()
            inc.fold = inc.snapshot = inc.snapshot_fold = None
            end = inc.seen.known_end(origin)
        parse = payloads.parse_json_units if inc.json else payloads.parse_text
        if end > origin:
            data = inc.seen.get(origin, end)
            if data is not None:
                units, _partial = parse(data, origin)
                for unit in units:
                    at = unit.position - origin
                    self._in_order(inc, unit, data[at : at + unit.length])
                inc.parsed_upto = units[-1].position + units[-1].length if units else origin
        prefix_end = max(inc.parsed_upto, inc.base)
        # Islands start where an append is known to start: an acknowledged append's start or end,
        # or a floor (retention drops whole segments, which hold whole records).
        boundaries = sorted(
            {p for p, a in inc.acks.items()}
            | {p + len(a.stored) for p, a in inc.acks.items()}
            | {f for f, _ in inc.floors.best}
        )
        for start, (data, _) in zip(inc.seen.starts, inc.seen.pieces, strict=True):
            stop = start + len(data)
            if stop <= prefix_end:
                continue
            first = next((b for b in boundaries if max(start, prefix_end) <= b < stop), None)
            if first is None or inc.islands.get(first, -1) >= stop:
                continue
            units, _partial = parse(data[first - start :], first)
            in_snapshot = False
            for unit in units:
                at = unit.position - start
                control = payloads.snapshot_control(unit.value) if inc.json else None
                if control is not None:
                    in_snapshot = control[0] == "snapshot-start"
                    continue
                if in_snapshot and unit.record_id is None:
                    self._snapshot_entry(inc, unit)
                    continue
                self._found(inc, unit, data[at : at + unit.length], in_order=False)
            inc.islands[first] = stop

    def _in_order(self, inc: Incarnation, unit: payloads.Unit, data: bytes) -> None:
        """One unit of the content read in order from the start (or a floor): snapshots are
        judged against the fold of the changes before them, changes fold."""
        control = payloads.snapshot_control(unit.value) if inc.json else None
        if control is not None:
            self._snapshot_boundary(inc, unit, control)
            return
        if inc.snapshot is not None and unit.record_id is None:
            entry = self._snapshot_entry(inc, unit)
            if entry is not None:
                inc.snapshot[entry[0]] = entry[1]
            return
        self._found(inc, unit, data, in_order=True)
        change = payloads.state_change(unit.value) if inc.json and unit.record_id else None
        if change is not None and inc.fold is not None:
            key, holder = change
            if holder is None:
                inc.fold.pop(key, None)
            else:
                inc.fold[key] = holder

    def _snapshot_boundary(self, inc: Incarnation, unit: payloads.Unit, control: tuple[str, str]) -> None:
        kind, offset = control
        token = parse_token(offset)
        if kind == "snapshot-start":
            self.check(
                "snapshot-offset",
                token is not None and token[1] == unit.position,
                "snapshot-offset",
                f"{inc.label()}: the snapshot-start at {unit.position} names offset {offset!r}",
                [inc.created_by],
            )
            inc.snapshot_offset = offset
            inc.snapshot = {}
            inc.snapshot_fold = None if inc.fold is None else dict(inc.fold)
            return
        if inc.snapshot is None:
            # Read from a floor inside the snapshot: what follows folds from an unknown state.
            inc.fold = None
            return
        self.check(
            "snapshot-offset",
            offset == inc.snapshot_offset,
            "snapshot-offset",
            f"{inc.label()}: the snapshot-end at {unit.position} names {offset!r}, its start {inc.snapshot_offset!r}",
            [inc.created_by],
        )
        if inc.snapshot_fold is not None:
            self.check(
                "snapshot-state",
                inc.snapshot == inc.snapshot_fold,
                "snapshot-wrong",
                f"{inc.label()}: the snapshot ending at {unit.position} holds {_state_diff(inc.snapshot, inc.snapshot_fold)}"
                " against the state of the changes before it",
                [inc.created_by],
            )
        inc.fold = inc.snapshot  # from here the stream folds from the snapshot, as readers do
        inc.snapshot = inc.snapshot_fold = None

    def _snapshot_entry(self, inc: Incarnation, unit: payloads.Unit) -> tuple[str, str] | None:
        """A snapshot's `insert`: (key, id) if it names a change sent to this stream for that key."""
        self.checks["snapshot-entries"] += 1
        change = payloads.state_change(unit.value)
        value = unit.value if isinstance(unit.value, dict) else {}
        operation = (
            value.get("headers", {}).get("operation") if isinstance(value.get("headers"), dict) else None
        )
        append = self.appends.get(change[1]) if change is not None and change[1] else None
        key = _change_key(append, change[1] or "") if append is not None and change is not None else None
        # A fork's state begins with its source's: the changes of its chain count.
        names = {i.name for i in inc.chain()}
        if (
            change is None
            or operation != "insert"
            or append is None
            or append.name not in names
            or key != change[0]
        ):
            self.finding(
                "snapshot-wrong",
                f"{inc.label()}: position {unit.position} of a snapshot holds {unit.value!r:.120}, "
                "not an insert of a change sent to this stream (or its fork source) for that key",
                [inc.created_by],
            )
            return None
        return change[0], change[1] or ""

    def _found(self, inc: Incarnation, unit: payloads.Unit, data: bytes, in_order: bool) -> None:
        self.checks["records-parsed"] += 1
        record_id = unit.record_id
        append = self.appends.get(record_id) if record_id else None
        if append is None or not record_id:
            self.finding(
                "foreign-bytes",
                f"{inc.label()}: position {unit.position} holds {data[:60]!r}, which no client sent",
                [inc.created_by],
            )
            return
        first = append.record_ids.index(record_id) == 0
        events = [append.attempts[0]] if append.attempts else []
        if append.name != inc.name:
            self.finding(
                "misplaced-append",
                f"{inc.label()}: holds append {append.key}, which was sent to {append.name!r}",
                events,
            )
            return
        previous = inc.found.get(record_id)
        if previous is not None and previous != unit.position:
            self.finding(
                "duplicate",
                f"{inc.label()}: append {append.key} is stored twice (positions {previous} and {unit.position})",
                events,
            )
            return
        inc.found[record_id] = unit.position
        if not first:
            return
        if append.found is not None and append.found[0] is not inc:
            self.finding(
                "duplicate",
                f"append {append.key} is stored in two incarnations ({append.found[0].label()} and {inc.label()})",
                events,
            )
            return
        append.found = (inc, unit.position)
        stored = inc.seen.get(unit.position, unit.position + len(append.stored))
        if stored is not None:
            self.check(
                "record-intact",
                stored == append.stored,
                "record-mangled",
                f"{inc.label()}: append {append.key} at {unit.position} is not the bytes that were sent",
                events,
            )
        if append.state == FAILED:
            self.finding(
                "failed-append-present",
                f"{inc.label()}: append {append.key} is stored at {unit.position}, but every attempt "
                f"definitely failed ({', '.join(append.verdicts)})",
                events,
            )
        if append.acked is not None and not append.may_be_lost:
            acked_inc, acked_end, _, ack_event = append.acked
            self.check(
                "ack-matches-content",
                acked_inc is inc and acked_end == unit.position + len(append.stored),
                "ack-not-at-position",
                f"append {append.key} was acknowledged at {acked_inc.label()}:{acked_end} but is stored "
                f"at {inc.label()}:{unit.position + len(append.stored)}",
                [ack_event, *events],
            )
        if append.producer is not None and in_order:
            producer_id, epoch, seq = append.producer
            last = inc.producer_last.get((producer_id, epoch))
            expected = (seq if inc.resynced else 0) if last is None else last + 1
            self.check(
                "producer-contiguous",
                seq == expected,
                "producer-gap",
                f"{inc.label()}: producer {producer_id} epoch {epoch} stored seq {seq} after "
                f"{'nothing' if last is None else last} (exactly-once means 0, 1, 2, ... in order)",
                events,
            )
            inc.producer_last[(producer_id, epoch)] = seq

    # ---- faults --------------------------------------------------------------------------

    def fault(self, fault: Fault) -> None:
        """A fault's effects on the model, in time order. Its window is already in `faults`: the
        checker adds it when the event arrives (ops/torture/checker.py, `observe`)."""
        if fault.kind == "start_failed":
            self.finding(
                "server-does-not-start",
                f"the server does not start again: {last_error(str(fault.detail.get('output', '')))}",
                [fault.id],
            )
        if fault.kind == "reconcile_failed":  # a cluster run (ops/torture/cluster.py)
            self.finding(
                "reconcile-failed",
                f"member {fault.detail.get('member')}: its fork pin reconcile did not succeed with every "
                f"other member up: {str(fault.detail.get('stats'))[:400]}",
                [fault.id],
            )
        if fault.kind == "crash":
            # A probe that found no server just before is this same exit, noticed first.
            self.occurrences["server-down"] -= self.recent_down
            self.findings = [
                f for f in self.findings if not (f.kind == "server-down" and f.time >= fault.time - 2.0)
            ]
            self.finding(
                "server-exit",
                f"the server exited on its own: {last_error(str(fault.detail.get('output', '')))}",
                [fault.id],
            )
        if fault.kind == "power_cut":
            for name, before, event in self.undurable:
                record = self.name(name)
                record.add(Change(fault.time, fault.time, record.current() | before, event))
            self.undurable.clear()
        if fault.kind == "restart":
            self.restarts.append(fault.time)
            self.restarted(fault)
        self.member_lost(fault)  # again in time order (the checker applies it when it hears of it)
        if fault.kind == "s3_wipe":
            for inc in self.all_incs:
                if inc.cold_wiped_at is None:
                    inc.cold_wiped_at = fault.time
        if fault.kind == "disk_replaced":
            self._disk_replaced(fault)
        if fault.kind in contract.PROCESS_FAULTS:
            window = contract.loss_window(self.config.fsync, fault.kind, self.config.fsync_interval)
            if window > 0:
                self._rewind(fault.time, window, fault.id)

    def restarted(self, fault: Fault) -> None:
        """A restart forgets reads' touches (they live in memory only) and recovery may count a TTL
        from now. Applied in time order (`fault`), and also as soon as the checker hears of it: a
        mutator that ends after it is judged at once, maybe before the queue reaches the restart
        (a cluster run, seed 207: HAProxy held a fork sent while its member was down and delivered
        it after the restart, which found its TTL source expired by its last write). Both only
        widen what is possible; a cluster restart concerns its member's streams only."""
        member = fault.detail.get("member")
        for inc in self.all_incs:
            if member is not None and self.cluster is not None and self.cluster.owner(inc.name) != member:
                continue
            inc.touched_lo = inc.touched_lo_write
            inc.touched_hi = max(inc.touched_hi, fault.time)

    def member_lost(self, fault: Fault) -> None:
        """A server's down window opens (one server, or a cluster member: a replica or process of
        it killed, paused, cut off): whatever serves its streams next recovered them from disk,
        and reads' touches of a sliding TTL live only in the memory of the process that served
        them. In a replicated run that next one may be the promoted follower, which answers long
        before the window closes (the "restart" comes once a replica has served for 3 s without a
        break, `ReplicatedRun.await_members`), so forgetting reads' touches at the restart
        (`restarted`) was too late. Seed 200 (30 minutes): ttl/0, created closed with a TTL of 7 s
        at 879.95, read at 881.61 on m0b; m0b cut off at 883.38, m0a promoted and answered a read
        at 887.97 404 (expired by its creation, the last access its copy knew), which the model,
        still counting the read's touch, took for a live stream; likewise ttl/1 at 978.27 and
        1550.46 and ttl/0 at 1023.66. So reads' touches are forgotten when the window opens, and a
        read that overlaps a window of its member never counts (`read_touch_lasts`). Only widens.

        One server alike (black-box seed 12, CI): the rig records the restart only once
        `/readyz` stops saying recovering, and the sim once every stream is read, but the new
        process answers before that. fork/1 (Stream-TTL 9, no record of its own) was read at
        7.07, the server killed at 10.41; the new process answered an append at 12.13 with 404
        (expired 9 s after its create, the last access on disk), 90 ms before the rig recorded
        the restart, and the model, still counting the read's touch, took it for a live stream."""
        if fault.kind not in contract.WINDOWS["down"][0]:
            return
        member = fault.detail.get("member")
        if self.cluster is None:
            for inc in self.all_incs:
                inc.touched_lo = inc.touched_lo_write
            return
        if member is None:
            return
        for inc in self.all_incs:
            if self.cluster.owner(inc.name) == member:
                inc.touched_lo = inc.touched_lo_write

    def read_touch_lasts(self, inc: Incarnation, start: float) -> bool:
        """Whether the touch of a read that started at `start` survives whatever comes: not where
        the server (in a cluster run, the stream's member) has a down window that had not closed
        before it (`member_lost`). A write's touch does: an acknowledged record carries its time
        to every copy, and recovery counts the TTL from the last record."""
        if self.cluster is None:
            return not self.faults.active("down", start, math.inf)
        return not self.faults.member_down(self.cluster.owner(inc.name), start, math.inf)

    def _disk_replaced(self, fault: Fault) -> None:
        """The operator gave a bricked server an empty data directory: every stream is gone, and
        nothing acknowledged before can be demanded any more (that loss is the finding that made
        the operator do it)."""
        for inc in self.all_incs:
            inc.tails = TailLog()
            inc.final_tail = None
            inc.replaced = True
            for append in inc.acks.values():
                append.may_be_lost = True
        for append in self.appends.values():
            if append.acked is not None or append.duplicate_of:
                append.may_be_lost = True
        for record in self.names.values():
            record.add(Change(fault.time, fault.time, frozenset({ABSENT}), fault.id))
        self.extra.pop("subs", None)
        self.replaced_at = fault.time

    def _rewind(self, time: float, window: float, event: int) -> None:
        """A fault the contract lets take back the last `window` seconds of acknowledged writes:
        what was acknowledged or shown since may now be missing or rewritten."""
        since = time - window
        for inc in self.all_incs:
            cut, _ = inc.tails.floor(since)
            cut = max(cut, inc.base)
            inc.tails.cut_after(since)
            inc.floors.cut_after(since)
            inc.seen.truncate(cut)
            inc.islands.clear()
            if inc.parsed_upto > cut:
                inc.parsed_upto = -1
                inc.found = {r: p for r, p in inc.found.items() if p < cut}
                inc.producer_last.clear()  # re-learnt from the next parse from the start
                inc.resynced = False
                inc.fold = {} if inc.json and inc.source is None else None
                inc.snapshot = inc.snapshot_fold = None
            for position, append in list(inc.acks.items()):
                if position + len(append.stored) > cut:
                    append.may_be_lost = True
                    if append.found is not None and append.found[1] >= cut:
                        append.found = None
            if inc.final_tail is not None and inc.final_tail[0] > cut:
                inc.final_tail = None
        for record in self.names.values():
            possible = record.during(since, time)
            record.add(Change(time, time, frozenset(possible), event))

    def fault_explains(
        self, status: int, body: str, started: OpStarted, ended: OpEnded, inc: Incarnation | None
    ) -> bool:
        """Whether a 503/507 is explained by a fault active during the operation."""
        reason = contract.fault_reason(status, body)
        s, e = started.time, ended.time
        if self.cluster is not None:
            blamed = self.cluster.blamed(status, body, started.name)
            if blamed is not None:
                return any(self.faults.member_down(m, s, e, MEMBER_GRACE) for m in blamed)
            if status == 503 and not contract.error_code(body) and self.any_member_down(s - MEMBER_GRACE, e):
                return True  # no body to tell who answered (a HEAD, a client that took too few bytes)
        disk = self.faults.active("disk", s, e, contract.GRACE["disk"]) or self.faults.active(
            "disk-faults", s, e, contract.GRACE["disk-faults"]
        )
        if status == 503 and not contract.error_code(body):  # a client that took too few bytes to tell
            return (
                disk
                or self.faults.active("s3", s, e, contract.GRACE["cold-backlog"])
                or self.faults.happened("s3_wipe", 0, e)
            )
        if reason == "disk":
            return disk
        if reason == "down":  # not_ready: the restart's window lasts until recovery ends (rig.py)
            return self.server_down(s, e)
        if reason == "cold-backlog":  # uploads wait for the bucket, or fail to read a failing disk
            grace = contract.GRACE["cold-backlog"]
            return (
                self.faults.active("s3", s, e, grace)
                or self.faults.happened("s3_wipe", s - grace, e)
                or self.faults.active("disk-faults", s, e, grace)
            )
        # cold-read: the bucket is down now, or was wiped since this stream's data (or, for a
        # fork, its source's) went into it.
        if self.faults.active("s3", s, e, contract.GRACE["cold-read"]):
            return True
        chain = list(inc.chain()) if inc is not None else []
        return any(i.cold_wiped_at is not None for i in chain) or (
            (inc is None or inc.source is not None) and self.faults.happened("s3_wipe", 0, e)
        )

    def server_down(self, start: float, end: float, member: str | None = None) -> bool:
        if member is not None:
            return self.faults.member_down(member, start, end, contract.GRACE["down"])
        return self.faults.active("down", start, end, contract.GRACE["down"])

    # ---- the end -------------------------------------------------------------------------

    def finish(self) -> None:
        """Checks that need the whole history: acknowledged appends present in content read to
        the end, and stored order against real time; then the families' own (`finishers`)."""
        self._finish_content()
        for finisher in self.finishers.values():
            finisher(self)

    def _finish_content(self) -> None:
        for inc in self.all_incs:
            if inc.foreign:
                continue
            self._parse(inc)
            origin = max(inc.base, inc.final_floor)
            known = inc.seen.known_end(origin)
            # Judged against the final full read (what the stream holds at the end): every
            # acknowledged append must be in it.
            complete = inc.final_read is not None and known >= inc.final_read[0] and not inc.replaced
            if complete:
                for append in {a for a in self.appends.values() if a.name == inc.name}:
                    promised = (append.acked is not None and append.acked[0] is inc) or any(
                        i is inc for i, _ in append.duplicate_of
                    )
                    if not promised or append.may_be_lost or self._below_floor(inc, append):
                        continue
                    assert inc.final_read is not None
                    self.check(
                        "acked-present",
                        append.found is not None and append.found[0] is inc,
                        "lost-append",
                        f"{inc.label()}: append {append.key} was acknowledged but the stream, read to its "
                        f"end ({inc.final_read[0]}) at the end of the run, does not hold it",
                        [append.acked[3] if append.acked else append.attempts[-1], inc.final_read[1]],
                    )
            self._check_order(inc)

    @staticmethod
    def _below_floor(inc: Incarnation, append: SentAppend) -> bool:
        """Whether retention may have dropped `append` from `inc`: it began below the final floor
        (a duplicate's answer says only that it is somewhere below the tail it reported)."""
        if inc.final_floor <= inc.base:
            return False
        if append.acked is not None and append.acked[0] is inc:
            return append.acked[1] - len(append.stored) < inc.final_floor
        return True

    def _check_order(self, inc: Incarnation) -> None:
        """No append stored before another that was acknowledged before it was even sent."""
        landed = sorted(
            (a.found[1], a)
            for a in self.appends.values()
            if a.found is not None and a.found[0] is inc and a.record_ids[0] == a.key
        )
        best: tuple[float, SentAppend] | None = None  # earliest ack among appends stored later
        for _, append in reversed(landed):
            if best is not None and best[0] < append.first_start:
                later = best[1]
                self.finding(
                    "order",
                    f"{inc.label()}: append {append.key} is stored before {later.key}, which was "
                    f"acknowledged before {append.key} was sent",
                    [append.attempts[0], later.acked[3] if later.acked else 0],
                )
                return
            self.checks["order"] += 1
            if append.acked is not None and (best is None or append.acked[2] < best[0]):
                best = (append.acked[2], append)

    def register_append(
        self,
        key: str,
        name: str,
        stored: bytes,
        record_ids: list[str],
        producer: tuple[str, int, int] | None,
        started: OpStarted,
    ) -> SentAppend:
        append = self.appends.get(key)
        if append is None:
            append = SentAppend(key, name, stored, record_ids, producer, started.time)
            for record_id in record_ids:
                self.appends[record_id] = append
        append.attempts.append(started.id)
        append.in_flight += 1
        return append

    def attempt_ended(self, append: SentAppend, verdict: str) -> None:
        append.in_flight -= 1
        append.verdicts.append(verdict)
        if append.state == FAILED and append.found is not None:  # shown to a reader meanwhile
            inc, position = append.found
            self.finding(
                "failed-append-present",
                f"{inc.label()}: append {append.key} is stored at {position}, but every attempt "
                f"definitely failed ({', '.join(append.verdicts)})",
                append.attempts,
            )


def _change_key(append: SentAppend, record_id: str) -> str | None:
    """The key the change `record_id` of `append` set (its bytes are the canonical messages)."""
    units, _ = payloads.parse_json_units(append.stored)
    for unit in units:
        if unit.record_id == record_id:
            change = payloads.state_change(unit.value)
            return change[0] if change is not None else None
    return None


def _state_diff(got: dict[str, str], want: dict[str, str]) -> str:
    keys = sorted(set(got) | set(want))
    differing = [f"{k}: {got.get(k)} (expected {want.get(k)})" for k in keys if got.get(k) != want.get(k)]
    return "; ".join(differing[:4]) or "the same"
