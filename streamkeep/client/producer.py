"""`IdempotentProducer`: exactly-once appends through retries, batched and pipelined (PROTOCOL.md §5.2.1).

    async with stream.producer("orders-1", epoch=3, linger=0.01) as producer:
        for order in orders:
            producer.append(order)          # returns at once; `await` it for the outcome
        await producer.flush()              # every append so far written, or the first error

Why it works the way it does:

- The server deduplicates by `(Producer-Id, Producer-Epoch, Producer-Seq)` alone: a seq it has
  already seen is answered 204 whatever the body. So a batch's bytes are frozen the first time it
  is sent and every retry repeats the same seq with the same bytes; re-batching on a retry would
  drop, silently, whatever the first try did not carry.
- The server accepts only seq = last + 1 (a jump is 409 with `Producer-Expected-Seq`), so the
  stream holds batches in seq order, and seqs are given out in append order. With several batches
  in flight (`max_in_flight`), one can overtake another on the way (other connections, other
  HTTP/2 streams) and be refused with 409: it waits until every batch before it is written, then
  goes again with its seq and bytes unchanged. A later batch can never be written before an
  earlier one, so a success at seq N also proves every earlier seq of the epoch was written.
- The first batch of an epoch goes alone: until the server has taken one seq of the epoch, a
  second seq arriving first would be refused for good (400: a new epoch starts at seq 0), and with
  `auto_claim` the epoch itself is not known yet.
- 403 with `Producer-Epoch` means a newer instance owns the producer id. Without `auto_claim` that
  is final (`StaleEpoch`); with it, the producer takes the epoch after the server's, waits for every
  request of the old epoch to be answered (one of them may still be written, and order must hold),
  and sends everything unwritten again from seq 0. Writes are exactly-once within an epoch and
  at-least-once across a claim: a batch whose answer was lost just before the fence cannot be
  asked about any more (every old-epoch request is now refused), so it is sent again, unless a
  later seq of its epoch was written (see below), which proves it is there.
- A batch refused for a cause a retry cannot change (400, 404, 409 closed, 410, 413, a fence
  without `auto_claim`, retries spent) fails, and so does every batch after it: they could only be
  written by skipping its seq, which the server refuses, and the producer does not move to a new
  epoch on its own (the caller's restart scheme owns epochs). `append` then raises the error too.
  Retries spent on lost answers (`ConnectionFailed`, `Unavailable`) leave the outcome unknown: the
  batch may be in the stream. Unless a later seq of the epoch was written, which proves it is, and
  then it is reported written.
- A 204 to a seq none of whose tries can have been written (the first try, or only tries refused
  before writing: 429, 409) means the (id, epoch, seq) was used before this instance sent it.
  With `auto_claim` that is another writer holding the epoch (a stateless restart at the same
  epoch, or a claim race where someone took the epoch just claimed): this batch's bytes are not in
  the stream, so the producer claims the next epoch and sends it again (checked again at the new
  epoch). Without `auto_claim` it is a restarted producer replaying what it wrote before with the
  same epoch and seqs (exactly-once across a crash, which the caller's restart scheme relies on):
  it counts as written, `duplicate=True`. A producer without `auto_claim` that does not replay the
  same items must take a higher epoch than any earlier instance, or its items are dropped as
  duplicates.
- 429, 500, 502, 503, 504 and broken or refused connections are retried, after the server's
  `Retry-After` when it gives one, else with jittered exponential backoff (the client's
  `RetryPolicy` unless `retry=` is given), for `retry_for` seconds (default 60) from a batch's
  first try and at least `retry.attempts` times: a failure stops the producer for good, so it
  must outlast a server restart or a failover, not just a blip.

Runs under trio and asyncio (anyio only). It needs `async with` (or `__aenter__`/`__aexit__`): the
background sender lives in a task group for the lifetime of that block.
"""

from __future__ import annotations

import dataclasses
import json as jsonlib
import math
from collections import deque
from collections.abc import Generator
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.abc
import httpx

from streamkeep.client.errors import SequenceConflict, StaleEpoch, StreamError, Unavailable
from streamkeep.client.http import RetryPolicy
from streamkeep.client.reader import is_json_type
from streamkeep.client.stream import AppendResult, Stream

