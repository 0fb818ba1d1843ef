"""`Stream`: one stream's URL and the protocol's operations on it (PROTOCOL.md §5).

A handle is cheap and holds no connection: it names a stream on a transport. It remembers the
stream's content type once known (from `create`, `head`, or the caller), since an append must
send it and a reader uses it to decide whether messages are JSON values.
"""

from __future__ import annotations

import importlib
import json as jsonlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

import httpx

from streamkeep.client.errors import StreamNotFound
from streamkeep.client.http import HeaderMap, HttpTransport
from streamkeep.client.reader import Batch, LiveMode, Messages, Reader, is_json_type

STREAM_PREFIX = "/v1/stream/"
JSON = "application/json"


def stream_path(name_or_path: str, prefix: str = STREAM_PREFIX) -> str:
    """A stream name (`chat/room-1`) as its URL path under `prefix`, each segment percent-encoded;
    a path (`/v1/stream/x`) or a full URL (a signed link) is kept as it is."""
    if name_or_path.startswith(("/", "http://", "https://")):
        return name_or_path
    # `.`/`..` segments are resolved away by URL normalisation (client, proxies, server), so
    # `a/../../admin` would name a path outside the stream prefix; an empty segment (`a//b`,
    # a leading or trailing `/` in a name) is not a name either.
    if any(segment in ("", ".", "..") for segment in name_or_path.split("/")):
        raise ValueError(f"not a stream name: {name_or_path!r} (empty, '.' or '..' segment)")
    return prefix.rstrip("/") + "/" + quote(name_or_path, safe="/")


@dataclass(frozen=True)
class StreamInfo:
    """A stream's metadata, from HEAD (or from the answer to a create).

    `created` is True only when `create` made the stream (201), False when it was already there
    with the same configuration (200) or for HEAD. `earliest_offset` is streamkeep's
    `Stream-Earliest-Offset`: where reading can start once retention dropped older data."""

    content_type: str | None
    next_offset: str | None
    closed: bool
    ttl: int | None = None
    expires_at: str | None = None
    earliest_offset: str | None = None
    etag: str | None = None
    created: bool = False

    @classmethod
    def from_headers(cls, headers: httpx.Headers, *, created: bool = False) -> StreamInfo:
        ttl = headers.get("stream-ttl")
        return cls(
            content_type=headers.get("content-type"),
            next_offset=headers.get("stream-next-offset"),
            closed=headers.get("stream-closed", "").strip().lower() == "true",
            ttl=int(ttl) if ttl is not None and ttl.strip().isdigit() else None,
            expires_at=headers.get("stream-expires-at"),
            earliest_offset=headers.get("stream-earliest-offset"),
            etag=headers.get("etag"),
            created=created,
        )


@dataclass(frozen=True)
class AppendResult:
    """The answer to an append or close. `duplicate` is True when an idempotent producer's append
    was already there (204 to a request with `Producer-Id`); `producer_epoch`/`producer_seq` echo
    the server's producer state on such requests."""

    next_offset: str | None
    closed: bool
    status: int
    duplicate: bool = False
    producer_epoch: int | None = None
    producer_seq: int | None = None

    @classmethod
    def from_response(cls, response: httpx.Response, *, producer: bool = False) -> AppendResult:
        headers = response.headers
        return cls(
            next_offset=headers.get("stream-next-offset"),
            closed=headers.get("stream-closed", "").strip().lower() == "true",
            status=response.status_code,
            duplicate=producer and response.status_code == 204,
            producer_epoch=_int_or_none(headers.get("producer-epoch")),
            producer_seq=_int_or_none(headers.get("producer-seq")),
        )


def _int_or_none(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def encode_body(data: Any) -> tuple[bytes, str | None]:
    """What to send for `data`, and the content type it implies (None: the stream's own).

    Bytes and text go as they are (text as UTF-8): a JSON stream's server flattens a top-level
    array in them (§9.1.2). Any other value is one JSON message: it is sent wrapped in an array,
    so a list is stored as one message rather than flattened into several."""
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data), None
    if isinstance(data, str):
        return data.encode("utf-8"), None
    # allow_nan=False: NaN and Infinity are not JSON; refused here (ValueError) rather than by the server.
    return jsonlib.dumps([data], separators=(",", ":"), allow_nan=False).encode("utf-8"), JSON


def rfc3339(value: str | datetime) -> str:
    if isinstance(value, str):
        return value
    if value.tzinfo is None:
        raise ValueError("expires_at needs a timezone (a naive datetime is ambiguous)")
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


