"""A blocking facade for scripts: the same names as the async API, run on an event loop in a
thread of its own (anyio's blocking portal), so a program without async code can use the client.

    from streamkeep.client.sync import Client

    with Client("http://127.0.0.1:4437") as client:
        stream = client.stream("logs")
        stream.create(content_type="text/plain")
        stream.append("hello")
        for batch in stream.read():
            print(batch.data)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from types import TracebackType
from typing import Any, Self

import anyio
from anyio.from_thread import BlockingPortal

from streamkeep.client.client import Client as AsyncClient
from streamkeep.client.producer import IdempotentProducer
from streamkeep.client.reader import Batch, LiveMode, Reader
from streamkeep.client.stream import AppendResult, StreamInfo
from streamkeep.client.stream import Stream as AsyncStream


class _LoopThread:
    """The event loop the facade runs on, in a daemon thread: anyio's `start_blocking_portal`
    runs it in a non-daemon worker that the interpreter joins at exit, so a script that forgot
    `close()` hung there forever. Here the loop never holds the interpreter up; `Client`'s
    finalizer (run at exit too) still closes it properly, delivering producers' queued appends."""

    def __init__(self, backend: str) -> None:
        self._ready = threading.Event()
        self._portal: BlockingPortal | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._main, args=(backend,), name="streamkeep-client-loop", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    @property
    def portal(self) -> BlockingPortal:
        assert self._portal is not None, "the loop thread did not start"
        return self._portal

    def _main(self, backend: str) -> None:
        try:
            anyio.run(self._serve, backend=backend)
        except BaseException as error:
            self._error = error
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        async with BlockingPortal() as portal:
            self._portal = portal
            self._ready.set()
            await portal.sleep_until_stopped()

    def stop(self) -> None:
        try:
            self.portal.call(self.portal.stop, True)
        except RuntimeError:
            pass  # already stopped
        self._thread.join()


class _Open:
    """What a client has handed out and must end before its loop stops: producers (their queued
    appends are delivered) and readers (their SSE responses are closed). Kept apart from `Client`
    so the finalizer can hold it without holding the client alive."""

    def __init__(self) -> None:
        self.producers: set[Producer] = set()
        self.readers: weakref.WeakSet[Iterator[Batch]] = weakref.WeakSet()


def _shutdown(loop: _LoopThread, client: AsyncClient, open_: _Open) -> None:
    """Ends readers, closes producers, then the client and its loop; raises the first producer
    failure once everything is closed (a close that raised midway would leave the loop running)."""
    failure: BaseException | None = None
    try:
        for reader in list(open_.readers):
            close = getattr(reader, "close", None)
            if close is not None:
                close()
        for producer in list(open_.producers):
            try:
                producer.close()
            except Exception as error:
                failure = failure or error
        loop.portal.call(client.aclose)
    finally:
        loop.stop()
    if failure is not None:
        raise failure


class _ClosedByWith:
    """`with` closes it, whatever ends the block."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class Client(_ClosedByWith):
    """`streamkeep.client.Client`, blocking. Takes the same arguments, plus `backend` ("asyncio"
    or "trio") for the loop in its thread. Close it (or use `with`) to stop that thread; `close()`
    also closes the producers and readers it handed out (so it cannot wait forever on a producer's
    task), may be called twice, and runs at interpreter exit for a client left open."""

    def __init__(self, base_url: str, *, backend: str = "asyncio", **options: Any) -> None:
        self._loop = _LoopThread(backend)
        self._portal = self._loop.portal
        try:
            self._client = self._portal.call(_build, base_url, options)
        except BaseException:
            self._loop.stop()
            raise
        self._open = _Open()
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._client, self._open)

    def stream(self, name_or_path: str, *, content_type: str | None = None) -> Stream:
        return Stream(self._portal, self._client.stream(name_or_path, content_type=content_type), self._open)

    def close(self) -> None:
        """Idempotent: the finalizer runs `_shutdown` once, whoever calls it first."""
        self._finalizer()


async def _build(base_url: str, options: dict[str, Any]) -> AsyncClient:
    """Made inside the loop's thread, where its connection pool will live."""
    return AsyncClient(base_url, **options)