# Statuses that say the request was not done (or may be done again safely, the seq protects it).
# 507: the server's disk is full; appends resume once space is freed, and the seq makes a repeat safe.
RETRY_STATUSES = frozenset((429, 500, 502, 503, 504, 507))
# Over HTTP/2, request bodies in flight together stay within the default flow-control window:
# httpcore stalls concurrent uploads that wait for a window (each waits on the connection's reads
# under a lock another holds) until the read timeout, measured 10 s for 20,000 appends in 32 KiB
# batches that took 0.3 s over HTTP/1.1. A batch larger than this goes alone.
H2_BYTES_IN_FLIGHT = 60 * 1024
# Claims in a row without a single write in between: two auto-claiming producers sharing an id
# would otherwise fence each other forever.
MAX_CLAIMS = 5
_NO_RETRY = RetryPolicy(attempts=0)
# RetryPolicy.wait doubles per attempt: past this the delay is max_delay anyway, and a time budget
# can run to thousands of attempts (2**1024 overflows a float).
_MAX_BACKOFF_EXPONENT = 32

# A batch's states. READY: sealed, waiting to be sent (no seq yet in the current epoch).
# SENDING: a request (or its retries) is out. BLOCKED: answered 409 because an earlier seq had not
# arrived; sent again once every batch before it is written. DONE and FAILED are final.
_READY, _SENDING, _BLOCKED, _DONE, _FAILED = range(5)


class ProducerClosed(StreamError):
    """The producer no longer takes appends (closed), or stopped before a batch was answered
    (the block around it was left by an exception): that batch may or may not be written."""


class ProducerFull(StreamError):
    """`append` would hold more than `max_buffered_bytes` of unwritten appends: the server (or the
    network) is slower than the appends. `await producer.send(data)` waits for room instead."""


class _Superseded:
    """The outcome of a batch whose epoch was left (auto-claim) while it waited to be retried."""


_SUPERSEDED = _Superseded()


class _Batch:
    """Appends that travel in one request with one seq; every append in it shares its receipt."""

    __slots__ = (
        "after_written",
        "body",
        "close",
        "done",
        "epoch",
        "error",
        "items",
        "maybe_written",
        "receipt",
        "result",
        "seq",
        "size",
        "state",
    )

    def __init__(self, size: int) -> None:
        self.items: list[bytes] = []
        self.size = size
        self.body = b""
        self.close = False
        self.epoch = -1
        self.seq: int | None = None
        self.state = _READY
        # Its request went out after every earlier batch was known written: a 409 gap is then
        # the server's present state, not an answer that overtook an earlier batch's success.
        self.after_written = False
        # A try at the current (epoch, seq) may have been written although no answer said so (a
        # lost answer, a 5xx): a 204 is then our own try. Without it, a 204 names another writer.
        self.maybe_written = False
        self.result: AppendResult | None = None
        self.error: StreamError | None = None
        self.done = anyio.Event()
        self.receipt = Receipt(self)


class Receipt:
    """The outcome of an append: `await receipt` gives the `AppendResult` of the batch the append
    travelled in, or raises its error. Appends of one batch share one receipt.

    `next_offset` is the tail the server answered: right after the batch when it was written by
    this request, at or after it when `duplicate` (an earlier try was written and its answer lost;
    or, without `auto_claim`, an earlier instance with the same id and epoch had already used the
    seq: a replay)."""

    __slots__ = ("_batch",)

    def __init__(self, batch: _Batch) -> None:
        self._batch = batch

    def __await__(self) -> Generator[Any, None, AppendResult]:
        return self.wait().__await__()

    async def wait(self) -> AppendResult:
        batch = self._batch
        await batch.done.wait()
        if batch.error is not None:
            raise batch.error
        assert batch.result is not None
        return batch.result

    @property
    def done(self) -> bool:
        """Whether the outcome is known (written, or failed)."""
        return self._batch.done.is_set()

    @property
    def seq(self) -> int | None:
        """The batch's `Producer-Seq` (None until first sent; a claim gives it a new one)."""
        return self._batch.seq


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _retryable(error: StreamError) -> bool:
    """Refusals a repeat of the same seq may get past, and connections that failed (status 0)."""
    return error.status == 0 or error.status in RETRY_STATUSES


