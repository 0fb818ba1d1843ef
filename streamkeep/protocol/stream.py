"""A stream's state and the pure rules that change it: create matching, appends, producers, TTL.

The actor holds a `StreamMeta` and producer table, asks `plan_append` what an append means, writes
the plan durably through storage, then applies it with `apply_append`. Nothing here awaits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, cast

from streamkeep.protocol import headers as h
from streamkeep.protocol import jsonmode
from streamkeep.protocol.errors import ProtocolError, bad_request, conflict
from streamkeep.protocol.model import Headers
from streamkeep.protocol.names import STREAM_PREFIX, parse_stream_name
from streamkeep.protocol.offsets import Offset, decode, encode, incarnation_of


@dataclass(frozen=True)
class ProducerState:
    epoch: int
    last_seq: int


@dataclass(frozen=True)
class ProducerMark:
    """The (id, epoch, seq) of the append that closed a stream, to recognise its retries."""

    producer_id: str
    epoch: int
    seq: int


@dataclass(slots=True)  # one per stream kept in memory, idle or not: 192 B with slots, 288 without
class StreamMeta:
    name: str
    stream_id: str
    content_type: str
    created_at: float
    ttl_seconds: int | None = None
    expires_at: str | None = None
    expires_at_ts: float | None = None
    closed: bool = False
    closed_by: ProducerMark | None = None
    last_stream_seq: str | None = None
    # Sliding-TTL clock: the last read or write that reached the server.
    last_access: float = 0.0
    # Forks (§4.2): the source stream, the position where this stream's own data begins, and the
    # fork headers as given (for idempotent re-creation).
    forked_from: str | None = None
    fork_base: int = 0
    fork_offset: str | None = None
    fork_sub_offset: int = 0
    # Deleted while forks still read its data: 410 to clients, kept for the forks.
    soft_deleted: bool = False
    # Live forks that read from this stream (derived, rebuilt at recovery; not persisted).
    fork_count: int = 0
    # In a cluster (streamkeep/cluster/forks.py). On a source: the pins of its forks that other
    # members own, (fork stream id, fork name, lowest position the fork reads), persisted before
    # the fork is created. On such a fork: the lowest position its source held for it and the
    # incarnations of its source chain (offset tokens of the source are valid here too).
    remote_forks: tuple[tuple[str, str, int], ...] = ()
    fork_low: int = 0
    source_incarnations: tuple[int, ...] = ()

    def expired(self, now: float) -> bool:
        if self.expires_at_ts is not None and now >= self.expires_at_ts:
            return True
        return self.ttl_seconds is not None and now >= self.last_access + self.ttl_seconds

    @property
    def json_mode(self) -> bool:
        return h.is_json(self.content_type)

    @property
    def incarnation(self) -> int:
        """The first half of this stream's offset tokens (streamkeep.protocol.offsets)."""
        return incarnation_of(self.stream_id)


@dataclass(frozen=True)
class ForkSpec:
    source: str
    offset_token: str | None  # as given, for idempotent re-creation
    offset: Offset | None  # None: the source's tail
    sub_offset: int

    @classmethod
    def from_headers(cls, headers: Headers) -> ForkSpec | None:
        """The fork headers of a PUT (§4.2), validated; None for a plain create."""
        source = headers.get("stream-forked-from")
        offset = headers.get("stream-fork-offset")
        sub = headers.get("stream-fork-sub-offset")
        if source is None:
            if offset is not None or sub is not None:
                raise bad_request(
                    "fork_header_alone",
                    "Stream-Fork-Offset and Stream-Fork-Sub-Offset need Stream-Forked-From",
                )
            return None
        path = source.strip().split("?", 1)[0]
        if "://" in path:  # a full URL: keep its path
            path = "/" + path.split("://", 1)[1].partition("/")[2]
        if not path.startswith(STREAM_PREFIX):
            raise bad_request(
                "invalid_fork_source", f"Stream-Forked-From must be a path under {STREAM_PREFIX}"
            )
        if sub is not None and not h.DECIMAL.fullmatch(sub):
            raise bad_request(
                "invalid_fork_sub_offset", "Stream-Fork-Sub-Offset must be a non-negative whole number"
            )
        return cls(
            source=parse_stream_name(path),
            offset_token=offset,
            offset=None if offset is None else decode(offset),
            sub_offset=int(sub) if sub is not None else 0,
        )


