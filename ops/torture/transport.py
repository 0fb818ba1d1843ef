"""Sends a generated `Call` to a real server over real sockets and records what came back.

Plain calls go through httpx (one keep-alive client per worker). SSE reads parse the event stream
as it arrives, stamping each event with its arrival time. Slow and vanishing clients use a raw
socket: a slow one takes the answer a byte at a time; a vanishing one resets the connection (RST,
SO_LINGER 0) after a few bytes of the answer, in the middle of its own body, or right after sending
everything without reading a byte.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import time
from collections.abc import Callable
from urllib.parse import urlencode, urlsplit

import httpx

from ops.torture.history import Call, Chunk, Outcome, classify, keep_headers, to_bytes, to_text


class SseParser:
    """Server-sent events into `Chunk`s: each data event is paired with the control event after it."""

    def __init__(self, base64_mode: bool, clock: Callable[[], float]) -> None:
        self.base64_mode = base64_mode
        self.clock = clock
        self.buffer = b""
        self.data: list[str] | None = None
        self.chunks: list[Chunk] = []
        self.closed = False
        self.errors: list[str] = []

    def feed(self, data: bytes) -> None:
        self.buffer += data.replace(b"\r\n", b"\n")
        while b"\n\n" in self.buffer:
            raw, self.buffer = self.buffer.split(b"\n\n", 1)
            self._event(raw.decode("utf-8", errors="replace"))

    def _event(self, raw: str) -> None:
        kind, lines = "message", []
        for line in raw.split("\n"):
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                value = line[5:]
                lines.append(value[1:] if value.startswith(" ") else value)
        if kind == "data":
            self.data = (self.data or []) + ["\n".join(lines)]
        elif kind == "control":
            try:
                control = json.loads("\n".join(lines))
            except ValueError:
                self.errors.append(f"control event is not JSON: {raw[:100]!r}")
                return
            body = b""
            for payload in self.data or []:
                body += base64.b64decode("".join(payload.split())) if self.base64_mode else payload.encode()
            self.data = None
            closed = bool(control.get("streamClosed"))
            self.chunks.append(
                Chunk(
                    self.clock(),
                    to_text(body),
                    control.get("streamNextOffset"),
                    bool(control.get("upToDate")) or closed,
                    closed,
                    control.get("streamCursor"),
                )
            )
            self.closed = self.closed or closed


def _error_kind(error: Exception) -> str:
    if isinstance(error, httpx.ConnectError | ConnectionRefusedError):
        return "refused"
    if isinstance(error, httpx.TimeoutException | TimeoutError | socket.timeout):
        return "timeout"
    return "closed"


class HttpTransport:
    def __init__(self, base_url: str, clock: Callable[[], float] = time.time, timeout: float = 12.0) -> None:
        self.base_url = base_url
        self.clock = clock
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.client = httpx.Client(
            base_url=base_url,
            timeout=httpx.Timeout(timeout, connect=2.0),
            headers={"Accept-Encoding": "identity"},
        )

    def close(self) -> None:
        self.client.close()

    def send(self, call: Call) -> Outcome:
        if call.mode == "sse":
            return self._sse(call)
        if call.mode in ("slow", "vanish", "cut_body", "send_and_vanish"):
            return self._raw(call)
        try:
            response = self.client.request(
                call.method,
                call.path,
                params=call.query or None,
                headers=call.headers,
                content=to_bytes(call.body),
            )
        except httpx.HTTPError as error:
            kind = _error_kind(error)
            return Outcome(None, error=f"{kind}: {type(error).__name__}", verdict=classify(None, kind))
        return Outcome(
            response.status_code,
            keep_headers(response.headers.items()),
            to_text(response.content),
            verdict=classify(response.status_code, body=to_text(response.content)),
        )

    # ---- SSE ------------------------------------------------------------------------------

    def _sse(self, call: Call) -> Outcome:
        deadline = self.clock() + call.limit
        timeout = httpx.Timeout(max(call.limit, 0.3) + 0.5, connect=2.0)
        try:
            with self.client.stream(
                "GET", call.path, params=call.query, headers=call.headers, timeout=timeout
            ) as response:
                headers = keep_headers(response.headers.items())
                if response.status_code != 200 or not response.headers.get("content-type", "").startswith(
                    "text/event-stream"
                ):
                    body = response.read()
                    return Outcome(
                        response.status_code,
                        headers,
                        to_text(body),
                        verdict=classify(response.status_code, body=to_text(body)),
                    )
                base64_mode = response.headers.get("stream-sse-data-encoding", "").lower() == "base64"
                # Every event of one read is stamped with that read's time: they arrived together
                # (the checker takes events of one time as sent together: operations/reads.py).
                arrived = [self.clock()]
                parser = SseParser(base64_mode, lambda: arrived[0])
                partial = False
                try:
                    for data in response.iter_raw():
                        arrived[0] = self.clock()
                        parser.feed(data)
                        if parser.closed or self.clock() >= deadline:
                            break
                except httpx.ReadTimeout:
                    pass  # nothing new within our patience: we stop reading
                except httpx.HTTPError as error:
                    partial = True  # the server went away mid-stream
                    headers["x-torture-error"] = type(error).__name__
                return Outcome(200, headers, "", parser.chunks, verdict=classify(200), partial=partial)
        except httpx.HTTPError as error:
            kind = _error_kind(error)
            return Outcome(None, error=f"{kind}: {type(error).__name__}", verdict=classify(None, kind))

    # ---- raw sockets ------------------------------------------------------------------------

    def _request_bytes(self, call: Call) -> tuple[bytes, bytes]:
        target = call.path + ("?" + urlencode(call.query) if call.query else "")
        body = to_bytes(call.body)
        lines = [f"{call.method} {target} HTTP/1.1", f"Host: {self.host}:{self.port}", "Connection: close"]
        lines += [f"{k}: {v}" for k, v in call.headers.items()]
        if body or call.method in ("POST", "PUT"):
            lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode(), body

    def _raw(self, call: Call) -> Outcome:
        head, body = self._request_bytes(call)
        try:
            sock = socket.create_connection((self.host, self.port), timeout=2.0)
        except OSError as error:
            return Outcome(None, error=f"refused: {error}", verdict=classify(None, "refused"))
        try:
            if call.mode == "cut_body":
                sock.sendall(head + body[: max(1, len(body) // 2)])
                time.sleep(0.05)
                _reset(sock)
                return Outcome(None, error="body_cut", verdict=classify(None, "body_cut"))
            sock.sendall(head + body)
            if call.mode == "send_and_vanish":
                _reset(sock)
                return Outcome(None, error="vanished", verdict=classify(None, "vanished"))
            received, complete = self._receive(sock, call)
        except OSError as error:
            _reset(sock)
            kind = "timeout" if isinstance(error, TimeoutError | socket.timeout) else "closed"
            return Outcome(None, error=f"{kind}: {error}", verdict=classify(None, kind))
        outcome = parse_http_response(received, self.clock)
        outcome.partial = outcome.partial or not complete
        return outcome

    def _receive(self, sock: socket.socket, call: Call) -> tuple[bytes, bool]:
        """The answer's bytes, and whether the server finished it (EOF) before we stopped."""
        received = b""
        if call.mode == "vanish":
            sock.settimeout(3.0)
            while len(received) < call.limit:
                try:
                    data = sock.recv(max(1, int(call.limit) - len(received)))
                except TimeoutError:
                    break
                if not data:
                    return received, True
                received += data
            _reset(sock)
            return received, False
        deadline = time.monotonic() + call.limit  # slow: a byte at a time, for so long
        sock.settimeout(5.0)
        while time.monotonic() < deadline:
            data = sock.recv(1)
            if not data:
                sock.close()
                return received, True
            received += data
            time.sleep(0.0005)
        _reset(sock)
        return received, False


