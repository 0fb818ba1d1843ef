"""The client conformance adapter for `streamkeep.client`.

Upstream's runner (packages/client-conformance-tests/src/runner.ts) spawns this program and speaks
JSON lines with it (src/protocol.ts): one command on stdin, one result on stdout, in turn. Every
command is carried out with `streamkeep.client` (never with HTTP of its own), so a case that fails
here is a client bug, a gap in this file, or a server that answers otherwise: the results file
says which.

The event loop is asyncio, or trio with STREAMKEEP_ADAPTER_BACKEND=trio (the client runs on both).
Diagnostics go to stderr, which the runner prints with a `[client stderr]` prefix;
STREAMKEEP_ADAPTER_TRACE=1 adds the traceback of every failed command.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
import traceback
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread

from streamkeep import __version__
from streamkeep.client import (
    BadRequest,
    Client,
    Conflict,
    ConnectionFailed,
    ProtocolError,
    SequenceConflict,
    StaleEpoch,
    StreamClosed,
    StreamError,
    StreamExists,
    StreamNotFound,
)
from streamkeep.client.producer import IdempotentProducer
from streamkeep.client.reader import LiveMode
from streamkeep.client.stream import Stream

OCTET_STREAM = "application/octet-stream"
DEFAULT_READ_TIMEOUT_MS = 5000  # upstream's adapters' default
DEFAULT_MAX_CHUNKS = 100
LIVE_MODES: dict[object, LiveMode] = {True: "auto", "long-poll": "long-poll", "sse": "sse"}
# Our option names beside the protocol's, so a refusal names the option the runner asked about.
OPTION_NAMES = {"max_batch_bytes": "maxBatchBytes", "producer_id": "producerId"}


def log(message: str) -> None:
    print(f"[streamkeep adapter] {message}", file=sys.stderr, flush=True)


def json_text(value: Any) -> str:
    """As JavaScript's JSON.stringify writes it (compact, non-ASCII as is): the runner compares text."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class DynamicValue:
    """A header or parameter value the runner asked to be computed per command."""

    def __init__(self, kind: str, initial: str | None = None) -> None:
        self.kind = kind
        self.counter = 0
        self.token = initial

    def next(self) -> str:
        if self.kind == "counter":
            self.counter += 1
            return str(self.counter)
        if self.kind == "timestamp":
            return str(int(time.time() * 1000))
        return self.token or ""


