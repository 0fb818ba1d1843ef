"""Operations a real client drives: `streamkeep.client` (issue 24) against the black-box server.

Every other operation sends one raw `Call` and records its exact answer (that raw transport stays:
it is what lets the model judge every byte). These run a session of the project's own client
library instead, and judge what the library promises on top of the protocol. Only the black-box
tier drives them (`Operation.driven`: it has a real network); they are seeded like the rest (each
session's choices and the faults it injects come from the worker's seeded generator, kept in its
parameters), and a dumped history is judged again offline like any other.

- `client_produce`: an `IdempotentProducer` (auto_claim off, a producer id of its own per session,
  epoch 0; seeded linger, batch size and pipelining depth) appends a seeded number of
  self-identifying records (payloads.py), one `append` each, then flushes and awaits every
  receipt. The session holds the stream's name lock (like a mutator), so no create, close, delete
  or fork of that name interleaves: a producer session is one writer on one live stream; appends,
  reads and the server's faults still race it. Each request the producer sends goes through
  `Recorder`, which records it in the history as a `client_append`, judged exactly as a raw
  `produce` is (status for the stream's state, the echo, a 204 only after an attempt that may have
  landed, acknowledged bytes at their offset, seqs contiguous in the stream). Seeded, the recorder
  also loses an answer after the server gave it (`client_drop`: the producer must send the same
  seq and bytes again and be told it is a duplicate) or refuses a connection before anything is
  sent. The session's outcome lists every receipt: written (next offset, duplicate or not) or
  failed (its error).
  Judged when the session ends: a receipt written as new (not a duplicate) is the answer to a
  request of its own batch, at the offset that request acknowledged. Judged at the end of the run,
  against the final full read of the stream: every record of every written receipt is in the
  incarnation its receipt's offset names, before that offset, and the receipts' records lie in
  the order they were appended. The model itself finds a record stored twice (`duplicate`, and
  `acked-twice` for two 200s), so a retry that defeats deduplication is a finding.
- `client_read`: a `Reader` (catch-up, long-poll, SSE or auto; seeded) from a seeded offset for a
  seeded while. The recorder cuts some of its answers mid-body (seeded: at most a few per
  session), so it must resume from its last offset. Judged: each batch starts where the one
  before it ended, and the bytes delivered are the stream's bytes from where it started (placed
  by offset and compared with what every other reader saw, the final full read included, as the
  raw reads are: `_Read.judge_chunks`); it gives up (`ConnectionFailed`) only while the server is
  down, and raises nothing but the client's typed errors.

`BROKEN_REWRITE` lets a test break the client on purpose (a request rewrite applied before the
request is recorded and sent), to prove the checker notices.
"""

from __future__ import annotations

import itertools
import json
import random
import traceback
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx

from ops.torture import contract, payloads
from ops.torture.history import (
    AMBIGUOUS,
    FAILED,
    OK,
    Call,
    Chunk,
    History,
    OpEnded,
    OpStarted,
    Outcome,
    classify,
    keep_headers,
    to_bytes,
    to_text,
)
from ops.torture.model import Model, parse_token
from ops.torture.operations.base import PREFIX, GenContext, Operation, Planned, is_json, register
from ops.torture.operations.reads import _Read, pick_offset
from ops.torture.operations.streams import Produce
from ops.torture.transport import _error_kind
from streamkeep.client import Client, RetryPolicy, StreamError
from streamkeep.client.errors import ConnectionFailed

# Seconds a session may take at most (a producer's retries outlast a server restart, 1-3 s here).
PRODUCE_LIMIT = 20.0
RETRY_FOR = 12.0
# Chances, per request, of the faults the recorder injects.
DROP_ANSWER = 0.12  # an append's answer lost after the server gave it
REFUSE = 0.04  # a connection refused before anything was sent
CUT_READ = 0.25  # a read's answer cut after a few bytes
MAX_CUTS = 3  # per reader session: fewer than its retry budget
# A request rewrite applied before recording and sending (tests break the client with it).
BROKEN_REWRITE: Callable[[httpx.Request], httpx.Request] | None = None

EXTRA_KEY = "client"  # model.extra: the producer sessions judged at the end


def _policy() -> RetryPolicy:
    return RetryPolicy(attempts=4, base_delay=0.05, max_delay=0.4)


# ---- the recording transport -----------------------------------------------------------------