class Stream:
    """`streamkeep.client.Stream`, blocking."""

    def __init__(self, portal: BlockingPortal, stream: AsyncStream, open_: _Open | None = None) -> None:
        self._portal = portal
        self.stream = stream
        self._open_things = open_

    def __repr__(self) -> str:
        return f"sync.{self.stream!r}"

    @property
    def url(self) -> str:
        return self.stream.url

    def create(self, **options: Any) -> StreamInfo:
        return self._portal.call(partial(self.stream.create, **options))

    def head(self) -> StreamInfo:
        return self._portal.call(self.stream.head)

    def exists(self) -> bool:
        return self._portal.call(self.stream.exists)

    def append(self, data: Any, **options: Any) -> AppendResult:
        return self._portal.call(partial(self.stream.append, data, **options))

    def close(self) -> AppendResult:
        return self._portal.call(self.stream.close)

    def delete(self) -> None:
        self._portal.call(self.stream.delete)

    def read(
        self,
        *,
        offset: str = "-1",
        live: LiveMode = False,
        json: bool | None = None,
        cursor: str | None = None,
    ) -> Iterator[Batch]:
        """The batches, each fetched when asked for; leaving the loop closes an SSE response."""
        reader = self.stream.read(offset=offset, live=live, json=json, cursor=cursor)
        batches = _iterate(self._portal, reader)
        if self._open_things is not None:
            self._open_things.readers.add(batches)
        return batches

    def messages(
        self, *, offset: str = "-1", live: LiveMode = False, json: bool | None = None
    ) -> Iterator[Any]:
        for batch in self.read(offset=offset, live=live, json=json):
            if batch.messages is not None:
                yield from batch.messages
            elif batch.data:
                yield batch.data

    def read_all(self, *, offset: str = "-1") -> list[Batch]:
        return list(self.read(offset=offset))

    def producer(self, producer_id: str, **options: Any) -> Producer:
        producer = Producer(
            self._portal, self._portal.call(_make_producer, self.stream, producer_id, options)
        )
        if self._open_things is not None:
            registry = self._open_things.producers
            registry.add(producer)
            producer._on_close = partial(registry.discard, producer)
        return producer


def _iterate(portal: BlockingPortal, reader: Reader) -> Iterator[Batch]:
    try:
        while True:
            try:
                yield portal.call(reader.__anext__)
            except StopAsyncIteration:
                return
    finally:
        try:
            portal.call(reader.aclose)
        except RuntimeError:
            pass  # the client (and its loop) closed first: the response went with them


async def _make_producer(
    stream: AsyncStream, producer_id: str, options: dict[str, Any]
) -> IdempotentProducer:
    return IdempotentProducer(stream, producer_id, **options)


class Receipt:
    """What a blocking producer's `append` returns: `wait()` blocks until the server has it."""

    def __init__(self, portal: BlockingPortal, receipt: Awaitable[Any]) -> None:
        self._portal = portal
        self._receipt = receipt

    def wait(self) -> Any:
        return self._portal.call(_await, self._receipt)


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


class Producer(_ClosedByWith):
    """`streamkeep.client.producer.IdempotentProducer`, blocking and already entered (its sender
    runs on the client's loop until `close`): `append` enqueues and returns a `Receipt` at once;
    `flush` and `close` block until the server answered everything queued."""

    def __init__(self, portal: BlockingPortal, producer: IdempotentProducer) -> None:
        self._portal = portal
        # The producer's task group must be entered and left by one task: the portal keeps one
        # task for it, from here until `close`.
        self._entered = portal.wrap_async_context_manager(producer)
        self.producer = self._entered.__enter__()
        self._open = True
        # Set by the client that made it: forgets it once closed.
        self._on_close: Callable[[], None] | None = None

    def append(self, data: Any) -> Receipt:
        """Enqueues `data`; blocks while the producer holds `max_buffered_bytes` unwritten (the
        natural backpressure for a blocking caller, where the async `append` raises ProducerFull)."""
        return Receipt(self._portal, self._portal.call(_enqueue, self.producer, data))

    def flush(self) -> None:
        self._portal.call(self.producer.flush)

    def close(self, *, close_stream: bool = False) -> None:
        """Delivers what is queued (closing the stream too with `close_stream`), then stops."""
        if not self._open:
            return
        self._open = False
        if self._on_close is not None:
            self._on_close()
        try:
            self._portal.call(partial(self.producer.close, close_stream=close_stream))
        except BaseException as error:
            self._entered.__exit__(type(error), error, error.__traceback__)
            raise
        self._entered.__exit__(None, None, None)


async def _enqueue(producer: IdempotentProducer, data: Any) -> Awaitable[Any]:
    """Runs `send` in the loop's thread (waiting for room); its receipt is awaited later, by
    `Receipt.wait`."""
    receipt: Awaitable[Any] = await producer.send(data)
    return receipt


__all__ = ["Client", "Producer", "Receipt", "Stream"]
