"""The reference model both torture tiers judge a history against.

A stream is, per incarnation, an append-only sequence of bytes (a JSON stream's bytes are its
messages in compact form, one after another, as the server stores them). Everything a client
learns is an observation of a range of those bytes, located by offset tokens, whose first half
names the incarnation:

- an acknowledged append: its body ends at the position its Stream-Next-Offset names;
- a read (catch-up, long-poll, each SSE data event): these bytes lie between these offsets.

Every append body carries a unique id (`ids_in` finds them), so the bytes can be parsed back into
the appends that wrote them. The checker holds, per incarnation, every byte any observation
showed, and reports:

- two observations that disagree about a byte (a lost, torn, duplicated or reordered append
  shows up this way, and so does data from another incarnation);
- an acknowledged append missing after a restart, beyond what the fsync mode's contract allows
  (`CONTRACTS`), or at the end;
- an append id stored twice, an id nobody sent to that stream, an append that was answered with
  an error yet is stored;
- two acknowledged appends ending at the same offset, data after an acknowledged close;
- a status the protocol does not name for the operation, any 500, and a 503/507 while no fault
  was active;
- a stream whose creation was acknowledged that is gone after a restart though nobody deleted it.

`Checker.observe` takes events in the order they completed; `Checker.findings` is the verdict.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# What each --fsync mode promises (docs/segment-format.md, "Durability contract"): whether a
# power cut may lose acknowledged appends, and how recent they must be to be allowed to go.
CONTRACTS = {
    "always": {"crash_loses": False, "power_cut_loses": False},
    "interval": {"crash_loses": False, "power_cut_loses": True, "window": "fsync_interval"},
    "never": {"crash_loses": False, "power_cut_loses": True, "window": None},
}

# Statuses the protocol names for each operation (PROTOCOL.md); 503/507 are judged separately.
ALLOWED = {
    "create": {200, 201, 400, 404, 409, 410},
    "fork": {200, 201, 400, 404, 409, 410},
    "append": {200, 204, 400, 403, 404, 409, 410, 413},
    "close": {200, 204, 400, 404, 409, 410},
    "delete": {204, 404, 410},
    "read": {200, 204, 304, 400, 404, 410},
    "head": {200, 404, 410},
}
FAULT_STATUSES = {503, 507}

_TEXT_ID = re.compile(rb"<([A-Za-z0-9._-]+)\|[a-z]*>")
_JSON_ID = re.compile(rb'"id":"([A-Za-z0-9._-]+)"')


def text_body(append_id: str, filler: str) -> bytes:
    return f"<{append_id}|{filler}>".encode()


def json_message(append_id: str, filler: str) -> bytes:
    return json.dumps({"id": append_id, "p": filler}, separators=(",", ":")).encode()


def ids_in(data: bytes, json_mode: bool) -> list[str]:
    return [m.decode() for m in (_JSON_ID if json_mode else _TEXT_ID).findall(data)]


def stored_json(body: bytes) -> bytes:
    """The bytes a JSON read's array body stands for: each message compact, concatenated."""
    value = json.loads(body)
    items = value if isinstance(value, list) else [value]
    return b"".join(json.dumps(item, separators=(",", ":"), ensure_ascii=False).encode() for item in items)


def split_token(token: str | None) -> tuple[int, int] | None:
    if not token or len(token) != 33 or token[16] != "_":
        return None
    return int(token[:16]), int(token[17:])


@dataclass
class Event:
    """One operation as a client saw it. `status` None: no answer (the server died, or the
    operation was cut off): it may or may not have happened."""

    op: str  # create | fork | append | close | delete | read | head
    stream: str
    client: int
    started: float
    ended: float
    status: int | None
    json_mode: bool = False
    append_ids: list[str] = field(default_factory=list)  # ids this operation tried to store
    data: bytes = b""  # an append's stored bytes, or what a read chunk returned (stored form)
    start: str | None = None  # a read's start token (or "-1"/"now")
    next_offset: str | None = None  # Stream-Next-Offset of the answer
    chunks: list[tuple[int, bytes, str]] = field(default_factory=list)  # SSE: (start pos, data, next token)
    producer: tuple[str, int, int] | None = None
    duplicate: bool = False  # a producer append answered as a duplicate
    closed: bool = False  # Stream-Closed: true in the answer
    code: str = ""  # the error code of an error answer
    fork_of: str | None = None
    note: str = ""

    def describe(self) -> str:
        status = "no answer" if self.status is None else str(self.status)
        what = f"{self.op} {self.stream} by client {self.client} at {self.started:.3f}-{self.ended:.3f}: {status}"
        if self.code:
            what += f" {self.code}"
        if self.append_ids:
            what += f" ids={self.append_ids}"
        if self.next_offset:
            what += f" next={self.next_offset}"
        return what


