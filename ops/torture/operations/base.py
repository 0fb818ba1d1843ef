"""The registry, what the clients know (`ClientView`), and helpers every judge uses."""

from __future__ import annotations

import random
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ops.torture import payloads
from ops.torture.history import OK, Call, History, OpEnded, OpStarted, Outcome, to_bytes
from ops.torture.model import Incarnation, Model, SentAppend, State, parse_token

PREFIX = "/v1/stream/"
SUBS = "/v1/stream/__ds/subscriptions/"

# Stream names by kind: content type and how many names of that kind a run uses.
POOLS: dict[str, tuple[str, int]] = {
    "txt": ("text/plain", 5),
    "json": ("application/json", 4),
    "bin": ("application/octet-stream", 3),
    "ttl": ("text/plain", 2),
}
FORKS = 5
WAKE_STREAM = "wake/pool"  # written by the server (pull-wake events), never by clients
SUB_PULL = "torture-pull"
SUB_HOOK = "torture-hook"


def is_json(content_type: str | None) -> bool:
    return (content_type or "").split(";")[0].strip().lower() == "application/json"


def all_names() -> list[str]:
    names = [f"{kind}/{i}" for kind, (_, count) in POOLS.items() for i in range(count)]
    return names + [f"fork/{i}" for i in range(FORKS)]


# ---- what the clients know ---------------------------------------------------------------------


@dataclass
class StreamGuess:
    content_type: str
    exists: bool = False
    tokens: deque[str] = field(default_factory=lambda: deque(maxlen=24))  # offsets seen lately
    size: int = 0
    closed: bool = False


@dataclass
class ProducerGuess:
    producer_id: str
    epoch: int = 0
    seq: int = 0
    pending: dict[str, Any] | None = None  # an attempt to retry: same record, same (epoch, seq)
    retries: int = 0


class ClientView:
    """What the clients know from the answers they got: shared by the workers (under a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.streams: dict[str, StreamGuess] = {}
        for kind, (content_type, count) in POOLS.items():
            for i in range(count):
                self.streams[f"{kind}/{i}"] = StreamGuess(content_type)
        for i in range(FORKS):
            self.streams[f"fork/{i}"] = StreamGuess("text/plain")
        self.cursors: dict[tuple[str, str], str] = {}
        self.producers: dict[tuple[str, str], ProducerGuess] = {}
        self.claims: dict[str, dict[str, Any]] = {}
        self.etags: dict[tuple[str, str], str] = {}
        self.counters: dict[str, int] = {}
        self.sub_confirmed: set[str] = set()
        self.webhook_url: str | None = None
        # Fork mostly onto free fork names (a cluster run: every fork create that gets as far as
        # its source's member is one the kills can cut); otherwise any fork name.
        self.prefer_free_forks = False

    def next_id(self, worker: str) -> str:
        with self.lock:
            n = self.counters.get(worker, 0)
            self.counters[worker] = n + 1
        return f"{worker}.{n}"

    def saw_token(self, name: str, token: str | None) -> None:
        if token and parse_token(token) and name in self.streams:
            with self.lock:
                guess = self.streams[name]
                guess.exists = True
                if not guess.tokens or guess.tokens[-1] != token:
                    guess.tokens.append(token)

    def saw_content_type(self, name: str, content_type: str | None) -> None:
        """A fork's type is its source's, learned from the fork's 201; when that answer was lost
        (an ambiguous or 503 not_durable fork) the clients would keep sending the type they
        guessed, and every append would be refused (409 content_type_mismatch) until the name is
        forked again. A read's or HEAD's Content-Type says the stream's type: learn it there."""
        if not name.startswith("fork/") or not content_type or name not in self.streams:
            return
        if content_type.split(";")[0].strip().lower() == "text/event-stream":
            return  # an SSE answer's own type, not the stream's
        with self.lock:
            self.streams[name].content_type = content_type

    def existing(self, rng: random.Random, kinds: tuple[str, ...] | None = None) -> str | None:
        names = [
            n for n, g in self.streams.items() if g.exists and (kinds is None or n.split("/")[0] in kinds)
        ]
        return rng.choice(names) if names else None


@dataclass
class Planned:
    op: str
    name: str | None
    params: dict[str, Any]
    call: Call
    locks: tuple[str, ...] = ()


@dataclass
class GenContext:
    worker: str
    rng: random.Random
    view: ClientView


# ---- the registry -----------------------------------------------------------------------------


class Operation:
    kind = ""
    status_kind = ""  # which row of contract.STATUSES applies; defaults to kind
    blocking = False  # changes state or content: judged operations wait for it to end
    weight = 0.0  # how often the random schedule picks it (0: never; run by the driver itself)
    from_server = True  # the outcome is the server's answer (not our receiver's or a probe's)
    # Changes a name's state (create, fork, close, delete): judged as soon as it ends, before the
    # operations that overlapped it. Drivers never run two mutators of one name at once.
    mutator = False
    # Run by a real client library (ops/torture/operations/client.py) rather than sent as one
    # `Call`: the tier calls `drive`, which records the client's own requests as operations of
    # their own. Only the single-server black box drives them (it has a real network).
    driven = False

    def generate(self, ctx: GenContext) -> Planned | None:
        return None

    def drive(self, history: History, base_url: str, worker: str, planned: Planned) -> Outcome:
        """A driven operation's run (see `driven`): what came of it, as one outcome."""
        raise NotImplementedError(self.kind)

    def after(self, ctx: GenContext, planned: Planned, outcome: Outcome) -> None:
        pass

    def on_start(self, model: Model, started: OpStarted) -> None:
        pass

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        pass


REGISTRY: dict[str, Operation] = {}