def _reset(sock: socket.socket) -> None:
    """Closes with RST instead of FIN: a client that vanished."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def parse_http_response(data: bytes, clock: Callable[[], float]) -> Outcome:
    """Whatever arrived of an HTTP/1.1 answer: status, headers, the body so far (chunked framing
    undone), and for event streams the complete events."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        return Outcome(None, error="closed: no complete head", verdict=classify(None, "closed"), partial=True)
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return Outcome(
            None, error=f"closed: bad status line {lines[0][:60]!r}", verdict=classify(None, "closed")
        )
    pairs = [tuple(x.strip() for x in line.split(":", 1)) for line in lines[1:] if ":" in line]
    all_headers = {k.lower(): v for k, v in pairs}
    body, complete = rest, True
    if all_headers.get("transfer-encoding", "").lower() == "chunked":
        body, complete = _dechunk(rest)
    elif "content-length" in all_headers:
        complete = len(rest) >= int(all_headers["content-length"])
        body = rest[: int(all_headers["content-length"])]
    outcome = Outcome(status, keep_headers(pairs), verdict=classify(status), partial=not complete)  # type: ignore[arg-type]
    if all_headers.get("content-type", "").startswith("text/event-stream"):
        parser = SseParser(all_headers.get("stream-sse-data-encoding", "").lower() == "base64", clock)
        parser.feed(body)
        outcome.chunks = parser.chunks
    else:
        outcome.body = to_text(body)
    return outcome


def _dechunk(data: bytes) -> tuple[bytes, bool]:
    out = b""
    while True:
        size_line, sep, rest = data.partition(b"\r\n")
        if not sep:
            return out, False
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            return out, False
        if size == 0:
            return out, True
        if len(rest) < size + 2:
            return out, False
        out += rest[:size]
        data = rest[size + 2 :]
