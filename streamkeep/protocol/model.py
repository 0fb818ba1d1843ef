"""Plain values that cross the boundary between the HTTP edge, the service and the actors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import parse_qs


class Headers:
    """Case-insensitive request headers; a repeated header keeps its values joined by ', '."""

    __slots__ = ("_values",)

    def __init__(self, pairs: list[tuple[str, str]] | None = None) -> None:
        self._values: dict[str, str] = {}
        for name, value in pairs or []:
            key = name.lower()
            if key in self._values:
                self._values[key] = f"{self._values[key]}, {value}"
            else:
                self._values[key] = value

    @classmethod
    def lowered(cls, values: dict[str, str]) -> Headers:
        """Headers over a dict already keyed by lower-case names, repeats joined (the edge's parser
        builds one as it goes, so nothing is copied per request)."""
        headers = cls.__new__(cls)
        headers._values = values
        return headers

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._values.get(name.lower(), default)

    def items(self) -> list[tuple[str, str]]:
        return list(self._values.items())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._values


class PushTarget(Protocol):
    """What an edge offers for pushing a streaming response's bytes without waking its task.

    Live fan-out writes each change straight into every idle subscriber's socket from one loop
    (see streamkeep.server.fanout). `frame` wraps a payload the way the edge's transfer needs (HTTP/1.1
    chunks); `kind` names that framing, so subscribers on the same kind share the framed bytes.
    `write` must not block: it returns how many bytes the kernel took, and raises OSError if the
    peer is gone.
    """

    kind: str

    def frame(self, payload: bytes) -> bytes: ...

    def write(self, data: bytes) -> int: ...


class Tally:
    """Bytes of a streaming response that bypassed its iterator (pushed by live fan-out), so the
    access log and metrics can count them too."""

    __slots__ = ("pushed",)

    def __init__(self) -> None:
        self.pushed = 0


class Framed(bytes):
    """Bytes a `PushTarget` already framed (the rest of a partial push); the edge sends them as is."""


@dataclass
class Request:
    method: str
    raw_path: str
    query_string: str = ""
    headers: Headers = field(default_factory=Headers)
    body: bytes = b""
    scheme: str = "http"
    http_version: str = "1.1"
    # Set by an edge that can take pushed bytes for a streaming response (plain HTTP/1.1).
    push: PushTarget | None = None
    # The peer's address, for the access log.
    client: str = ""
    # Who is asking, once the auth gate let the request through (None: auth is off), and the
    # token they presented (never logged).
    principal: Any = None
    credential: str = ""

    @property
    def target(self) -> str:
        """The path and query as the client sent them (for logs: redact before writing)."""
        return f"{self.raw_path}?{self.query_string}" if self.query_string else self.raw_path

    def query(self, name: str) -> list[str]:
        return self._query().get(name, [])

    def _query(self) -> dict[str, list[str]]:
        cached = getattr(self, "_parsed_query", None)
        if cached is None:
            cached = parse_qs(self.query_string, keep_blank_values=True)
            object.__setattr__(self, "_parsed_query", cached)
        return cached


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    # Set for streaming responses (SSE); the edge sends each chunk as it comes.
    stream: AsyncIterator[bytes] | None = None
    tally: Tally | None = None

    def header(self, name: str) -> str | None:
        lowered = name.lower()
        for key, value in self.headers:
            if key.lower() == lowered:
                return value
        return None