class IdempotentProducer:
    """Batched, pipelined, exactly-once appends to one stream under one producer id.

    `epoch`: this instance's epoch; a restarted producer must use a higher one than its last
    (or `auto_claim=True`, which takes the server's epoch + 1 when fenced, for producers that keep
    no state). `linger`: seconds an append may wait for others to share its batch.
    `max_batch_bytes`: a batch is sent once this full (a single larger append goes alone).
    `max_in_flight`: batches sent without waiting for the answer to the earlier ones.
    `max_buffered_bytes`: unwritten appends held at most (default 64 MiB); past it `append`
    raises `ProducerFull` and `await send(data)` waits for room.
    `start_seq`: the first seq, for a producer that resumes an epoch whose last seq it persisted.
    `content_type`: the stream's, asked with HEAD at start when neither given nor known.
    `retry`: the backoff between tries of a batch (the client's policy by default). `retry_for`:
    seconds a batch's send is retried (429, 5xx, broken connections) from its first try before it
    fails, and with it the producer; it fails only once `retry.attempts` are spent too.

    JSON streams: every append is exactly one message, a batch is a JSON array of them (the
    server flattens one level, §9.1.2). Bytes and text are taken as one already-encoded JSON value
    (checked at `append` as the server checks it: UTF-8 without a byte order mark, no NaN or
    Infinity); anything else is encoded with `json.dumps` (NaN and Infinity refused). Other streams have no
    message boundaries (§9): a batch is the appends' bytes concatenated, text as UTF-8, so frame
    records yourself (a newline, a length prefix) if readers must split them.
    """

    def __init__(
        self,
        stream: Stream,
        producer_id: str,
        *,
        epoch: int = 0,
        auto_claim: bool = False,
        linger: float = 0.005,
        max_batch_bytes: int = 1024 * 1024,
        max_in_flight: int = 5,
        start_seq: int = 0,
        content_type: str | None = None,
        retry: RetryPolicy | None = None,
        retry_for: float = 60.0,
        max_buffered_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        if not producer_id:
            raise ValueError("producer_id must not be empty")
        if epoch < 0 or start_seq < 0:
            raise ValueError("epoch and start_seq must be >= 0")
        if max_buffered_bytes <= 0:
            raise ValueError("max_buffered_bytes must be > 0")
        if retry_for < 0:
            raise ValueError("retry_for must be >= 0")
        if linger < 0 or max_batch_bytes <= 0 or max_in_flight <= 0:
            raise ValueError("linger must be >= 0, max_batch_bytes and max_in_flight > 0")
        self.stream = stream
        self.producer_id = producer_id
        self.auto_claim = auto_claim
        self.linger = linger
        self.max_batch_bytes = max_batch_bytes
        self.max_in_flight = max_in_flight
        self.retry = retry or stream.transport.retry
        self.retry_for = retry_for
        self.max_buffered_bytes = max_buffered_bytes
        # Bytes of appends not yet written or failed (open, queued, in flight): bounded, or a
        # producer faster than its server holds everything in memory until it runs out.
        self._buffered = 0
        self._content_type = content_type or stream.content_type
        self._json = False
        self._epoch = epoch
        self._next_seq = start_seq
        # The server has taken a seq of the current epoch from us: pipelining may start.
        self._epoch_confirmed = False
        self._claims = 0
        self._open: _Batch | None = None  # the batch appends go into now
        self._open_since = 0.0
        self._window: deque[_Batch] = deque()  # sealed batches not yet final, in append order
        self._in_flight = 0
        self._bytes_in_flight = 0  # request bodies out now (bounded over HTTP/2, see H2_BYTES_IN_FLIGHT)
        self._http2 = stream.transport.http2
        self._in_flight_current = 0  # of those, requests of the current epoch
        self._flush_wanted = False
        self._failure: StreamError | None = None  # the error that stopped the producer
        self._unreported: StreamError | None = None  # the first failure `flush` has not raised yet
        self._accepting = False
        self._stopping = False
        self._closed = False
        self._task_group: anyio.abc.TaskGroup | None = None
        # Set to make the sender look again (events need a running event loop: made at entry).
        self._wake: anyio.Event
        # Set (and replaced) whenever buffered bytes are freed: `send` waits on it.
        self._room: anyio.Event

    @property
    def epoch(self) -> int:
        """The epoch requests are sent with now (an auto-claim raises it)."""
        return self._epoch

    @property
    def next_seq(self) -> int:
        """The seq the next batch sent in the current epoch gets."""
        return self._next_seq

    @property
    def failure(self) -> StreamError | None:
        """The error that stopped the producer, if one did."""
        return self._failure

    async def __aenter__(self) -> Self:
        if self._task_group is not None or self._closed:
            raise RuntimeError("an IdempotentProducer is entered once")
        if self._content_type is None:
            await self.stream.head()
            self._content_type = self.stream.content_type or "application/octet-stream"
        self._json = is_json_type(self._content_type)
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        self._wake = anyio.Event()
        self._room = anyio.Event()
        self._accepting = True
        task_group.start_soon(self._run)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        task_group = self._task_group
        assert task_group is not None, "__aexit__ without __aenter__"
        # The block's own exception is not handed to the task group, which would wrap it in an
        # exception group: it propagates as it is, after the sender is cancelled.
        if exc is not None:
            self._abandon()
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)
            return
        try:
            await self.close()
        except BaseException:
            self._abandon()
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)
            raise
        await task_group.__aexit__(None, None, None)

    # Appending ------------------------------------------------------------------------------

    def append(self, data: Any) -> Receipt:
        """Queues `data` and returns its receipt at once (see the class for how data is encoded).

        Raises the producer's failure if one stopped it, `ProducerClosed` after `close`,
        `ProducerFull` when it would hold more than `max_buffered_bytes` unwritten (one append
        larger than that is taken when nothing else is held), and `ValueError`/`TypeError` for
        data the stream cannot take (invalid JSON text, a value `json.dumps` refuses, a
        non-bytes value for a non-JSON stream)."""
        if self._failure is not None:
            raise self._failure
        if not self._accepting:
            raise ProducerClosed(
                "the producer is closed" if self._closed else "use the producer in `async with`"
            )
        item = self._encode(data)
        extra = len(item) + 1 if self._json else len(item)  # a JSON batch adds a comma per item
        if self._buffered and self._buffered + extra > self.max_buffered_bytes:
            raise ProducerFull(
                f"{self._buffered} bytes of appends are unwritten (max_buffered_bytes="
                f"{self.max_buffered_bytes}): `await send(...)` waits for room"
            )
        batch = self._open
        if batch is None:
            batch = self._start_batch()
        elif batch.items and batch.size + extra > self.max_batch_bytes:
            self._seal()
            batch = self._start_batch()
        batch.items.append(item)
        batch.size += extra
        self._buffered += extra
        if batch.size >= self.max_batch_bytes:
            self._seal()
        return batch.receipt

    async def send(self, data: Any) -> Receipt:
        """`append` that waits while the producer holds `max_buffered_bytes` unwritten, instead
        of raising `ProducerFull`: backpressure for a producer that may outrun its server.
        Returns the receipt once the data is queued (await it for the outcome)."""
        while True:
            room = self._room
            try:
                return self.append(data)
            except ProducerFull:
                await room.wait()

    def _encode(self, data: Any) -> bytes:
        if self._json:
            # One item the server refuses fails its whole batch and stops the producer, so
            # everything the server's strict parser refuses is refused here, at `append`.
            if isinstance(data, bytes | bytearray | memoryview | str):
                raw = bytes(data) if not isinstance(data, str) else data.encode("utf-8")
                # Strictly UTF-8 without a BOM (json.loads would take UTF-16/32 and skip a BOM).
                text = raw.decode("utf-8")
                if text.startswith("\ufeff"):
                    raise ValueError("JSON text must not start with a byte order mark")
                jsonlib.loads(text, parse_constant=_refuse_constant)
                return raw
            # NaN and Infinity are Python's extension, not JSON (RFC 8259): the server refuses them.
            return jsonlib.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
                "utf-8"
            )
        if isinstance(data, bytearray | memoryview):
            data = bytes(data)
        elif isinstance(data, str):
            data = data.encode("utf-8")
        if isinstance(data, bytes):
            if not data:
                raise ValueError("an append needs at least one byte")  # the server refuses an empty one
            return data
        raise TypeError(f"a {self._content_type} stream takes bytes or str, not {type(data).__name__}")

    def _start_batch(self) -> _Batch:
        batch = _Batch(1 if self._json else 0)  # "[" (the "]" is paid for by the last comma)
        self._buffered += batch.size
        self._open = batch
        self._open_since = anyio.current_time()
        self._wake.set()  # the sender starts the linger clock
        return batch

    def _seal(self) -> None:
        """Freezes the open batch's bytes: from now on they are what every try of it sends."""
        batch = self._open
        if batch is None:
            return
        self._open = None
        if self._json:
            batch.body = b"[" + b",".join(batch.items) + b"]" if batch.items else b""
        else:
            batch.body = b"".join(batch.items)
        batch.items = []
        self._window.append(batch)
        self._wake.set()

    async def flush(self) -> None:
        """Sends what is queued now and waits until every batch appended so far is written or
        failed; raises the first failure since the previous `flush` (every receipt of a failed
        batch raises too)."""
        if self._task_group is None and not self._closed:
            raise ProducerClosed("use the producer in `async with`")
        waiting = list(self._window)
        if self._open is not None:
            waiting.append(self._open)
            self._flush_wanted = True
            self._wake.set()
        for batch in waiting:
            await batch.done.wait()
        if self._unreported is not None:
            error, self._unreported = self._unreported, None
            raise error

    async def close(self, close_stream: bool = False) -> AppendResult | None:
        """Stops taking appends, delivers what is queued (raising as `flush` does), and with
        `close_stream` closes the stream too, atomically with the last batch when one is still
        queued, else with an empty request: both carry the producer's headers, so a retried close
        is answered as the duplicate it is. Returns the closing request's result (its
        `next_offset` is the stream's final offset), None without `close_stream`. Leaving the
        `async with` block closes the producer (without closing the stream); a second `close`
        does nothing."""
        if self._closed:
            return None
        if self._task_group is None:
            raise ProducerClosed("use the producer in `async with`")
        self._accepting = False
        self._closed = True
        last: _Batch | None = None
        if close_stream and self._failure is None:
            last = self._open or self._start_batch()
            last.close = True
            self._seal()
        try:
            await self.flush()
        finally:
            self._stopping = True
            self._wake.set()
        return None if last is None else await last.receipt

    def _abandon(self) -> None:
        """Leaving on an exception: fails what was not answered, so no receipt waits forever."""
        self._accepting = False
        self._closed = True
        self._stopping = True
        error = ProducerClosed("the producer stopped before this batch was answered")
        if self._open is not None:
            self._seal()
        for batch in self._window:
            if batch.state not in (_DONE, _FAILED):
                self._finish(batch, error=error)
        self._window.clear()

    # Sending --------------------------------------------------------------------------------

    async def _run(self) -> None:
        """The one task that decides what to send next; request tasks report back to it."""
        while True:
            self._wake = anyio.Event()
            delay = self._pump()
            if self._stopping and self._open is None and not self._window:
                return
            with anyio.move_on_after(delay):
                await self._wake.wait()

    def _pump(self) -> float:
        """Seals the open batch when its linger is over (or a flush wants it), then starts every
        request that may go now. Returns how long to sleep if nothing else happens."""
        delay = math.inf
        if self._open is not None:
            due = self._open_since + self.linger
            now = anyio.current_time()
            if self._flush_wanted or self._stopping or now >= due:
                self._seal()
            else:
                delay = due - now
        self._flush_wanted = False
        if self._failure is not None:
            for batch in self._window:
                if batch.state in (_READY, _BLOCKED):
                    self._finish(batch, error=self._failure)
        while self._window and self._window[0].state in (_DONE, _FAILED):
            self._window.popleft()
        if self._failure is not None or self._in_flight > self._in_flight_current:
            return delay  # nothing new goes out while requests of a left epoch are unanswered
        # A batch refused with 409 goes again once nothing before it is still out from an earlier
        # pass: all of a run of them together (re-sent in order, pipelined), nothing behind them
        # meanwhile (the server is waiting for an earlier seq; more would only earn more 409s).
        resend = True
        written = True  # every batch before this one is known written
        for batch in self._window:
            state = batch.state
            if state == _DONE:
                continue
            if state == _SENDING:
                resend = written = False
                continue
            if self._in_flight >= self.max_in_flight or (not self._epoch_confirmed and self._in_flight > 0):
                break
            if (
                self._http2
                and self._in_flight
                and self._bytes_in_flight + len(batch.body) > H2_BYTES_IN_FLIGHT
            ):
                break
            if state == _BLOCKED:
                if not resend:
                    break
            else:
                batch.epoch = self._epoch
                batch.seq = self._next_seq
                self._next_seq += 1
            batch.after_written = written
            written = False
            self._start(batch)
        return delay

    def _start(self, batch: _Batch) -> None:
        assert self._task_group is not None
        batch.state = _SENDING
        self._in_flight += 1
        self._bytes_in_flight += len(batch.body)
        self._in_flight_current += 1
        self._task_group.start_soon(self._send, batch)

    async def _send(self, batch: _Batch) -> None:
        epoch = batch.epoch
        sent_bytes = len(batch.body)
        outcome = await self._deliver(batch)
        self._in_flight -= 1
        self._bytes_in_flight -= sent_bytes
        if epoch == self._epoch:
            self._in_flight_current -= 1
        self._settle(batch, outcome)
        self._wake.set()

    async def _deliver(self, batch: _Batch) -> httpx.Response | StreamError | _Superseded:
        """One batch's request, repeated (same seq, same bytes) while the answer allows."""
        headers = {
            "Producer-Id": self.producer_id,
            "Producer-Epoch": str(batch.epoch),
            "Producer-Seq": str(batch.seq),
        }
        if batch.body:
            assert self._content_type is not None
            headers["Content-Type"] = self._content_type
        if batch.close:
            headers["Stream-Closed"] = "true"
        stream = self.stream
        attempt = 0
        give_up_at = anyio.current_time() + self.retry_for
        while True:
            try:
                return await stream.transport.request(
                    "POST",
                    stream.path,
                    params=stream.params or None,
                    headers=headers,
                    content=batch.body,
                    idempotent=True,
                    retry=_NO_RETRY,
                )
            except StreamError as error:
                # 429 and a 409 gap are refusals before writing; anything else retried may not be.
                if error.status != 429 and _retryable(error):
                    batch.maybe_written = True
                if not _retryable(error):
                    return error
                # Both budgets must be spent: the attempt count alone (5 tries, 50 ms apart at
                # first) is over in about a second, and a server restart or failover that takes
                # longer would stop the producer for good, every later batch with it.
                if attempt >= self.retry.attempts and anyio.current_time() >= give_up_at:
                    return error
                retry_after = error.retry_after if isinstance(error, Unavailable) else None
                wait = self.retry.wait(min(attempt, _MAX_BACKOFF_EXPONENT), retry_after)
            attempt += 1
            await anyio.sleep(wait)
            if batch.epoch != self._epoch:
                return _SUPERSEDED

    def _settle(self, batch: _Batch, outcome: httpx.Response | StreamError | _Superseded) -> None:
        """What an answer means for its batch, the batches after it, and the producer."""
        if isinstance(outcome, httpx.Response):
            result = AppendResult.from_response(outcome, producer=True)
            if result.duplicate and batch.body and not batch.maybe_written and self.auto_claim:
                # No try of ours can have written this (epoch, seq): another instance holds the
                # epoch (an auto-claiming restart at the same epoch, or a claim race), and this
                # batch is not in the stream. Counting it written would lose it: claim past it.
                self._foreign_duplicate(batch)
                return
            if not batch.body:  # a close-only request is answered 204 when it did close
                result = dataclasses.replace(result, duplicate=False)
            self._written(batch, result)
            return
        proof = self._written_after(batch)
        if proof is not None:
            # Whatever this answer says (a lost answer, a fence, retries spent), a later seq of the
            # same epoch was written, which the server allows only once this one is there.
            self._written(batch, dataclasses.replace(proof, duplicate=True))
            return
        current = batch.epoch == self._epoch
        if isinstance(outcome, _Superseded):
            self._requeue(batch)
            return
        error = outcome
        if self._failure is not None:
            self._finish(batch, error=self._failure)
            return
        if isinstance(error, StaleEpoch):
            if not current:
                self._requeue(batch)  # fenced by the claim this producer already made
            elif self.auto_claim and self._claims < MAX_CLAIMS:
                self._claim(error.current_epoch)
                self._requeue(batch)
            else:
                self._fail(batch, error)
            return
        if (
            isinstance(error, SequenceConflict)
            and error.expected_seq is not None
            and batch.seq is not None
            and error.expected_seq < batch.seq
        ):
            if not current:
                self._requeue(batch)  # not written (its predecessor was not): goes in the new epoch
            elif batch.after_written:
                self._fail(batch, error)  # a gap nothing of ours will fill
            else:
                # It overtook an earlier batch on the way (or its answer overtook the earlier
                # one's success): sent again once the batches before it are written.
                batch.state = _BLOCKED
            return
        self._fail(batch, error)

    def _foreign_duplicate(self, batch: _Batch) -> None:
        current = batch.epoch == self._epoch
        self._requeue(batch)
        # Never proven written by a later seq of that epoch: the other writer's seqs prove nothing.
        batch.epoch = -1
        if not current:
            return  # this producer has already moved past that epoch
        if self._claims >= MAX_CLAIMS:
            self._fail(
                batch,
                StaleEpoch(
                    f"producer {self.producer_id!r}: epoch {self._epoch} is used by another writer",
                    status=403,
                ),
            )
            return
        self._claim(None)

    def _written(self, batch: _Batch, result: AppendResult) -> None:
        if batch.epoch == self._epoch:
            self._epoch_confirmed = True
            self._claims = 0
        self._finish(batch, result=result)
        # The batches before it sent in the same epoch and waiting to go again (their answers
        # lost, then fenced; or refused with 409 while an earlier try was still on its way) are
        # written too: seqs are taken in order. Without this a claim would send them twice.
        proven = dataclasses.replace(result, duplicate=True)
        for earlier in self._window:
            if earlier is batch:
                break
            if earlier.epoch == batch.epoch and earlier.state in (_READY, _BLOCKED):
                self._finish(earlier, result=proven)

    def _requeue(self, batch: _Batch) -> None:
        batch.state = _READY
        batch.seq = None
        batch.maybe_written = False

    def _claim(self, server_epoch: int | None) -> None:
        """Auto-claim: the next epoch, from seq 0; every unanswered batch goes again in it."""
        self._claims += 1
        self._epoch = max(self._epoch, server_epoch if server_epoch is not None else self._epoch) + 1
        self._next_seq = 0
        self._epoch_confirmed = False
        self._in_flight_current = 0
        for batch in self._window:
            if batch.state in (_READY, _BLOCKED):
                self._requeue(batch)

    def _written_after(self, batch: _Batch) -> AppendResult | None:
        seen = False
        for other in self._window:
            if other is batch:
                seen = True
            elif seen and other.state == _DONE and other.epoch == batch.epoch and other.result is not None:
                return other.result
        return None

    def _fail(self, batch: _Batch, error: StreamError) -> None:
        """A final refusal: this batch fails, the producer stops, and so does every later batch."""
        self._failure = error
        self._accepting = False
        self._finish(batch, error=error)
        if self._open is not None:
            self._seal()

    def _finish(
        self, batch: _Batch, *, result: AppendResult | None = None, error: StreamError | None = None
    ) -> None:
        if batch.state not in (_DONE, _FAILED):
            self._buffered -= batch.size
            self._room.set()
            self._room = anyio.Event()
        # The receipt keeps the batch alive as long as the caller keeps it: not its bytes.
        batch.body = b""
        batch.result = result
        batch.error = error
        batch.state = _DONE if error is None else _FAILED
        if error is not None and self._unreported is None:
            self._unreported = error
        batch.done.set()


__all__ = ["IdempotentProducer", "ProducerClosed", "ProducerFull", "Receipt"]