class HostedProducer:
    """A producer kept open across commands: its `async with` lives in a task of its own (so
    producers can be closed in any order), which leaves the block when `stop` is called."""

    def __init__(self, producer: IdempotentProducer) -> None:
        self.producer = producer
        self.leave = anyio.Event()
        self.left = anyio.Event()

    @classmethod
    async def start(cls, task_group: anyio.abc.TaskGroup, producer: IdempotentProducer) -> HostedProducer:
        hosted = cls(producer)
        await task_group.start(hosted.host)
        return hosted

    async def host(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with self.producer:
                task_status.started()
                await self.leave.wait()
        except Exception as exc:  # the commands that used it reported it already
            log(f"producer {self.producer.producer_id} ended with {type(exc).__name__}: {exc}")
        finally:
            self.left.set()

    async def stop(self) -> None:
        self.leave.set()
        await self.left.wait()


class Adapter:
    def __init__(self, task_group: anyio.abc.TaskGroup) -> None:
        self.task_group = task_group
        self.client: Client | None = None
        self.content_types: dict[str, str] = {}
        self.producers: dict[tuple[str, str, int], HostedProducer] = {}
        self.dynamic_headers: dict[str, DynamicValue] = {}
        self.dynamic_params: dict[str, DynamicValue] = {}
        # What the client's header function answers: the command's own headers and this command's
        # dynamic values. The client calls it before every request it sends.
        self.current_headers: dict[str, str] = {}

    def headers_now(self) -> dict[str, str]:
        return dict(self.current_headers)

    def begin(self, command: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
        """Sets the headers this command's requests carry; returns the dynamic headers and params
        it resolved (reported back as headersSent/paramsSent, as upstream's adapters do)."""
        sent = {name: value.next() for name, value in self.dynamic_headers.items()}
        params = {name: value.next() for name, value in self.dynamic_params.items()}
        self.current_headers = {**sent, **(command.get("headers") or {})}
        return sent, params

    def stream(self, path: str) -> Stream:
        """A handle on `path`, told the content type this adapter knows for it (from create, head
        or connect), as upstream's adapters keep one; the client asks the server when unknown."""
        if self.client is None:
            raise RuntimeError("init was not sent")
        return self.client.stream(path, content_type=self.content_types.get(path))

    async def close_client(self) -> None:
        for hosted in list(self.producers.values()):
            await hosted.stop()
        self.producers.clear()
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    # -- commands ------------------------------------------------------------------------------

    async def init(self, command: dict[str, Any]) -> dict[str, Any]:
        await self.close_client()
        self.content_types.clear()
        self.dynamic_headers.clear()
        self.dynamic_params.clear()
        self.client = Client(command["serverUrl"], headers=self.headers_now)
        return {
            "type": "init",
            "success": True,
            "clientName": "streamkeep.client",
            "clientVersion": __version__,
            "features": {
                "batching": True,
                "sse": True,
                "longPoll": True,
                "auto": True,
                "streaming": True,
                "dynamicHeaders": True,
                "strictZeroValidation": True,
            },
        }

    async def create(self, command: dict[str, Any]) -> dict[str, Any]:
        path = command["path"]
        content_type = command.get("contentType") or OCTET_STREAM
        data = command.get("data")
        stream = self.stream(path)
        info = await stream.create(
            content_type=content_type,
            ttl=command.get("ttlSeconds"),
            expires_at=command.get("expiresAt"),
            closed=bool(command.get("closed")),
            body=None if data is None else data.encode(),
        )
        self.content_types[path] = content_type
        offset = info.next_offset or (await stream.head()).next_offset
        return {"type": "create", "success": True, "status": 201 if info.created else 200, "offset": offset}

    async def connect(self, command: dict[str, Any]) -> dict[str, Any]:
        path = command["path"]
        info = await self.stream(path).head()
        if info.content_type:
            self.content_types[path] = info.content_type
        return {"type": "connect", "success": True, "status": 200, "offset": info.next_offset}

    async def append(
        self, command: dict[str, Any], headers_sent: dict[str, str], params: dict[str, str]
    ) -> dict[str, Any]:
        path = command["path"]
        data = base64.b64decode(command["data"]) if command.get("binary") else command["data"].encode()
        seq = command.get("seq")
        result = await self.stream(path).append(
            data,
            content_type=self.content_types.get(path, OCTET_STREAM),
            seq=None if seq is None else str(seq),
        )
        answer: dict[str, Any] = {
            "type": "append",
            "success": True,
            "status": 200,
            "offset": result.next_offset,
        }
        return with_sent(answer, headers_sent, params)

    async def head(self, command: dict[str, Any]) -> dict[str, Any]:
        path = command["path"]
        info = await self.stream(path).head()
        if info.content_type:
            self.content_types[path] = info.content_type
        answer: dict[str, Any] = {
            "type": "head",
            "success": True,
            "status": 200,
            "offset": info.next_offset,
            "contentType": info.content_type,
            "streamClosed": info.closed,
        }
        if info.ttl is not None:
            answer["ttlSeconds"] = info.ttl
        if info.expires_at is not None:
            answer["expiresAt"] = info.expires_at
        return answer

    async def delete(self, command: dict[str, Any]) -> dict[str, Any]:
        path = command["path"]
        await self.stream(path).delete()
        self.content_types.pop(path, None)
        return {"type": "delete", "success": True, "status": 200}

    async def close(self, command: dict[str, Any]) -> dict[str, Any]:
        path = command["path"]
        stream = self.stream(path)
        data = command.get("data")
        if data is None:
            result = await stream.close()
        else:
            content_type = command.get("contentType") or self.content_types.get(path, OCTET_STREAM)
            result = await stream.append(data.encode(), content_type=content_type, close=True)
        return {"type": "close", "success": True, "status": 200, "finalOffset": result.next_offset}

    async def read(
        self, command: dict[str, Any], headers_sent: dict[str, str], params: dict[str, str]
    ) -> dict[str, Any]:
        """Reads as upstream's adapters do: batches until `maxChunks` with data, the stream's
        end, up-to-date (a catch-up read; a live one with `waitForUpToDate`), or `timeoutMs`
        (which reports up-to-date: nothing more came). A catch-up read of a JSON stream answers one
        array of every message, a live one an array per batch."""
        path = command["path"]
        offset = command.get("offset") or "-1"
        live: LiveMode = LIVE_MODES.get(command.get("live", False), False)
        timeout = (command.get("timeoutMs") or DEFAULT_READ_TIMEOUT_MS) / 1000
        max_chunks = command.get("maxChunks") or DEFAULT_MAX_CHUNKS
        wait_up_to_date = bool(command.get("waitForUpToDate"))

        chunks: list[dict[str, Any]] = []
        items: list[Any] = []
        final_offset = offset
        up_to_date = False
        closed = False
        cursor: str | None = None
        status: int | None = None  # the first answer's, as upstream's adapters report it
        with anyio.move_on_after(timeout) as deadline:
            async with self.stream(path).read(offset=offset, live=live) as reader:
                async for batch in reader:
                    if status is None:
                        status = batch.status
                    final_offset = batch.next_offset
                    up_to_date = batch.up_to_date
                    closed = batch.closed
                    cursor = batch.cursor or cursor
                    if batch.messages is not None:  # a JSON stream: the client parsed it
                        if live is False:
                            items.extend(batch.messages)
                        elif batch.messages:
                            chunks.append({"data": json_text(batch.messages), "offset": batch.next_offset})
                    elif batch.data:
                        text = batch.data.decode("utf-8", errors="replace")
                        chunks.append({"data": text, "offset": batch.next_offset})
                    if len(chunks) >= max_chunks or closed:
                        break
                    if up_to_date and (live is False or wait_up_to_date):
                        break
        if deadline.cancelled_caught:
            up_to_date = True
        if items:
            chunks.append({"data": json_text(items), "offset": final_offset})
        answer: dict[str, Any] = {
            "type": "read",
            "success": True,
            "status": status or 200,
            "chunks": chunks,
            "offset": final_offset,
            "upToDate": up_to_date,
            "streamClosed": closed,
        }
        if cursor:
            answer["cursor"] = cursor
        return with_sent(answer, headers_sent, params)

    # -- idempotent producer -------------------------------------------------------------------

    async def producer(self, command: dict[str, Any]) -> IdempotentProducer:
        """The producer of (path, producer id, epoch), kept across commands as upstream's
        TypeScript adapter keeps its own (one batch in flight, no linger)."""
        path, producer_id, epoch = command["path"], command["producerId"], int(command.get("epoch") or 0)
        key = (path, producer_id, epoch)
        if key not in self.producers:
            producer = self.stream(path).producer(
                producer_id, epoch=epoch, auto_claim=bool(command.get("autoClaim")), linger=0, max_in_flight=1
            )
            self.producers[key] = await HostedProducer.start(self.task_group, producer)
        return self.producers[key].producer

    async def idempotent_append(self, command: dict[str, Any]) -> dict[str, Any]:
        producer = await self.producer(command)
        receipt = producer.append(command["data"])  # JSON streams: one message, already encoded
        await producer.flush()
        result = await receipt
        answer: dict[str, Any] = {
            "type": "idempotent-append",
            "success": True,
            "status": 200,
            "duplicate": result.duplicate,
        }
        if result.next_offset is not None:
            answer["offset"] = result.next_offset
        if result.producer_seq is not None:
            answer["producerSeq"] = result.producer_seq
        return answer

    async def idempotent_append_batch(self, command: dict[str, Any]) -> dict[str, Any]:
        in_flight = command.get("maxInFlight") or 1
        concurrent = in_flight > 1
        # As upstream's TypeScript adapter: several in flight means one item a batch (so that there
        # are several requests), else one batch of everything after a long linger.
        producer = self.stream(command["path"]).producer(
            command["producerId"],
            epoch=int(command.get("epoch") or 0),
            auto_claim=bool(command.get("autoClaim")),
            max_in_flight=in_flight,
            linger=0 if concurrent else 1.0,
            max_batch_bytes=1 if concurrent else 1024 * 1024,
        )
        async with producer:
            for item in command["items"]:
                producer.append(item)
            await producer.flush()
        return {"type": "idempotent-append-batch", "success": True, "status": 200}

    async def idempotent_close(self, command: dict[str, Any]) -> dict[str, Any]:
        producer = await self.producer(command)
        data = command.get("data")
        if data is not None:
            producer.append(data)
        result = await producer.close(close_stream=True)
        # A second close of the same producer does nothing and answers None: the final offset is
        # then the closed stream's tail.
        final = (
            result.next_offset
            if result is not None
            else (await self.stream(command["path"]).head()).next_offset
        )
        answer: dict[str, Any] = {"type": "idempotent-close", "success": True, "status": 200}
        if final is not None:
            answer["finalOffset"] = final
        return answer

    async def idempotent_detach(self, command: dict[str, Any]) -> dict[str, Any]:
        await self.producer(command)
        key = (command["path"], command["producerId"], int(command.get("epoch") or 0))
        await self.producers.pop(key).stop()
        return {"type": "idempotent-detach", "success": True, "status": 200}

    def validate(self, command: dict[str, Any]) -> dict[str, Any]:
        target = command["target"]
        if target.get("target") != "idempotent-producer":
            return not_supported("validate", f"streamkeep.client has no {target.get('target')} to validate")
        options: dict[str, Any] = {"epoch": target.get("epoch", 0)}
        if "maxBatchBytes" in target:
            options["max_batch_bytes"] = target["maxBatchBytes"]
        try:
            IdempotentProducer(
                self.stream("/test-validate"), target.get("producerId", "test-producer"), **options
            )
        except (ValueError, TypeError) as exc:
            message = str(exc)
            for ours, theirs in OPTION_NAMES.items():
                message = message.replace(ours, f"{theirs} ({ours})")
            return {
                "type": "error",
                "success": False,
                "commandType": "validate",
                "errorCode": "INVALID_ARGUMENT",
                "message": message,
            }
        return {"type": "validate", "success": True}

    async def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        kind = command.get("type", "")
        headers_sent, params = self.begin(command)
        try:
            match kind:
                case "init":
                    return await self.init(command)
                case "create":
                    return await self.create(command)
                case "connect":
                    return await self.connect(command)
                case "append":
                    return await self.append(command, headers_sent, params)
                case "read":
                    return await self.read(command, headers_sent, params)
                case "head":
                    return await self.head(command)
                case "delete":
                    return await self.delete(command)
                case "close":
                    return await self.close(command)
                case "idempotent-append":
                    return await self.idempotent_append(command)
                case "idempotent-append-batch":
                    return await self.idempotent_append_batch(command)
                case "idempotent-close":
                    return await self.idempotent_close(command)
                case "idempotent-detach":
                    return await self.idempotent_detach(command)
                case "validate":
                    return self.validate(command)
                case "set-dynamic-header":
                    value = DynamicValue(command["valueType"], command.get("initialValue"))
                    self.dynamic_headers[command["name"]] = value
                    return {"type": kind, "success": True}
                case "set-dynamic-param":
                    self.dynamic_params[command["name"]] = DynamicValue(command["valueType"])
                    return {"type": kind, "success": True}
                case "clear-dynamic":
                    self.dynamic_headers.clear()
                    self.dynamic_params.clear()
                    return {"type": kind, "success": True}
                case "shutdown":
                    await self.close_client()
                    return {"type": "shutdown", "success": True}
                case _:
                    return not_supported(kind, f"unknown command {kind!r}")
        except Exception as exc:  # every failure is a result for the runner to judge
            if os.environ.get("STREAMKEEP_ADAPTER_TRACE"):
                log("".join(traceback.format_exception(exc)))
            return error_result(kind, exc)
        finally:
            self.current_headers = {}


def with_sent(answer: dict[str, Any], headers_sent: dict[str, str], params: dict[str, str]) -> dict[str, Any]:
    if headers_sent:
        answer["headersSent"] = headers_sent
    if params:
        answer["paramsSent"] = params
    return answer


def not_supported(kind: str, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "success": False,
        "commandType": kind,
        "errorCode": "NOT_SUPPORTED",
        "message": message,
    }


def classify(exc: BaseException) -> tuple[str, int | None]:
    """The protocol's error code (src/protocol.ts ErrorCodes) and status for an exception."""
    if isinstance(exc, StreamNotFound):
        return "NOT_FOUND", 404
    if isinstance(exc, StreamClosed):
        return "STREAM_CLOSED", 409
    if isinstance(exc, SequenceConflict):
        return "SEQUENCE_CONFLICT", 409
    if isinstance(exc, StreamExists):
        return "CONFLICT", 409
    if isinstance(exc, Conflict):
        said = f"{exc.code or ''} {exc.message}".lower()
        return ("SEQUENCE_CONFLICT" if "seq" in said else "CONFLICT"), 409
    if isinstance(exc, BadRequest):
        return "INVALID_OFFSET", 400
    if isinstance(exc, ConnectionFailed):
        return "NETWORK_ERROR", None
    if isinstance(exc, StaleEpoch):
        return "UNEXPECTED_STATUS", exc.status
    if isinstance(exc, ProtocolError):  # an answer the client could not read
        return "PARSE_ERROR", None
    if isinstance(exc, StreamError):
        return ("UNEXPECTED_STATUS", exc.status) if exc.status else ("INTERNAL_ERROR", None)
    if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError)):
        return "PARSE_ERROR", None
    if isinstance(exc, TimeoutError):
        return "TIMEOUT", None
    if isinstance(exc, (ValueError, TypeError)):
        return "INVALID_ARGUMENT", None
    return "INTERNAL_ERROR", None


def error_result(kind: str, exc: BaseException) -> dict[str, Any]:
    code, status = classify(exc)
    answer: dict[str, Any] = {
        "type": "error",
        "success": False,
        "commandType": kind,
        "errorCode": code,
        "message": f"{type(exc).__name__}: {exc}",
    }
    if status is not None:
        answer["status"] = status
    return answer


def write(result: dict[str, Any]) -> None:
    line = json.dumps(result, ensure_ascii=False).replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def serve(adapter: Adapter) -> None:
    while True:
        line = await anyio.to_thread.run_sync(sys.stdin.readline)
        if not line:
            break
        if not line.strip():
            continue
        try:
            command = json.loads(line)
        except json.JSONDecodeError as exc:
            write(error_result("init", exc))
            continue
        write(await adapter.handle(command))
        if command.get("type") == "shutdown":
            break
    await adapter.close_client()


async def main() -> None:
    async with anyio.create_task_group() as task_group:
        await serve(Adapter(task_group))


if __name__ == "__main__":
    anyio.run(main, backend=os.environ.get("STREAMKEEP_ADAPTER_BACKEND", "asyncio"))