class Stream:
    """A stream at `path` (a path under the transport's base URL, or a full URL such as a signed
    link, whose query parameters are kept on every request)."""

    def __init__(self, transport: HttpTransport, path: str, *, content_type: str | None = None) -> None:
        parts = urlsplit(path)
        self.transport = transport
        self.params: dict[str, str] = dict(parse_qsl(parts.query, keep_blank_values=True))
        self.path = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        self.content_type = content_type

    def __repr__(self) -> str:
        return f"Stream({self.url!r})"

    @property
    def url(self) -> str:
        return self.transport.url_for(self.path)

    @property
    def is_json(self) -> bool | None:
        """Whether the stream holds JSON messages; None until its content type is known."""
        return None if self.content_type is None else is_json_type(self.content_type)

    def _learn(self, headers: httpx.Headers) -> None:
        content_type = headers.get("content-type")
        if content_type:
            self.content_type = content_type

    async def create(
        self,
        *,
        content_type: str | None = None,
        ttl: int | timedelta | None = None,
        expires_at: str | datetime | None = None,
        closed: bool = False,
        body: Any = None,
        fork_of: Stream | str | None = None,
        fork_offset: str | None = None,
        fork_sub_offset: int | None = None,
        headers: HeaderMap | None = None,
    ) -> StreamInfo:
        """Creates the stream (PUT), or confirms it exists with this configuration (`created`
        False); another configuration raises `StreamExists`. `fork_of` forks another stream of
        the same server (a `Stream`, or its path) at `fork_offset` (default: its tail)."""
        sent: dict[str, str] = {}
        payload: bytes | None = None
        if body is not None:
            payload, implied = encode_body(body)
            content_type = content_type or implied
        if content_type is None and fork_of is None:
            content_type = self.content_type
        if content_type is not None:
            sent["Content-Type"] = content_type
        if ttl is not None:
            seconds = int(ttl.total_seconds()) if isinstance(ttl, timedelta) else ttl
            sent["Stream-TTL"] = str(seconds)
        if expires_at is not None:
            sent["Stream-Expires-At"] = rfc3339(expires_at)
        if closed:
            sent["Stream-Closed"] = "true"
        if fork_of is not None:
            sent["Stream-Forked-From"] = fork_of.path if isinstance(fork_of, Stream) else stream_path(fork_of)
            if fork_offset is not None:
                sent["Stream-Fork-Offset"] = fork_offset
            if fork_sub_offset is not None:
                sent["Stream-Fork-Sub-Offset"] = str(fork_sub_offset)
        elif fork_offset is not None or fork_sub_offset is not None:
            raise ValueError("fork_offset and fork_sub_offset need fork_of")
        if headers:
            sent.update(headers)
        response = await self.transport.request(
            "PUT", self.path, params=self.params or None, headers=sent, content=payload
        )
        self._learn(response.headers)
        return StreamInfo.from_headers(response.headers, created=response.status_code == 201)

    async def head(self) -> StreamInfo:
        """The stream's metadata: tail offset, closure, content type, TTL or expiry."""
        response = await self.transport.request("HEAD", self.path, params=self.params or None)
        self._learn(response.headers)
        return StreamInfo.from_headers(response.headers)

    async def exists(self) -> bool:
        """Whether the stream is there (HEAD); a soft-deleted one raises `StreamGone`."""
        try:
            await self.head()
        except StreamNotFound:
            return False
        return True

    async def _content_type_for_append(self) -> str:
        if self.content_type is None:
            await self.head()
        return self.content_type or "application/octet-stream"

    async def append(
        self,
        data: Any,
        *,
        content_type: str | None = None,
        seq: str | None = None,
        close: bool = False,
        headers: HeaderMap | None = None,
    ) -> AppendResult:
        """Appends `data` (bytes, text, or any other value as one JSON message; see
        `encode_body`), closing the stream too with `close=True`. `seq` is the `Stream-Seq`
        writer sequence (§5.2). A plain append is not repeated after a broken connection (it
        may have happened); use a producer for exactly-once appends."""
        payload, implied = encode_body(data)
        sent = {"Content-Type": content_type or implied or await self._content_type_for_append()}
        if seq is not None:
            sent["Stream-Seq"] = seq
        if close:
            sent["Stream-Closed"] = "true"
        if headers:
            sent.update(headers)
        return await self.post(payload, sent)

    async def post(self, payload: bytes, headers: HeaderMap) -> AppendResult:
        """A POST of `payload` with exactly these headers: what `append`, `close` and the
        idempotent producer send through (the transport repeats it only when it carries
        `Producer-Id`)."""
        response = await self.transport.request(
            "POST", self.path, params=self.params or None, headers=headers, content=payload
        )
        producer = any(name.lower() == "producer-id" for name in headers)
        return AppendResult.from_response(response, producer=producer)

    async def close(self, *, headers: HeaderMap | None = None) -> AppendResult:
        """Closes the stream (EOF for readers); closing a closed stream succeeds (§5.3)."""
        return await self.post(b"", {"Stream-Closed": "true", **(headers or {})})

    async def delete(self) -> None:
        """Deletes the stream (404 `StreamNotFound` if there is none; after a repeated attempt,
        the transport takes a 404 as the lost first attempt's success)."""
        await self.transport.request("DELETE", self.path, params=self.params or None)

    def read(
        self,
        *,
        offset: str = "-1",
        live: LiveMode = False,
        json: bool | None = None,
        cursor: str | None = None,
    ) -> Reader:
        """An async iterator of `Batch`es from `offset` (see `Reader`)."""
        return Reader(
            self.transport,
            self.path,
            offset=offset,
            live=live,
            json=json,
            cursor=cursor,
            content_type=self.content_type,
            params=self.params,
        )

    def messages(self, *, offset: str = "-1", live: LiveMode = False, json: bool | None = None) -> Messages:
        """The messages one by one: JSON values for a JSON stream, else chunks of bytes."""
        return self.read(offset=offset, live=live, json=json).messages()

    async def read_all(self, *, offset: str = "-1") -> list[Batch]:
        """Every batch from `offset` to the current tail (a catch-up read)."""
        async with self.read(offset=offset) as reader:
            return [batch async for batch in reader]

    def producer(self, producer_id: str, **options: Any) -> Any:
        """An `IdempotentProducer` for this stream (see `streamkeep.client.producer` for the
        options): exactly-once appends, batched and pipelined.

        The producer module builds on this one, so it is looked up when called, not imported:
        an import either way would be a cycle (the acyclic contract in pyproject.toml). For a
        typed handle, construct `IdempotentProducer(stream, producer_id, ...)` directly."""
        module = importlib.import_module("streamkeep.client.producer")
        return module.IdempotentProducer(self, producer_id, **options)


__all__ = ["STREAM_PREFIX", "AppendResult", "Stream", "StreamInfo", "encode_body", "stream_path"]