@dataclass(frozen=True)
class ForkSource:
    """What a fork takes from its source at creation. `low` and `incarnations` only for a source
    on another cluster member: where its pin holds data from, and its chain's incarnations."""

    content_type: str
    ttl_seconds: int | None
    expires_at: str | None
    expires_at_ts: float | None
    base: int
    low: int = 0
    incarnations: tuple[int, ...] = ()


# One copy of each content type for the streams that have it: each create parses its own from
# the request, ~60 B per stream kept for as long as the stream lives (issue 26: an idle stream in
# 2 KiB). Bounded, so a client inventing content types cannot grow it.
_SHARED_CONTENT_TYPES: dict[str, str] = {}
MAX_SHARED_CONTENT_TYPES = 1024


def shared_content_type(content_type: str) -> str:
    """The copy of `content_type` that streams share (or `content_type` itself, once the table is full)."""
    shared = _SHARED_CONTENT_TYPES.get(content_type)
    if shared is not None:
        return shared
    if len(_SHARED_CONTENT_TYPES) < MAX_SHARED_CONTENT_TYPES:
        _SHARED_CONTENT_TYPES[content_type] = content_type
    return content_type


def _initial_messages(body: bytes, content_type: str) -> list[bytes]:
    if not body:
        return []
    if h.is_json(content_type):
        return jsonmode.split_messages(body, allow_empty_array=True)
    return [body]


@dataclass(frozen=True)
class CreateSpec:
    content_type: str
    ttl_seconds: int | None
    expires_at: tuple[str, float] | None
    closed: bool
    messages: list[bytes]
    body: bytes = b""
    content_type_given: bool = True
    fork: ForkSpec | None = None

    @classmethod
    def from_request(cls, headers: Headers, body: bytes) -> CreateSpec:
        content_type = h.content_type_for_create(headers)
        ttl = h.ttl_seconds(headers)
        expires = h.expires_at(headers)
        if ttl is not None and expires is not None:
            raise bad_request("ttl_and_expires_at", "send Stream-TTL or Stream-Expires-At, not both")
        fork = ForkSpec.from_headers(headers)
        given = bool((headers.get("content-type") or "").strip())
        # A fork's messages are split once its source's content type is known (`split`); made
        # here rather than by `replace` afterwards, which cost each create ~2.5 us (issue 26).
        messages = [] if fork is not None else _initial_messages(body, content_type)
        return cls(content_type, ttl, expires, h.closed_flag(headers), messages, body, given, fork)

    def split(self, content_type: str) -> list[bytes]:
        """The initial messages of the body, for a stream of this content type."""
        return _initial_messages(self.body, content_type)

    def new_meta(self, name: str, stream_id: str, now: float) -> StreamMeta:
        return StreamMeta(
            name=name,
            stream_id=stream_id,
            content_type=shared_content_type(self.content_type),
            created_at=now,
            ttl_seconds=self.ttl_seconds,
            expires_at=self.expires_at[0] if self.expires_at else None,
            expires_at_ts=self.expires_at[1] if self.expires_at else None,
            closed=self.closed,
            last_access=now,
        )

    def matches(self, meta: StreamMeta) -> bool:
        """Idempotent PUT: same content type, TTL/expiry, closure status and fork (§5.1, §4.2)."""
        fork = self.fork
        if fork is None:
            if meta.forked_from is not None:
                return False
        elif (fork.source, fork.offset_token, fork.sub_offset) != (
            meta.forked_from,
            meta.fork_offset,
            meta.fork_sub_offset,
        ):
            return False
        if (self.content_type_given or fork is None) and h.media_type(self.content_type) != h.media_type(
            meta.content_type
        ):
            return False
        # A fork that asked for no expiry inherited its source's; any inherited value matches.
        inherited = fork is not None and self.ttl_seconds is None and self.expires_at is None
        if not inherited and (
            self.ttl_seconds != meta.ttl_seconds
            or (self.expires_at[1] if self.expires_at else None) != meta.expires_at_ts
        ):
            return False
        return self.closed == meta.closed