class _Cut(httpx.AsyncByteStream):
    """An answer's body that breaks after `limit` bytes, as a connection that dropped."""

    def __init__(self, inner: httpx.AsyncByteStream, limit: int) -> None:
        self.inner = inner
        self.limit = limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        left = self.limit
        async for chunk in self.inner:
            if len(chunk) >= left:
                if left:
                    yield chunk[:left]
                raise httpx.ReadError("the torture cut this answer")
            left -= len(chunk)
            yield chunk
        raise httpx.ReadError("the torture cut this answer at its end")

    async def aclose(self) -> None:
        await self.inner.aclose()


class Recorder(httpx.AsyncBaseTransport):
    """The client's transport: records every producer request as a `client_append` operation of
    the history (with the server's exact answer), and injects seeded faults."""

    def __init__(self, history: History, worker: str, name: str, rng: random.Random, *, http2: bool) -> None:
        self.inner = httpx.AsyncHTTPTransport(http1=not http2, http2=http2)
        self.history = history
        self.worker = worker
        self.name = name
        self.rng = rng
        self.last_sent = history.clock()  # when the latest request went out
        self.cuts = 0

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if BROKEN_REWRITE is not None:
            request = BROKEN_REWRITE(request)
        if request.method == "POST" and "producer-id" in request.headers:
            return await self._append(request)
        if self.rng.random() < REFUSE / 2:
            raise httpx.ConnectError("the torture refused this connection", request=request)
        self.last_sent = self.history.clock()
        response = await self.inner.handle_async_request(request)
        if request.method == "GET" and self.cuts < MAX_CUTS and self.rng.random() < CUT_READ:
            self.cuts += 1
            limit = self.rng.randrange(0, 600)
            self.history.fault("client_cut", worker=self.worker, limit=limit)
            assert isinstance(response.stream, httpx.AsyncByteStream)
            return httpx.Response(
                response.status_code,
                headers=response.headers,
                stream=_Cut(response.stream, limit),
                extensions=response.extensions,
            )
        return response

    async def _append(self, request: httpx.Request) -> httpx.Response:
        params = append_params(request)
        if params is None:  # nothing of ours to record (a close without data)
            return await self.inner.handle_async_request(request)
        if self.rng.random() < REFUSE:
            raise httpx.ConnectError("the torture refused this connection", request=request)
        kept = ("content-type", "producer-id", "producer-epoch", "producer-seq", "stream-closed")
        headers = {k: v for k, v in request.headers.items() if k.lower() in kept}
        call = Call("POST", request.url.path, headers=headers, body=params["body"])
        started = self.history.start("client_append", self.worker, self.name, params, call)
        self.last_sent = started.time
        try:
            response = await self.inner.handle_async_request(request)
            content = await response.aread()
        except httpx.HTTPError as error:
            kind = _error_kind(error)
            outcome = Outcome(None, error=f"{kind}: {type(error).__name__}", verdict=classify(None, kind))
            self.history.end(started, outcome)
            raise
        except BaseException:  # cancelled: the request may or may not have reached the server
            self.history.end(started, Outcome(None, error="cancelled", verdict=AMBIGUOUS))
            raise
        text = to_text(content)
        status = response.status_code
        self.history.end(
            started,
            Outcome(
                status, keep_headers(response.headers.items()), text, verdict=classify(status, body=text)
            ),
        )
        if self.rng.random() < DROP_ANSWER:
            self.history.fault("client_drop", op=started.id)
            raise httpx.ReadError("the torture lost this answer after the server gave it", request=request)
        return httpx.Response(
            status, headers=response.headers, content=content, extensions=response.extensions
        )


def append_params(request: httpx.Request) -> dict[str, Any] | None:
    """A producer request as a `produce` operation's parameters (the records its body holds)."""
    body = request.content
    content_type = request.headers.get("content-type", "")
    stored = payloads.json_read_to_stored(body) if body and is_json(content_type) else body
    if not stored:
        return None
    parse = payloads.parse_json_units if is_json(content_type) else payloads.parse_text
    units, _ = parse(stored)
    ids = [u.record_id for u in units if u.record_id]
    if not ids:
        return None
    producer = [
        request.headers["producer-id"],
        int(request.headers.get("producer-epoch", "0")),
        int(request.headers.get("producer-seq", "0")),
    ]
    return {
        "record": ids[0],
        "stored": to_text(stored),
        "record_ids": ids,
        "producer": producer,
        "content_type": content_type,
        "body": to_text(body),
    }


def _error(exc: BaseException) -> dict[str, Any]:
    status = exc.status if isinstance(exc, StreamError) else None
    return {"type": type(exc).__name__, "status": status, "message": str(exc)[:300]}


