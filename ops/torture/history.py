"""The recorded history of a torture run: every client operation and every fault, as plain data.

An operation is two events: `OpStarted` (what was asked: the operation kind, its parameters and the
HTTP call) when it is sent, and `OpEnded` (what came back) when it finishes. Between the two the
operation is in flight; the checker needs to know that, since an operation in flight may take
effect at any moment until it ends. Faults (`Fault`) are points in time: kill, restart, disk full
or freed, S3 stopped, frozen, thawed or wiped, a client vanishing.

Every event is a dataclass of JSON types (bytes are kept as latin-1 text, which maps each byte to
one character and back), so a failing run is dumped as JSON lines and re-checked offline
(`python -m ops.torture check FILE`). Times are seconds on the run's clock: wall-clock time in the
black-box tier, the mock clock in the in-process tier.

Each outcome is classified (`classify`): "ok" (definite success), "failed" (the operation certainly
did not happen: a 4xx, a 503/507 whose commit failed, a connection refused, a body never finished)
or "ambiguous" (no answer: a timeout, a connection lost, the server killed; it may or may not have
happened).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The response headers a judgment may need; the rest are dropped to keep histories small.
KEPT_HEADERS = frozenset(
    {
        "content-type",
        "stream-next-offset",
        "stream-earliest-offset",
        "stream-closed",
        "stream-up-to-date",
        "stream-cursor",
        "stream-ttl",
        "stream-expires-at",
        "stream-sse-data-encoding",
        "etag",
        "location",
        "retry-after",
        "producer-epoch",
        "producer-seq",
        "producer-expected-seq",
        "producer-received-seq",
    }
)

OK, FAILED, AMBIGUOUS = "ok", "failed", "ambiguous"

# Why a call got no HTTP answer. "refused": the connection was never made, so the request never
# reached the server; "body_cut": the client reset the connection before its body was complete, so
# the server cannot have acted on it. Anything else ("timeout", "reset", "closed") is ambiguous.
NEVER_SENT = frozenset({"refused", "body_cut"})


def to_text(data: bytes) -> str:
    return data.decode("latin-1")


def to_bytes(text: str) -> bytes:
    return text.encode("latin-1")


@dataclass
class Call:
    """One HTTP request as generated, independent of the tier that sends it."""

    method: str
    path: str
    query: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    body: str = ""  # latin-1 text of the body bytes
    # plain: one request, one response. sse: read events for `limit` seconds or until closed.
    # slow: read the response a byte at a time. vanish: reset the connection after `limit` bytes
    # of the response. cut_body: send the head and part of the body, then reset. send_and_vanish:
    # send the whole request, reset without reading the answer.
    mode: str = "plain"
    limit: float = 0.0


@dataclass
class Chunk:
    """One piece of a read: a catch-up or long-poll body, or an SSE data event with its control."""

    time: float  # when it arrived
    body: str  # latin-1; decoded bytes (SSE base64 undone), JSON text for JSON streams
    next_offset: str | None
    up_to_date: bool
    closed: bool
    cursor: str | None = None


@dataclass
class Outcome:
    status: int | None  # None: no HTTP answer
    headers: dict[str, str] = field(default_factory=dict)
    body: str = ""  # latin-1; for plain reads the data, for errors the JSON error
    chunks: list[Chunk] = field(default_factory=list)  # SSE
    error: str | None = None  # why there is no (complete) answer
    verdict: str = AMBIGUOUS
    partial: bool = False  # a streaming answer cut short (reset, killed, our own limit)


@dataclass
class OpStarted:
    id: int
    op: str
    worker: str
    name: str | None  # the stream the operation is about (None for control paths)
    params: dict[str, Any]
    call: Call
    time: float
    type: str = "start"


@dataclass
class OpEnded:
    id: int
    time: float
    outcome: Outcome
    type: str = "end"


@dataclass
class Fault:
    id: int
    kind: str
    time: float
    detail: dict[str, Any] = field(default_factory=dict)
    type: str = "fault"


Event = OpStarted | OpEnded | Fault


def classify(status: int | None, error: str | None = None, body: str = "") -> str:
    """ok / failed / ambiguous, from the status (or why there is none)."""
    if status is None:
        return FAILED if error in NEVER_SENT else AMBIGUOUS
    if status < 400:
        return OK
    if status == 503 and '"not_durable"' in body:
        return AMBIGUOUS  # done, but maybe not durably: a power cut may take it back
    if status < 500 or status in (503, 507):
        return FAILED
    return AMBIGUOUS  # a 500 or a proxy's 502/504: the request may have half happened


def keep_headers(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers if k.lower() in KEPT_HEADERS}


class History:
    """Thread-safe list of events. Each event takes the clock under the lock, so the list is in
    time order: whoever reads it sees every operation that started before any event it reads."""

    def __init__(self, clock: Callable[[], float] = time.time, meta: dict[str, Any] | None = None) -> None:
        self.clock = clock
        self.meta: dict[str, Any] = dict(meta or {})
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._next_id = 0

    def _id(self) -> int:
        self._next_id += 1
        return self._next_id

    def start(self, op: str, worker: str, name: str | None, params: dict[str, Any], call: Call) -> OpStarted:
        with self._lock:
            event = OpStarted(self._id(), op, worker, name, params, call, self.clock())
            self.events.append(event)
            return event

    def end(self, started: OpStarted, outcome: Outcome) -> OpEnded:
        with self._lock:
            event = OpEnded(started.id, self.clock(), outcome)
            self.events.append(event)
            return event

    def fault(self, kind: str, **detail: Any) -> Fault:
        with self._lock:
            event = Fault(self._id(), kind, self.clock(), detail)
            self.events.append(event)
            return event

    def since(self, index: int) -> list[Event]:
        with self._lock:
            return self.events[index:]

    # ---- files --------------------------------------------------------------------------

    def dump(self, path: Path) -> None:
        with self._lock:
            events = list(self.events)
        with open(path, "w") as out:
            out.write(json.dumps({"type": "meta", **self.meta}) + "\n")
            for event in events:
                out.write(json.dumps(asdict(event)) + "\n")

    @staticmethod
    def load(path: Path) -> tuple[dict[str, Any], list[Event]]:
        meta: dict[str, Any] = {}
        events: list[Event] = []
        with open(path) as source:
            for line in source:
                if line.strip():
                    raw = json.loads(line)
                    if raw.get("type") == "meta":
                        meta = {k: v for k, v in raw.items() if k != "type"}
                    else:
                        events.append(event_from_dict(raw))
        return meta, events


def event_from_dict(raw: dict[str, Any]) -> Event:
    kind = raw["type"]
    if kind == "start":
        return OpStarted(
            raw["id"], raw["op"], raw["worker"], raw["name"], raw["params"], Call(**raw["call"]), raw["time"]
        )
    if kind == "end":
        out = dict(raw["outcome"])
        out["chunks"] = [Chunk(**c) for c in out.get("chunks", [])]
        return OpEnded(raw["id"], raw["time"], Outcome(**out))
    if kind == "fault":
        return Fault(raw["id"], raw["kind"], raw["time"], raw.get("detail", {}))
    raise ValueError(f"unknown event type {kind!r}")