@dataclass
class Incarnation:
    name: str
    number: int
    json_mode: bool
    known: bytearray = field(default_factory=bytearray)
    seen: bytearray = field(default_factory=bytearray)  # 1 where `known` holds an observed byte
    acked: list[tuple[int, bytes, Event]] = field(default_factory=list)  # (end, data, event)
    lost_within_contract: set[str] = field(default_factory=set)
    closed_at: int | None = None
    length: int | None = None  # the recovered or final length, when known

    def learn(self, start: int, data: bytes, event: Event, findings: list[str]) -> None:
        end = start + len(data)
        if end > len(self.known):
            grow = end - len(self.known)
            self.known.extend(b"\0" * grow)
            self.seen.extend(b"\0" * grow)
        for offset in range(len(data)):
            position = start + offset
            if self.seen[position] and self.known[position] != data[offset]:
                findings.append(
                    f"{self.name} (incarnation {self.number}): two answers disagree at position {position}: "
                    f"{bytes(self.known[max(start, position - 8) : position + 24])!r} was seen before, now "
                    f"{data[max(0, offset - 8) : offset + 24]!r} from {event.describe()}"
                )
                return
        self.known[start:end] = data
        self.seen[start:end] = b"\1" * len(data)

    def truncate(self, length: int) -> None:
        del self.known[length:]
        del self.seen[length:]