def _session_outcome(info: dict[str, Any], chunks: list[Chunk] | None = None) -> Outcome:
    failed = info.get("error") is not None or info.get("crash") is not None
    return Outcome(200, body=json.dumps(info), chunks=chunks or [], verdict=FAILED if failed else OK)


# ---- the producer ------------------------------------------------------------------------------


@register
class ClientAppend(Produce):
    """One request of a `client_produce` session's producer, as the recorder saw it: judged as a
    raw `produce` is. The schedule never picks it (the producer sends it)."""

    kind = "client_append"
    status_kind = "produce"
    weight = 0

    def after(self, ctx: GenContext, planned: Planned, outcome: Outcome) -> None:
        pass


@register
class ClientProduce(Operation):
    kind = "client_produce"
    driven = True
    from_server = False  # the session's outcome is ours; its requests are judged one by one
    weight = 3

    def generate(self, ctx: GenContext) -> Planned | None:
        rng, view = ctx.rng, ctx.view
        name = view.existing(rng, ("txt", "json", "bin", "fork"))
        if name is None or view.streams[name].closed:
            return None
        content_type = view.streams[name].content_type
        records = []
        for _ in range(rng.choice((1, 3, 8, 20, 40))):
            record_id = view.next_id(ctx.worker)
            fill = payloads.filler(rng) if rng.random() < 0.9 else "x" * rng.randrange(1, 8)
            if is_json(content_type):
                key = f"k{rng.randrange(payloads.STATE_KEYS)}"
                data = payloads.json_message(record_id, fill, key, delete=rng.random() < 0.1)
            else:
                data = payloads.text_record(record_id, fill)
            records.append([record_id, to_text(data), rng.choice((0.0,) * 6 + (0.002, 0.02))])
        params: dict[str, Any] = {
            "producer": view.next_id(f"{ctx.worker}p").replace(".", "-"),  # one id per session
            "content_type": content_type,
            "records": records,  # [id, stored bytes, pause after its append]
            "linger": rng.choice((0.0, 0.002, 0.01, 0.03)),
            "max_batch_bytes": rng.choice((256, 2048, 1 << 16)),
            "max_in_flight": rng.choice((1, 2, 4)),
            "http2": rng.random() < 0.3,
            "backend": "trio" if rng.random() < 0.3 else "asyncio",
            "seed": rng.getrandbits(32),
        }
        call = Call("POST", PREFIX + name, headers={"Content-Type": content_type}, mode="client")
        return Planned(self.kind, name, params, call, (name,))

    def drive(self, history: History, base_url: str, worker: str, planned: Planned) -> Outcome:
        p = planned.params
        return anyio.run(self._session, history, base_url, worker, planned, backend=p["backend"])

    async def _session(self, history: History, base_url: str, worker: str, planned: Planned) -> Outcome:
        p, name = planned.params, planned.name or ""
        recorder = Recorder(history, worker, name, random.Random(p["seed"]), http2=p["http2"])
        info: dict[str, Any] = {"receipts": [], "error": None, "crash": None}
        try:
            async with Client(base_url, transport=recorder, retries=_policy(), timeout=5.0) as client:
                producer = client.stream(name).producer(
                    p["producer"],
                    epoch=0,
                    auto_claim=False,
                    linger=p["linger"],
                    max_batch_bytes=p["max_batch_bytes"],
                    max_in_flight=p["max_in_flight"],
                    content_type=p["content_type"],
                    retry=_policy(),
                    retry_for=RETRY_FOR,
                )
                receipts = []
                with anyio.move_on_after(PRODUCE_LIMIT):
                    try:
                        async with producer:
                            for _, data, pause in p["records"]:
                                if producer.failure is not None:
                                    break
                                receipts.append(producer.append(to_bytes(data)))
                                if pause:
                                    await anyio.sleep(pause)
                            await producer.flush()
                    except StreamError as exc:
                        info["error"] = _error(exc)
                for receipt in receipts:
                    if not receipt.done:
                        info["receipts"].append({"state": "unknown"})
                        continue
                    try:
                        result = await receipt
                    except StreamError as exc:
                        info["receipts"].append({"state": "failed", "error": _error(exc)})
                    else:
                        info["receipts"].append(
                            {
                                "state": "written",
                                "next_offset": result.next_offset,
                                "duplicate": result.duplicate,
                            }
                        )
        except Exception:
            info["crash"] = traceback.format_exc()[-3000:]
        return _session_outcome(info)

    def after(self, ctx: GenContext, planned: Planned, outcome: Outcome) -> None:
        info = json.loads(outcome.body or "{}")
        name = planned.name or ""
        for receipt in info.get("receipts", []):
            if receipt.get("state") == "written":
                ctx.view.saw_token(name, receipt.get("next_offset"))
        guess = ctx.view.streams[name]
        guess.size += sum(len(data) for _, data, _ in planned.params["records"])
        status = (info.get("error") or {}).get("status")
        if status == 404:
            guess.exists = False
        elif status == 409 and "closed" in (info.get("error") or {}).get("message", "").lower():
            guess.closed = True

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        info = json.loads(ended.outcome.body or "{}")
        if info.get("crash"):
            model.finding(
                "client-error",
                f"client_produce {started.name}: the producer raised what is not a StreamError: "
                f"{info['crash'][-600:]}",
                [started.id],
            )
            return
        records = started.params["records"]
        for (record_id, _stored, _), receipt in zip(records, info.get("receipts", []), strict=False):
            if receipt.get("state") != "written":
                continue
            token = parse_token(receipt.get("next_offset"))
            if not model.check(
                "client-receipt-token",
                token is not None,
                "client-receipt",
                f"client_produce {started.name}: receipt of {record_id} written with next offset "
                f"{receipt.get('next_offset')!r}",
                [started.id],
            ):
                continue
            append = model.appends.get(record_id)
            if receipt.get("duplicate") or append is None:
                continue
            # Written as new: one of its own batch's requests was answered 200 at that offset.
            acked = append.acked
            model.check(
                "client-receipt-ack",
                acked is not None and acked[0].number == token[0] and acked[1] == token[1],  # type: ignore[index]
                "client-receipt",
                f"client_produce {started.name}: {record_id} reported written at {receipt.get('next_offset')}, "
                f"but no request of its batch was acknowledged there "
                f"({'none was' if acked is None else f'{acked[0].label()}:{acked[1]}'})",
                [started.id, *append.attempts],
            )
        sessions = model.extra.setdefault(EXTRA_KEY, [])
        assert isinstance(sessions, list)
        sessions.append((started, info))
        model.finishers[EXTRA_KEY] = _finish_sessions