@dataclass(slots=True)  # not frozen: built per request, where frozen's __init__ costs ~1 us
class AppendSpec:
    content_type: str | None
    body: bytes
    close: bool
    producer: h.ProducerHeaders | None
    stream_seq: str | None
    # The body's JSON messages, already split and encoded as `jsonmode.split_messages` would, for
    # an append the server makes itself (the registry's entries): decoding and re-encoding what
    # it had just encoded cost each create ~5 us (issue 26). Never set from a request.
    messages: list[bytes] | None = None

    @classmethod
    def from_request(cls, headers: Headers, body: bytes) -> AppendSpec:
        spec = cls(
            content_type=h.content_type_for_append(headers),
            body=body,
            close=h.closed_flag(headers),
            producer=h.producer(headers),
            stream_seq=headers.get("stream-seq"),
        )
        if not body and not spec.close:
            raise bad_request(
                "empty_body", "an append needs a body; send Stream-Closed: true to close instead"
            )
        return spec


@dataclass(slots=True)  # not frozen: built per request, where frozen's __init__ costs ~1 us
class AppendPlan:
    """What an accepted append writes, all in one durable step."""

    messages: list[bytes]
    close: bool
    producer_id: str | None = None
    producer_state: ProducerState | None = None
    stream_seq: str | None = None


@dataclass(slots=True)  # not frozen: built per request, where frozen's __init__ costs ~1 us
class AppendOutcome:
    """The reply to an append that was accepted, deduplicated or was a close-only."""

    status: int
    next_offset: int
    closed: bool
    producer_epoch: int | None = None
    producer_seq: int | None = None

    def headers(self, incarnation: int) -> list[tuple[str, str]]:
        out = [("Stream-Next-Offset", encode(self.next_offset, incarnation))]
        if self.closed:
            out.append(("Stream-Closed", "true"))
        if self.producer_epoch is not None:
            out.append(("Producer-Epoch", str(self.producer_epoch)))
            out.append(("Producer-Seq", str(self.producer_seq)))
        return out


@dataclass
class StreamState:
    meta: StreamMeta
    producers: dict[str, ProducerState] = field(default_factory=dict)
    tail: int = 0


def _closed_conflict(state: StreamState) -> ProtocolError:
    return conflict(
        "stream_closed",
        "the stream is closed and accepts no more appends",
        [("Stream-Closed", "true"), ("Stream-Next-Offset", encode(state.tail, state.meta.incarnation))],
    )


def _check_producer(state: StreamState, producer: h.ProducerHeaders) -> ProducerState | None:
    """The producer's next state, or None for a duplicate; raises for stale, gapped or bad seqs."""
    current = state.producers.get(producer.producer_id)
    if current is None or producer.epoch > current.epoch:
        if producer.seq != 0:
            if current is None:
                raise conflict(
                    "producer_sequence_gap",
                    f"producer {producer.producer_id!r} is new here; its first Producer-Seq must be 0",
                    [("Producer-Expected-Seq", "0"), ("Producer-Received-Seq", str(producer.seq))],
                )
            raise bad_request("producer_epoch_seq", "a new Producer-Epoch must start at Producer-Seq 0")
        return ProducerState(producer.epoch, 0)
    if producer.epoch < current.epoch:
        raise ProtocolError(
            403,
            "stale_producer_epoch",
            f"producer epoch {producer.epoch} is older than {current.epoch}; this producer is fenced",
            [("Producer-Epoch", str(current.epoch))],
        )
    if producer.seq <= current.last_seq:
        return None
    if producer.seq == current.last_seq + 1:
        return ProducerState(current.epoch, producer.seq)
    raise conflict(
        "producer_sequence_gap",
        f"expected Producer-Seq {current.last_seq + 1}, got {producer.seq}",
        [
            ("Producer-Expected-Seq", str(current.last_seq + 1)),
            ("Producer-Received-Seq", str(producer.seq)),
        ],
    )


