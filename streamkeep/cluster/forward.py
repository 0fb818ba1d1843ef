"""Handing a request to the member that owns its stream, and knowing a fellow member's request.

HAProxy routes by the path as it was sent; a name percent-encoded another way (`%61` for `a`)
hashes to another slot and reaches a member that does not own it. That member forwards the
request to the owner over HTTP/1.1 and streams the answer back (SSE and long-polls included):
clients cannot reach the members' internal addresses, so there is no redirect.

Members authenticate each other with the cluster secret: a forwarded request carries
`Streamkeep-Forwarded: <member> <unix time> <HMAC-SHA256(secret, member, time, method, target)>`.
It is also the loop guard: a member never forwards a request that was forwarded to it (two
members disagreeing about the owner answer 503 until their placement epochs agree).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time

import httpx
import trio

from streamkeep.cluster.placement import Member
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.headers import HOP_BY_HOP
from streamkeep.protocol.model import Headers, Request, Response

HEADER = "streamkeep-forwarded"
# What a member behind the front door cannot see for itself: the Host the client sent (a
# forwarded request is sent to the owner's address) and the scheme it used (HAProxy terminates
# TLS and sets this header on every request). Location headers and subscription callback URLs
# are built from them, so they name the front door as the client reached it.
ORIGINAL_HOST = "streamkeep-original-host"
CLIENT_SCHEME = "streamkeep-client-scheme"
_HEX64 = re.compile(r"[0-9a-f]{64}")
MAX_SKEW_SECONDS = 60
GATHER_SECONDS = 5.0  # a member's part of a cluster-wide answer (the stream browser's list)
STATS_SECONDS = 2.0  # a member's /stats in /stats?cluster=1
# Hop-by-hop headers and what the edges set themselves stay behind.
_NOT_FORWARDED = HOP_BY_HOP | {"te", "host", "content-length", ORIGINAL_HOST}


def signature(secret: str, member: str, stamp: int, method: str, target: str) -> str:
    message = f"{member}\n{stamp}\n{method}\n{target}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def stamp_header(secret: str, member: str, method: str, target: str, now: float | None = None) -> str:
    stamp = int(time.time() if now is None else now)
    return f"{member} {stamp} {signature(secret, member, stamp, method, target)}"


def forwarded_by(
    request: Request, secret: str, members: tuple[Member, ...], now: float | None = None
) -> str | None:
    """The member that forwarded `request`, None if no member did; 403 for a header that does not
    verify (a client cannot pass itself off as a member)."""
    value = request.headers.get(HEADER)
    if value is None:
        return None
    parts = value.split(" ")
    current = time.time() if now is None else now
    if (
        not secret
        or len(parts) != 3
        or parts[0] not in {member.id for member in members}
        or not parts[1].isdigit()
        or abs(current - int(parts[1])) > MAX_SKEW_SECONDS
        or not _HEX64.fullmatch(parts[2])
        or not hmac.compare_digest(
            parts[2], signature(secret, parts[0], int(parts[1]), request.method, request.target)
        )
    ):
        raise ProtocolError(403, "bad_cluster_signature", "Streamkeep-Forwarded is for cluster members only")
    return parts[0]


def as_the_client_sent(request: Request, by: str | None) -> None:
    """Restores the client's scheme (from the front door) and, on a request a member forwarded,
    its Host."""
    scheme = request.headers.get(CLIENT_SCHEME)
    if scheme == "https" or scheme == "http":
        request.scheme = scheme
    original = request.headers.get(ORIGINAL_HOST) if by is not None else None
    if original:
        kept = [(k, v) for k, v in request.headers.items() if k != "host" and k != ORIGINAL_HOST]
        request.headers = Headers([*kept, ("host", original)])


def unavailable(owner: Member) -> ProtocolError:
    return ProtocolError(
        503,
        "owner_unavailable",
        f"cluster member {owner.id!r}, which owns this stream, is not reachable; retry shortly",
        [("Retry-After", "1")],
    )


class Forwarder:
    """One connection pool to the other members; closed with the server."""

    def __init__(self, member: str, secret: str, read_timeout: float) -> None:
        self.member = member
        self.secret = secret
        self.forwarded = 0
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=2.0, read=read_timeout, write=30.0, pool=5.0),
            # No cap on connections: each forwarded live read holds one for minutes, and a cap would
            # make every other forwarded request wait behind them.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            follow_redirects=False,
            trust_env=False,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def gather(
        self, request: Request, members: list[Member], seconds: float = GATHER_SECONDS
    ) -> dict[str, Response | None]:
        """`request` forwarded to each of `members` side by side (None: no answer in `seconds`)."""
        answers: dict[str, Response | None] = {}

        async def ask(member: Member) -> None:
            answers[member.id] = None  # unless it answers in time: a hung member is named, not waited for
            with trio.move_on_after(seconds):
                try:
                    answers[member.id] = await self.forward(request, member)
                except ProtocolError:
                    pass

        async with trio.open_nursery() as nursery:
            for member in members:
                nursery.start_soon(ask, member)
        return answers

    async def forward(self, request: Request, owner: Member) -> Response:
        headers = [(name, value) for name, value in request.headers.items() if name not in _NOT_FORWARDED]
        headers.append((ORIGINAL_HOST, request.headers.get("host") or ""))
        outgoing = self._client.build_request(
            request.method, f"http://{owner.address}{request.target}", headers=headers, content=request.body
        )
        # Signed as it will be sent: httpx percent-encodes some characters a client may send raw.
        target = outgoing.url.raw_path.decode("ascii")
        outgoing.headers[HEADER] = stamp_header(self.secret, self.member, request.method, target)
        try:
            answer = await self._client.send(outgoing, stream=True)
        except httpx.HTTPError:
            raise unavailable(owner) from None
        self.forwarded += 1
        kept = [
            (name, value)
            for name, value in answer.headers.multi_items()
            if name.lower() not in _NOT_FORWARDED
        ]
        if "content-length" in answer.headers or request.method == "HEAD" or answer.status_code in (204, 304):
            try:
                body = await answer.aread()
            except httpx.HTTPError:
                raise unavailable(owner) from None
            finally:
                await answer.aclose()
            return Response(answer.status_code, kept, b"" if request.method == "HEAD" else body)
        return Response(answer.status_code, kept, stream=_Relay(answer))


class _Relay:
    """A streaming answer (SSE, a long-poll) passed on as it comes. An object rather than a
    generator: closing it closes the member's response even if it was never iterated (the client
    left before the head went out), which a generator's `finally` would not."""

    def __init__(self, answer: httpx.Response) -> None:
        self._answer = answer
        self._chunks = answer.aiter_raw()

    def __aiter__(self) -> _Relay:
        return self

    async def __anext__(self) -> bytes:
        while True:
            try:
                chunk = await self._chunks.__anext__()
            except httpx.HTTPError:
                raise StopAsyncIteration from None  # the owner went away: the client resumes by offset
            if chunk:
                return chunk

    async def aclose(self) -> None:
        await self._answer.aclose()