def _finish_sessions(model: Model) -> None:
    """The end of the run: every written receipt's records in the stream, once, in order."""
    sessions = model.extra.get(EXTRA_KEY, [])
    assert isinstance(sessions, list)
    lossy = [
        t
        for kind in contract.PROCESS_FAULTS
        if contract.loss_window(model.config.fsync, kind, model.config.fsync_interval) > 0
        for t in model.faults.points.get(kind, ())
    ]
    for started, info in sessions:
        if any(t >= started.time for t in lossy):
            continue  # a fault the durability contract lets take acknowledged writes back
        placed: list[tuple[int, int, str]] = []  # (incarnation number, position, record)
        for (record_id, stored, _), receipt in zip(started.params["records"], info["receipts"], strict=False):
            token = parse_token(receipt.get("next_offset")) if receipt.get("state") == "written" else None
            inc = model.incs.get(token[0]) if token else None
            if token is None or inc is None or inc.final_read is None or inc.replaced or inc.opaque:
                continue
            origin = max(inc.base, inc.final_floor)
            if inc.seen.known_end(origin) < inc.final_read[0]:
                continue  # the final read did not see it whole
            append = model.appends.get(record_id)
            if append is not None and append.may_be_lost:
                continue
            position = inc.found.get(record_id)
            if position is None and inc.final_floor > inc.base:
                continue  # retention may have dropped it (its place is not known)
            if not model.check(
                "client-receipt-present",
                position is not None,
                "client-receipt-lost",
                f"{inc.label()}: the producer {started.params['producer']} reported {record_id} written "
                f"(next offset {token[1]}), but the stream read to its end ({inc.final_read[0]}) does not "
                "hold it",
                [started.id, inc.final_read[1]],
            ):
                continue
            assert position is not None
            model.check(
                "client-receipt-offset",
                position + len(stored) <= token[1],
                "client-receipt",
                f"{inc.label()}: {record_id} is stored at {position}, past its receipt's next offset {token[1]}",
                [started.id],
            )
            placed.append((inc.number or 0, position, record_id))
        for (inc_a, at_a, id_a), (inc_b, at_b, id_b) in itertools.pairwise(placed):
            if inc_a == inc_b:
                model.check(
                    "client-receipt-order",
                    at_a < at_b,
                    "client-order",
                    f"producer {started.params['producer']}: {id_a} was appended before {id_b}, but is "
                    f"stored at {at_a}, after {at_b}",
                    [started.id],
                )