class Checker:
    def __init__(self, fsync: str = "always", fsync_interval: float = 1.0) -> None:
        self.fsync = fsync
        self.fsync_interval = fsync_interval
        self.findings: list[str] = []
        self.incarnations: dict[tuple[str, int], Incarnation] = {}
        self.sent: dict[str, set[str]] = {}  # stream name -> ids ever sent to it
        self.failed_ids: dict[str, Event] = {}  # ids whose every attempt was answered with an error
        self.ok_ids: set[str] = set()
        self.fork_sources: dict[str, set[str]] = {}  # fork name -> source names it ever had
        self.fault_windows: list[tuple[float, float]] = []
        self.open_faults: dict[str, float] = {}
        self.created: dict[str, float] = {}  # streams whose creation was acknowledged, and when
        self.deleted_or_maybe: dict[str, float] = {}  # a delete that happened or may have
        self.ttl_streams: set[str] = set()
        self.events = 0
        self.by_op: dict[str, int] = {}
        self.by_status: dict[str, int] = {}

    # ---- faults and restarts --------------------------------------------------------------

    # Effects outlive a fault a little: backoffs (at most a minute) and repairs.
    AFTERMATH = 65.0

    def fault_began(self, kind: str, at: float) -> None:
        """A fault (failing disk, full disk, unreachable bucket) is active from `at` on."""
        self.open_faults.setdefault(kind, at)

    def fault_ended(self, kind: str, at: float) -> None:
        began = self.open_faults.pop(kind, None)
        if began is not None:
            self.fault_windows.append((began, at + self.AFTERMATH))

    def _faulty(self, event: Event) -> bool:
        if any(began <= event.ended for began in self.open_faults.values()):
            return True
        return any(begin <= event.ended and event.started <= end for begin, end in self.fault_windows)

    def recovered(
        self,
        name: str,
        tail: str | None,
        content: bytes | None,
        *,
        exists: bool,
        closed: bool,
        at: float,
        power_cut: bool,
        cut_at: float,
    ) -> None:
        """After a restart: whether `name` exists, its tail offset and closed flag (from HEAD), and
        its bytes if a full read could get them (a bucket that is down cannot serve its cold part).
        Checks the fsync mode's contract and forgets what the contract allowed to be lost."""
        if not exists:
            if name in self.created and name not in self.deleted_or_maybe and name not in self.ttl_streams:
                self.findings.append(
                    f"{name}: created at {self.created[name]:.3f} and never deleted, gone after the restart at {cut_at:.3f}"
                )
            return
        parsed = split_token(tail)
        if parsed is None:
            return
        incarnation = self.incarnations.get((name, parsed[0]))
        if incarnation is None:
            return
        length = parsed[1]
        contract = CONTRACTS[self.fsync]
        may_lose = power_cut and contract["power_cut_loses"]
        kind = "power cut" if power_cut else "crash"
        for end, _data, event in incarnation.acked:
            if end <= length:
                continue
            window = contract.get("window")
            recent = window is None or event.ended >= cut_at - (self.fsync_interval * 2 + 1.0)
            if may_lose and recent:
                incarnation.lost_within_contract.update(event.append_ids)
                continue
            self.findings.append(
                f"{name} (incarnation {incarnation.number}): acknowledged append lost at the {kind} at "
                f"{cut_at:.3f} (stream has {length} bytes after it): {event.describe()}"
            )
        if incarnation.closed_at is not None and not closed:
            if not may_lose:
                self.findings.append(f"{name}: its acknowledged close was lost at the {kind} at {cut_at:.3f}")
            incarnation.closed_at = None
        if may_lose:  # what was lost within the contract may be written again, differently
            incarnation.truncate(length)
            incarnation.acked = [item for item in incarnation.acked if item[0] <= length]
        if content is not None:
            incarnation.learn(
                0, content, Event("read", name, -1, at, at, 200, next_offset=tail), self.findings
            )

    # ---- events ---------------------------------------------------------------------------

    def observe(self, event: Event) -> None:
        self.events += 1
        self.by_op[event.op] = self.by_op.get(event.op, 0) + 1
        self.by_status[str(event.status)] = self.by_status.get(str(event.status), 0) + 1
        self._judge_status(event)
        if event.op in ("append", "close", "create", "fork"):
            self.sent.setdefault(event.stream, set()).update(event.append_ids)
            # A create answered 503/507 may have happened (done, but not made durable).
            maybe = event.op in ("create", "fork") and event.status in FAULT_STATUSES
            if event.status is not None and event.status >= 300 and not event.duplicate and not maybe:
                for append_id in event.append_ids:
                    if append_id not in self.ok_ids:
                        self.failed_ids.setdefault(append_id, event)
            else:
                for append_id in event.append_ids:
                    self.ok_ids.add(append_id)
                    self.failed_ids.pop(append_id, None)
        if event.op == "fork" and event.fork_of:
            self.fork_sources.setdefault(event.stream, set()).add(event.fork_of)
        if event.op == "delete" and event.status in (None, 204, 503, 507):  # 503: done, maybe not durably
            self.deleted_or_maybe[event.stream] = event.ended
        if event.status == 201 and event.op in ("create", "fork"):
            self.created[event.stream] = event.ended
            self.deleted_or_maybe.pop(event.stream, None)
            # A stream with a TTL may expire, and a fork inherits its source's TTL (§4.2).
            if event.note == "ttl" or (event.op == "fork" and event.fork_of in self.ttl_streams):
                self.ttl_streams.add(event.stream)
            else:
                self.ttl_streams.discard(event.stream)
        parsed = split_token(event.next_offset)
        if parsed is None or event.status is None or event.status >= 300:
            if event.chunks:
                self._chunks(event)
            return
        incarnation = self._incarnation(event.stream, parsed[0], event.json_mode)
        position = parsed[1]
        if event.op in ("append", "close") and event.status in (200, 204) and not event.duplicate:
            if event.data or event.op == "append":
                start = position - len(event.data)
                incarnation.learn(start, event.data, event, self.findings)
                for end, _, other in incarnation.acked:
                    if end == position and event.data:
                        self.findings.append(
                            f"{event.stream}: two acknowledged appends end at {event.next_offset}: "
                            f"{other.describe()} and {event.describe()}"
                        )
                incarnation.acked.append((position, event.data, event))
            if event.closed or event.op == "close":
                self._closed(incarnation, position, event)
        elif event.op in ("create", "fork") and event.status == 201:
            if event.data:
                incarnation.learn(position - len(event.data), event.data, event, self.findings)
                incarnation.acked.append((position, event.data, event))
            if event.closed:
                self._closed(incarnation, position, event)
        elif event.op == "read" and event.status == 200:
            start = self._start(event, parsed)
            if start is not None:
                incarnation.learn(start, event.data, event, self.findings)
                if position != start + len(event.data):
                    self.findings.append(
                        f"{event.stream}: a read's next offset is not its start plus its data: {event.describe()}"
                    )
            if event.closed:
                self._closed(incarnation, position, event)
        if event.chunks:
            self._chunks(event)

    def _start(self, event: Event, parsed: tuple[int, int]) -> int | None:
        if event.start in ("-1", None):
            return 0
        start = split_token(event.start)
        return None if start is None else start[1]

    def _chunks(self, event: Event) -> None:
        for start, data, token in event.chunks:
            parsed = split_token(token)
            if parsed is None:
                continue
            incarnation = self._incarnation(event.stream, parsed[0], event.json_mode)
            incarnation.learn(start, data, event, self.findings)
            if parsed[1] != start + len(data):
                self.findings.append(
                    f"{event.stream}: an SSE event's offset is not its start plus its data: {event.describe()}"
                )

    def _closed(self, incarnation: Incarnation, position: int, event: Event) -> None:
        if incarnation.closed_at is not None and incarnation.closed_at != position:
            self.findings.append(
                f"{incarnation.name}: closed at {incarnation.closed_at} and again at {position}: {event.describe()}"
            )
        incarnation.closed_at = position if incarnation.closed_at is None else incarnation.closed_at

    def _incarnation(self, name: str, number: int, json_mode: bool) -> Incarnation:
        key = (name, number)
        found = self.incarnations.get(key)
        if found is None:
            found = self.incarnations[key] = Incarnation(name, number, json_mode)
        return found

    def _judge_status(self, event: Event) -> None:
        status = event.status
        if status is None:
            return
        if status >= 500 and status not in FAULT_STATUSES:
            self.findings.append(f"status {status} ({event.code}): {event.describe()}")
            return
        if status in FAULT_STATUSES:
            if not self._faulty(event):
                self.findings.append(f"{status} {event.code} with no fault active: {event.describe()}")
            return
        allowed = ALLOWED.get(event.op, set())
        if status not in allowed:
            self.findings.append(
                f"status {status} is not one the protocol names for {event.op}: {event.describe()}"
            )

    # ---- the end --------------------------------------------------------------------------

    def final(self, name: str, token: str | None, content: bytes | None, json_mode: bool) -> None:
        """The last full read of a stream, with every fault healed: the stored appends themselves."""
        if content is None:
            return
        parsed = split_token(token)
        if parsed is None:
            self.findings.append(f"{name}: final read without a usable offset ({token!r})")
            return
        incarnation = self._incarnation(name, parsed[0], json_mode)
        at = max((e.ended for _, _, e in incarnation.acked), default=0.0)
        incarnation.learn(0, content, Event("read", name, -1, at, at, 200, next_offset=token), self.findings)
        incarnation.length = len(content)
        for end, _data, event in incarnation.acked:
            if end > len(content) and not set(event.append_ids) <= incarnation.lost_within_contract:
                self.findings.append(f"{name}: acknowledged append missing at the end: {event.describe()}")
        if incarnation.closed_at is not None and len(content) != incarnation.closed_at:
            self.findings.append(f"{name}: closed at {incarnation.closed_at} but holds {len(content)} bytes")
        ids = ids_in(content, json_mode)
        seen: set[str] = set()
        allowed = set(self.sent.get(name, set()))
        for source in self._sources(name):
            allowed |= self.sent.get(source, set())
        for append_id in ids:
            if append_id in seen:
                self.findings.append(f"{name}: append {append_id} is stored twice")
            seen.add(append_id)
            if append_id not in allowed:
                self.findings.append(f"{name}: holds append {append_id}, which nobody sent to it")
            failed = self.failed_ids.get(append_id)
            if failed is not None:
                self.findings.append(
                    f"{name}: holds append {append_id}, which was answered with an error: {failed.describe()}"
                )

    def _sources(self, name: str) -> set[str]:
        out: set[str] = set()
        todo = [name]
        while todo:
            for source in self.fork_sources.get(todo.pop(), ()):
                if source not in out:
                    out.add(source)
                    todo.append(source)
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "by_op": dict(sorted(self.by_op.items())),
            "by_status": dict(sorted(self.by_status.items())),
            "incarnations": len(self.incarnations),
            "findings": len(self.findings),
        }
