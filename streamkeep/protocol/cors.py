"""Which origins a browser may read responses from (`--cors-origins`), and the headers that say so.

`*` (the default, and seed 000's) answers every origin the same, so the headers are one constant
list. With an allow-list, a listed `Origin` is echoed back and any other gets no
`Access-Control-Allow-Origin` at all, so the browser withholds the response from its page; both
carry `Vary: Origin`, so a shared cache never hands one origin's answer to another.
"""

from __future__ import annotations

from streamkeep.protocol.model import Headers

EXPOSE_HEADERS = (
    "Stream-Next-Offset, Stream-Cursor, Stream-Up-To-Date, Stream-Closed, Stream-TTL, "
    "Stream-Expires-At, Stream-SSE-Data-Encoding, Producer-Epoch, Producer-Seq, "
    "Producer-Expected-Seq, Producer-Received-Seq, ETag, Location, Content-Type, Retry-After, "
    "WWW-Authenticate, Stream-Earliest-Offset"
)
# On every response, whatever the origin: the browser-safety headers of §12.7.
SAFETY = [("X-Content-Type-Options", "nosniff"), ("Cross-Origin-Resource-Policy", "cross-origin")]


class Cors:
    __slots__ = ("_allowed", "_any", "_refused")

    def __init__(self, origins: str = "*") -> None:
        listed = [origin.strip() for origin in origins.split(",") if origin.strip()]
        self._allowed: dict[str, list[tuple[str, str]]] = {}
        self._any: list[tuple[str, str]] | None = None
        if listed == ["*"] or not listed:
            self._any = [
                ("Access-Control-Allow-Origin", "*"),
                ("Access-Control-Expose-Headers", EXPOSE_HEADERS),
                *SAFETY,
            ]
        for origin in listed:
            if origin != "*":
                self._allowed[origin.rstrip("/")] = [
                    ("Access-Control-Allow-Origin", origin.rstrip("/")),
                    ("Access-Control-Expose-Headers", EXPOSE_HEADERS),
                    ("Vary", "Origin"),
                    *SAFETY,
                ]
        self._refused = [("Vary", "Origin"), *SAFETY]

    @property
    def allows_any(self) -> bool:
        return self._any is not None

    def headers(self, request_headers: Headers | None) -> list[tuple[str, str]]:
        """The CORS and safety headers of a response to a request with these headers (a new list:
        the caller may extend it)."""
        if self._any is not None:
            return list(self._any)
        origin = request_headers.get("origin") if request_headers is not None else None
        allowed = self._allowed.get(origin) if origin else None
        return list(allowed if allowed is not None else self._refused)
