"""Protocol errors: a status, a stable code and a message a person can act on."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ProtocolError(Exception):
    status: int
    code: str
    message: str
    headers: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"


def bad_request(code: str, message: str) -> ProtocolError:
    return ProtocolError(400, code, message)


def not_found(name: str) -> ProtocolError:
    return ProtocolError(404, "stream_not_found", f"stream {name!r} does not exist")


def conflict(code: str, message: str, headers: list[tuple[str, str]] | None = None) -> ProtocolError:
    return ProtocolError(409, code, message, headers or [])


def body_too_large(limit: int) -> ProtocolError:
    return ProtocolError(
        413, "body_too_large", f"request bodies may be at most {limit} bytes; split the append"
    )