def register(cls: type[Operation]) -> type[Operation]:
    op = cls()
    op.status_kind = op.status_kind or op.kind
    REGISTRY[op.kind] = op
    return cls


# ---- shared judging helpers ---------------------------------------------------------------------


def describe(states: set[State]) -> str:
    parts = []
    for s in states:
        if s.inc is None:
            parts.append("absent")
        else:
            flags = ("closed " if s.closed else "") + ("soft-deleted " if s.soft else "")
            parts.append(f"{flags}{s.inc.label()}")
    return "{" + ", ".join(sorted(parts)) + "}"


def expect_status(
    model: Model, started: OpStarted, ended: OpEnded, allowed: set[int], states: set[State]
) -> None:
    """The status must be one the possible states explain (503/507/500 are judged elsewhere)."""
    status = ended.outcome.status
    if status is None or status >= 500:
        return
    model.check(
        "status-for-state",
        status in allowed,
        "wrong-status",
        f"{started.op} {started.name}: {status} where the stream was {describe(states)} "
        f"(expected one of {sorted(allowed)}): {ended.outcome.body[:160]}",
        [started.id],
    )


def touch(
    model: Model, started: OpStarted, ended: OpEnded, states: set[State], inc: Incarnation | None, write: bool
) -> None:
    """The sliding TTL: an answered read or write surely touched the stream; any attempt may have.
    A read's touch lives in the serving process only: in a cluster run it does not count while its
    member may fail over or restart before the touch's TTL runs out (`Model.read_touch_lasts`)."""
    for state in states:
        if state.inc is not None:
            state.inc.touched_hi = max(state.inc.touched_hi, ended.time)
    if inc is not None and ended.outcome.verdict == OK:
        if write or model.read_touch_lasts(inc, started.time):
            inc.touched_lo = max(inc.touched_lo, started.time)
        if write:
            inc.touched_lo_write = max(inc.touched_lo_write, started.time)


def header_token(
    model: Model, started: OpStarted, ended: OpEnded, states: set[State]
) -> tuple[Incarnation, int] | None:
    token = ended.outcome.headers.get("stream-next-offset")
    if token is None:
        model.finding(
            "missing-header",
            f"{started.op} {started.name}: {ended.outcome.status} without Stream-Next-Offset",
            [started.id],
        )
        return None
    inc = model.inc_of_token(started.name or "", token, states, started.id)
    parsed = parse_token(token)
    if inc is None or parsed is None:
        return None
    possible = {s.inc for s in states if s.inc is not None}
    model.check(
        "incarnation-possible",
        inc in possible,
        "wrong-incarnation",
        f"{started.op} {started.name}: answered by {inc.label()}, but the name held {describe(states)}",
        [started.id, inc.created_by],
    )
    return inc, parsed[1]


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def type_mismatch(state: State, started: OpStarted) -> bool:
    """The request carries a body whose Content-Type is not the stream's: an open stream answers
    409 (§5.2: after "closed", before the producer checks), with neither Stream-Closed nor
    Stream-Next-Offset nor Producer-Expected-Seq. Clients send the type they believe the stream
    has; a fork takes its source's type, and when the fork's answer was lost (an ambiguous or 503
    not_durable fork) they may believe wrong (seeds 168 and 231: appends of text/plain to a fork of
    a binary stream)."""
    if state.inc is None or not started.call.body:
        return False
    sent = next((v for k, v in started.call.headers.items() if k.lower() == "content-type"), None)
    return sent is not None and media_type(sent) != media_type(state.inc.content_type)


def closed_flag(outcome: Outcome) -> bool:
    return outcome.headers.get("stream-closed", "").lower() == "true"


def judge_closed_report(
    model: Model,
    started: OpStarted,
    ended: OpEnded,
    states: set[State],
    inc: Incarnation,
    tail: int,
    closed: bool,
) -> None:
    """An answer at the tail says whether the stream is closed: it must be one of the states."""
    mine = [s for s in states if s.inc is inc]
    if closed:
        model.check(
            "closed-possible",
            any(s.closed for s in mine),
            "closed-without-close",
            f"{started.op} {started.name}: reported {inc.label()} closed, but no close could have applied",
            [started.id],
        )
        model.close_at(inc, tail, started.id)
    else:
        model.check(
            "open-possible",
            not mine or any(not s.closed for s in mine),
            "closed-not-reported",
            f"{started.op} {started.name}: {inc.label()} was closed before this began, but the answer "
            "at its tail does not say so",
            [started.id] + ([inc.final_tail[1]] if inc.final_tail else []),
        )


def record_for(ctx: GenContext, content_type: str, batch: int = 1) -> tuple[str, bytes, bytes, list[str]]:
    """A fresh self-identifying body: (key, request body, stored bytes, record ids)."""
    ids = [ctx.view.next_id(ctx.worker) for _ in range(batch)]
    if is_json(content_type):
        rng = ctx.rng
        messages = [
            payloads.json_message(
                i, payloads.filler(rng), f"k{rng.randrange(payloads.STATE_KEYS)}", delete=rng.random() < 0.1
            )
            for i in ids
        ]
        body = messages[0] if batch == 1 and ctx.rng.random() < 0.5 else b"[" + b",".join(messages) + b"]"
        return ids[0], body, b"".join(messages), ids
    body = payloads.text_record(ids[0], payloads.filler(ctx.rng))
    return ids[0], body, body, ids


def register_body(model: Model, started: OpStarted) -> SentAppend | None:
    p = started.params
    if "record" not in p or p["record"] is None:
        return None
    producer = tuple(p["producer"]) if p.get("producer") else None
    return model.register_append(
        p["record"],
        started.name or "",
        to_bytes(p["stored"]),
        p["record_ids"],
        producer,
        started,
    )
