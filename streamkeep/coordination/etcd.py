"""A client for etcd's v3 API through its JSON gateway, on httpx (so it runs under trio).

etcd answers gRPC on its client port and, on the same port, a JSON translation of it (the gRPC
gateway): `POST /v3/kv/range` with `{"key": base64}` and so on. We speak the JSON form with the HTTP
client the server already has, rather than a gRPC client: python-etcd3 (unmaintained) makes
blocking grpcio calls and watches from a thread of its own, aetcd (grpcio) and etcd3-py's async
client (aiohttp) need asyncio, and grpcio has no trio support.

The gateway's ways, which this module hides: keys and values are base64; int64 fields come as JSON
strings; fields that are zero or false are left out (a missing `TTL` is 0, a missing `succeeded` is
false); errors come as `{"error", "message", "code"}` with `code` a gRPC status code; and the lease
keepalive is a streaming endpoint whose answer is one JSON line per request sent.

Several endpoints: a call goes to the endpoint that answered last and, when that one cannot be
reached or cannot serve (no leader, timed out), to the next, in order. A pass where none answered
is repeated, with a short backoff, until `timeout` seconds after the call began (so a call rides out
a leader election), then `EtcdUnavailable` names every endpoint tried and what each did.

A write whose request may have reached a member that then failed (a read timeout, a connection
cut after sending) is retried on the next member too. For a plain put that is harmless (the same
value again). For a compare-and-set it is not: the first try may have been applied, moving the
revision, so the retry's comparison fails although our write took. Then the outcome is unknown and
we say so (`EtcdOutcomeUnknown`) instead of answering False; the caller reads the key again.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx
import trio

# gRPC status codes etcd answers with (google.golang.org/grpc/codes).
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
UNAVAILABLE = 14
# A member that cannot serve: no leader, the leader changed, a proposal timed out, a member without
# quorum. Another member may serve, so these move the call on like a connection error.
_MEMBER_TROUBLE = frozenset({DEADLINE_EXCEEDED, UNAVAILABLE})
# etcd 3.4 answers some of those with code 2 (Unknown) and only this message (a lease grant
# without a quorum, say).
_TROUBLE_MESSAGES = ("context deadline exceeded", "context canceled")
# Refused before anything was proposed: a write answered so was surely not applied.
_NOT_APPLIED_MESSAGES = ("etcdserver: no leader", "etcdserver: not capable")
# Transport errors that mean the request never reached the endpoint.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)

_FIRST_BACKOFF = 0.05
_MOST_BACKOFF = 0.5


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


class EtcdError(Exception):
    """etcd answered, and the answer was an error (`code` is the gRPC status code)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class LeaseNotFound(EtcdError):
    """A put or grant named a lease that does not exist (expired or revoked)."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered: the message names each one tried and what it did."""


class EtcdOutcomeUnknown(EtcdUnavailable):
    """A conditional write may or may not have been applied: an endpoint failed after the request
    was sent, and the retry on another found the comparison false (perhaps because of our own
    write). Read the key again to know."""


class _Trouble(Exception):
    """One endpoint could not serve one request; `maybe_applied` if it may have applied it."""

    def __init__(self, what: str, *, maybe_applied: bool) -> None:
        super().__init__(what)
        self.what = what
        self.maybe_applied = maybe_applied


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _key_bytes(key: str) -> bytes:
    # surrogateescape: a key another writer stored as bytes that are not UTF-8 comes back as a str
    # that encodes to the same bytes, so it can be compared and deleted.
    return key.encode("utf-8", "surrogateescape")


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's `range_end` for a prefix)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # an empty prefix (or all 0xff): every key from `key` on


def _int(fields: dict[str, Any], name: str) -> int:
    return int(fields.get(name, 0))  # int64 as a JSON string; omitted when 0


def _key_value(fields: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=base64.b64decode(fields.get("key", "")).decode("utf-8", "surrogateescape"),
        value=base64.b64decode(fields.get("value", "")),
        create_revision=_int(fields, "create_revision"),
        mod_revision=_int(fields, "mod_revision"),
        version=_int(fields, "version"),
        lease=_int(fields, "lease"),
    )