# ---- the reader --------------------------------------------------------------------------------


@register
class ClientRead(_Read):
    kind = "client_read"
    driven = True
    from_server = False
    weight = 3

    def generate(self, ctx: GenContext) -> Planned | None:
        rng = ctx.rng
        name = ctx.view.existing(rng)
        if name is None:
            return None
        offset = pick_offset(ctx, name)
        live = rng.choice(("", "", "long-poll", "sse", "auto"))
        params = {
            "offset": offset,
            "live": live,
            "limit": rng.uniform(0.5, 3.0) if live else 8.0,
            "http2": rng.random() < 0.3,
            "backend": "trio" if rng.random() < 0.3 else "asyncio",
            "seed": rng.getrandbits(32),
        }
        query = {"offset": offset, **({"live": live} if live else {})}
        return Planned(self.kind, name, params, Call("GET", PREFIX + name, query=query, mode="client"))

    def drive(self, history: History, base_url: str, worker: str, planned: Planned) -> Outcome:
        return anyio.run(self._session, history, base_url, worker, planned, backend=planned.params["backend"])

    async def _session(self, history: History, base_url: str, worker: str, planned: Planned) -> Outcome:
        p, name = planned.params, planned.name or ""
        recorder = Recorder(history, worker, name, random.Random(p["seed"]), http2=p["http2"])
        info: dict[str, Any] = {"starts": [], "error": None, "crash": None}
        chunks: list[Chunk] = []
        policy = RetryPolicy(attempts=6, base_delay=0.05, max_delay=0.5)
        try:
            async with Client(
                base_url, transport=recorder, retries=policy, timeout=5.0, live_timeout=8.0
            ) as client:
                with anyio.move_on_after(p["limit"]):
                    try:
                        async with client.stream(name).read(
                            offset=p["offset"], live=p["live"] or False
                        ) as reader:
                            async for batch in reader:
                                if batch.messages is not None:
                                    units = [payloads.canonical(m) for m in batch.messages]
                                    data = b"[" + b",".join(units) + b"]" if units else b""
                                else:
                                    data = batch.data
                                info["starts"].append(batch.offset)
                                chunks.append(
                                    Chunk(
                                        recorder.last_sent,  # its answer came after this
                                        to_text(data),
                                        batch.next_offset,
                                        batch.up_to_date,
                                        batch.closed,
                                        batch.cursor,
                                    )
                                )
                    except StreamError as exc:
                        info["error"] = _error(exc)
        except Exception:
            info["crash"] = traceback.format_exc()[-3000:]
        return _session_outcome(info, chunks)

    def chunks(self, model: Model, started: OpStarted, ended: OpEnded) -> list:
        return ended.outcome.chunks

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        name, outcome = started.name or "", ended.outcome
        info = json.loads(outcome.body or "{}")
        if info.get("crash"):
            model.finding(
                "client-error",
                f"client_read {name}: the reader raised what is not a StreamError: {info['crash'][-600:]}",
                [started.id],
            )
        error = info.get("error") or {}
        if error.get("type") == ConnectionFailed.__name__:
            model.check(
                "client-read-persists",
                model.server_down(started.time, ended.time),
                "client-gave-up",
                f"client_read {name}: the reader gave up while the server was up: {error.get('message')}",
                [started.id],
            )
        chunks, starts = outcome.chunks, info.get("starts", [])
        if not chunks:
            return
        asked = started.params["offset"]
        if parse_token(asked) is not None:
            model.check(
                "client-read-start",
                starts[0] == asked,
                "client-read-gap",
                f"client_read {name}: asked from {asked}, its first batch starts at {starts[0]}",
                [started.id],
            )
        for i in range(1, len(chunks)):
            if not model.check(
                "client-read-contiguous",
                starts[i] == chunks[i - 1].next_offset,
                "client-read-gap",
                f"client_read {name}: batch {i} starts at {starts[i]}, the one before it ended at "
                f"{chunks[i - 1].next_offset}",
                [started.id],
            ):
                return
        # From "now" the reader resolved the tail first: its first batch names where it began.
        offset = starts[0] if parse_token(starts[0]) is not None else asked
        requested = parse_token(offset)
        states = model.states(name, started.time, ended.time)
        self.judge_chunks(model, started, ended, states, requested, offset, chunks)


__all__ = ["BROKEN_REWRITE", "ClientAppend", "ClientProduce", "ClientRead", "Recorder"]