def plan_append(state: StreamState, spec: AppendSpec) -> AppendPlan | AppendOutcome:
    """Decide an append: a plan to write, or an outcome that writes nothing. Raises for errors.

    Precedence follows §5.2: a closed stream first, then content type, then sequences.
    """
    meta = state.meta
    producer = spec.producer
    if meta.closed:
        mark = meta.closed_by
        if (
            producer is not None
            and mark is not None
            and (mark.producer_id, mark.epoch, mark.seq)
            == (producer.producer_id, producer.epoch, producer.seq)
        ):
            return AppendOutcome(204, state.tail, True, producer.epoch, producer.seq)
        if not spec.body and producer is None:
            return AppendOutcome(204, state.tail, True)
        raise _closed_conflict(state)

    if spec.body:
        if spec.content_type is None:
            raise bad_request("missing_content_type", "an append with a body needs a Content-Type")
        if spec.content_type != meta.content_type and h.media_type(spec.content_type) != h.media_type(
            meta.content_type
        ):
            raise conflict(
                "content_type_mismatch",
                f"stream holds {meta.content_type!r}, the append is {spec.content_type!r}",
            )

    next_producer: ProducerState | None = None
    if producer is not None:
        next_producer = _check_producer(state, producer)
        if next_producer is None:
            last = state.producers[producer.producer_id].last_seq
            return AppendOutcome(204, state.tail, False, producer.epoch, last)

    if spec.stream_seq is not None and meta.last_stream_seq is not None:
        if spec.stream_seq.encode() <= meta.last_stream_seq.encode():
            raise conflict(
                "stream_seq_regression",
                f"Stream-Seq {spec.stream_seq[:80]!r} is not greater than the last one",
            )

    if not spec.body:
        messages: list[bytes] = []
    elif spec.messages is not None and meta.json_mode:
        messages = spec.messages
    elif meta.json_mode:
        messages = jsonmode.split_messages(spec.body, allow_empty_array=False)
    else:
        messages = [spec.body]
    return AppendPlan(
        messages=messages,
        close=spec.close,
        producer_id=producer.producer_id if producer else None,
        producer_state=next_producer,
        stream_seq=spec.stream_seq,
    )


def apply_append(state: StreamState, plan: AppendPlan, new_tail: int) -> AppendOutcome:
    """Record a plan that storage has made durable; returns the reply."""
    meta = state.meta
    state.tail = new_tail
    if plan.producer_id is not None and plan.producer_state is not None:
        state.producers[plan.producer_id] = plan.producer_state
    if plan.stream_seq is not None:
        meta.last_stream_seq = plan.stream_seq
    if plan.close:
        meta.closed = True
        if plan.producer_id is not None and plan.producer_state is not None:
            meta.closed_by = ProducerMark(
                plan.producer_id, plan.producer_state.epoch, plan.producer_state.last_seq
            )
    if plan.producer_state is not None:
        # 200 marks new data from a producer; a producer's close-only stores none, so 204.
        status = 200 if plan.messages else 204
        return AppendOutcome(
            status, new_tail, meta.closed, plan.producer_state.epoch, plan.producer_state.last_seq
        )
    return AppendOutcome(204, new_tail, meta.closed)


def _field_copier() -> Callable[[StreamMeta], StreamMeta]:
    """A function that copies every field by name, written out from the field list as dataclasses
    writes `__init__`: ~0.7 us, where `dataclasses.replace` takes ~3 us (keyword arguments through
    `__init__`) and a loop over the fields ~2 us."""
    names = [f.name for f in fields(StreamMeta)]
    body = "".join(f"    copy.{name} = meta.{name}\n" for name in names)
    source = f"def copy_meta(meta):\n    copy = new(StreamMeta)\n{body}    return copy\n"
    namespace: dict[str, Any] = {"new": object.__new__, "StreamMeta": StreamMeta}
    # Compiled under this file's name, so profiles (ops/profile_append.py) count it as planning.
    exec(compile(source, __file__, "exec"), namespace)
    return cast("Callable[[StreamMeta], StreamMeta]", namespace["copy_meta"])


copy_meta = _field_copier()
"""A shallow copy of a `StreamMeta` (every field is immutable), once per append."""