def _error(answer: dict[str, Any]) -> tuple[int, str] | None:
    """The gRPC code and message of an error answer, or None. Unary calls answer
    `{"error": str, "message": str, "code": int}`; a stream's line `{"error": {"grpc_code", "message"}}`."""
    error = answer.get("error")
    if error is None:
        return None
    if isinstance(error, dict):
        code: Any = error.get("grpc_code", error.get("code", 2))
        return int(code), str(error.get("message", error))
    return int(answer.get("code", 2)), str(answer.get("message", error))


class Etcd:
    """etcd's v3 API at `endpoints` ("http://127.0.0.1:2379", ...). `timeout` bounds each request to
    one endpoint, and how long a call keeps retrying when no endpoint can serve it. `local_address`
    is the source IP of outgoing connections (a test cuts a process off by its loopback address)."""

    def __init__(
        self, endpoints: Sequence[str], *, timeout: float = 2.0, local_address: str | None = None
    ) -> None:
        if not endpoints:
            raise ValueError("Etcd needs at least one endpoint")
        self.endpoints = [endpoint.rstrip("/") for endpoint in endpoints]
        self.timeout = timeout
        self._current = 0
        transport = httpx.AsyncHTTPTransport(local_address=local_address, retries=0)
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(timeout),
            follow_redirects=False,
            trust_env=False,  # a proxy from the environment must never sit between us and etcd
        )

    @property
    def endpoint(self) -> str:
        """The endpoint calls go to first: the last one that answered."""
        return self.endpoints[self._current]

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> Etcd:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- keys

    async def get(self, key: str) -> KeyValue | None:
        answer, _ = await self._call("/v3/kv/range", {"key": _b64(_key_bytes(key))})
        kvs = answer.get("kvs", [])
        return _key_value(kvs[0]) if kvs else None

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key that starts with `prefix`, in key order."""
        start = _key_bytes(prefix)
        body = {"key": _b64(start or b"\0"), "range_end": _b64(_prefix_end(start))}
        answer, _ = await self._call("/v3/kv/range", body)
        return [_key_value(kv) for kv in answer.get("kvs", [])]

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Store `value` at `key` (attached to `lease` unless 0); the revision it made."""
        body: dict[str, Any] = {"key": _b64(_key_bytes(key)), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        answer, _ = await self._call("/v3/kv/put", body)
        return _int(answer.get("header", {}), "revision")

    async def delete(self, key: str) -> bool:
        """Whether the key was there (and is now gone)."""
        answer, _ = await self._call("/v3/kv/deleterange", {"key": _b64(_key_bytes(key))})
        return _int(answer, "deleted") > 0

    async def compare_and_put(self, key: str, value: bytes, *, mod_revision: int, lease: int = 0) -> bool:
        """Store `value` only if the key's mod_revision is exactly `mod_revision` (0: only if the
        key does not exist), in one transaction. False when the comparison failed."""
        put: dict[str, Any] = {"key": _b64(_key_bytes(key)), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        answer = await self._compare(key, mod_revision, {"request_put": put})
        return answer is not None

    async def compare_and_delete(self, key: str, *, mod_revision: int) -> bool:
        """Delete the key only if its mod_revision is exactly `mod_revision`: True when it did.
        (With 0 the comparison holds only for a missing key, so nothing is deleted: False.)"""
        answer = await self._compare(
            key, mod_revision, {"request_delete_range": {"key": _b64(_key_bytes(key))}}
        )
        if answer is None:
            return False
        responses = answer.get("responses", [{}])
        return _int(responses[0].get("response_delete_range", {}), "deleted") > 0

    async def _compare(self, key: str, mod_revision: int, request: dict[str, Any]) -> dict[str, Any] | None:
        """The answer of a transaction doing `request` if the key's mod_revision is `mod_revision`,
        or None when the comparison failed."""
        body = {
            "compare": [
                {
                    "key": _b64(_key_bytes(key)),
                    "target": "MOD",
                    "result": "EQUAL",
                    "mod_revision": str(mod_revision),
                }
            ],
            "success": [request],
        }
        answer, maybe_applied = await self._call("/v3/kv/txn", body)
        if answer.get("succeeded", False):
            return answer
        if maybe_applied:
            raise EtcdOutcomeUnknown(
                f"the transaction on {key!r} may have been applied by an endpoint that failed before "
                f"answering; the retry at {self.endpoint} found mod_revision != {mod_revision}: read the key again"
            )
        return None

    # -- leases

    async def grant_lease(self, ttl: int) -> int:
        """A new lease of `ttl` seconds; its id."""
        answer, _ = await self._call("/v3/lease/grant", {"TTL": str(ttl)})
        return _int(answer, "ID")

    async def keepalive(self, lease: int) -> int:
        """Renew the lease once: its TTL in seconds from now, or 0 when the lease is gone."""
        answer, _ = await self._call("/v3/lease/keepalive", {"ID": str(lease)}, stream=True)
        return max(0, _int(answer, "TTL"))

    async def time_to_live(self, lease: int) -> int:
        """The lease's remaining seconds without renewing it; 0 when it is gone."""
        answer, _ = await self._call("/v3/lease/timetolive", {"ID": str(lease)})
        return max(0, _int(answer, "TTL"))  # a lease that is gone answers TTL -1

    async def revoke(self, lease: int) -> None:
        """End the lease now, deleting its keys. A lease already gone is no error."""
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease)})
        except LeaseNotFound:
            pass

    # -- one call, over the endpoints

    async def _call(
        self, path: str, body: dict[str, Any], *, stream: bool = False
    ) -> tuple[dict[str, Any], bool]:
        """etcd's answer to `body` at `path`, from the first endpoint that can serve it, and whether
        an endpoint tried before may have applied it too."""
        deadline = trio.current_time() + self.timeout
        backoff = _FIRST_BACKOFF
        maybe_applied = False
        count = len(self.endpoints)
        while True:
            tried: list[str] = []
            start = self._current
            for step in range(count):
                index = (start + step) % count
                endpoint = self.endpoints[index]
                try:
                    answer = await self._attempt(endpoint + path, body, stream)
                except _Trouble as trouble:
                    maybe_applied = maybe_applied or trouble.maybe_applied
                    tried.append(f"{endpoint}: {trouble.what}")
                    continue
                self._current = index
                return answer, maybe_applied
            # No endpoint served this pass: move on from the one that failed first, and wait a
            # little before the next pass (an election takes about one election timeout).
            self._current = (start + 1) % count
            left = deadline - trio.current_time()
            if left <= 0:
                raise EtcdUnavailable(
                    f"no etcd endpoint answered {path} within {self.timeout:g}s ({'; '.join(tried)}): "
                    "is etcd running at these addresses, and does it have a quorum?"
                )
            await trio.sleep(min(backoff, left))
            backoff = min(backoff * 2, _MOST_BACKOFF)

    async def _attempt(self, url: str, body: dict[str, Any], stream: bool) -> dict[str, Any]:
        """One request to one endpoint: its JSON answer, or `_Trouble`, or `EtcdError`."""
        try:
            if stream:
                answer = await self._first_line(url, body)
            else:
                response = await self._client.post(url, json=body)
                answer = self._parse(response.status_code, response.content)
        except _NOT_SENT as error:
            raise _Trouble(f"{type(error).__name__} {error}".strip(), maybe_applied=False) from None
        except httpx.TransportError as error:
            raise _Trouble(f"{type(error).__name__} {error}".strip(), maybe_applied=True) from None
        failed = _error(answer)
        if failed is None:
            return answer
        code, message = failed
        if code in _MEMBER_TROUBLE or message in _TROUBLE_MESSAGES:
            applied = not any(message.startswith(m) for m in _NOT_APPLIED_MESSAGES)
            raise _Trouble(f"code {code}: {message}", maybe_applied=applied)
        if code == NOT_FOUND and "lease not found" in message:
            raise LeaseNotFound(message, code)
        raise EtcdError(f"etcd refused {url}: {message} (code {code})", code)

    async def _first_line(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        """A streaming endpoint's first answer. The gateway answers one JSON line per request sent;
        we send one, so we read one line and close (the stream ends with our request anyway)."""
        async with self._client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return self._parse(response.status_code, await response.aread())
            async for line in response.aiter_lines():
                if line.strip():
                    answer = self._parse(200, line.encode())
                    result = answer.get("result")
                    return result if isinstance(result, dict) else answer
        raise _Trouble("the stream ended without an answer", maybe_applied=True)

    @staticmethod
    def _parse(status: int, content: bytes) -> dict[str, Any]:
        try:
            answer = json.loads(content)
        except ValueError:
            answer = None
        if isinstance(answer, dict):
            return answer
        # Not the gateway's JSON: the member is failing, or something else answers at this address.
        text = content[:200].decode("utf-8", "replace").strip()
        raise _Trouble(f"HTTP {status}, not etcd's JSON: {text!r}", maybe_applied=status >= 500)
