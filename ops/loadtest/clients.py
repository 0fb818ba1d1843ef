"""Bare HTTP/1.1 client loops for what h2load cannot do: idempotent producers (a new Producer-Seq
on every request) and catch-up reads that follow Stream-Next-Offset. Plain sockets and a small
response parser, so the client costs a few microseconds per request."""

from __future__ import annotations

import select
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from ops.loadtest.subscribers import dechunk


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


def parse(buffer: bytearray) -> tuple[Response, int] | None:
    """One whole response at the start of `buffer` and its length, or None if more must arrive."""
    head_end = buffer.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    lines = bytes(buffer[:head_end]).decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    start = head_end + 4
    if "content-length" in headers:
        end = start + int(headers["content-length"])
        if len(buffer) < end:
            return None
        return Response(status, headers, bytes(buffer[start:end])), end
    if headers.get("transfer-encoding") == "chunked":
        body, end = dechunk(bytes(buffer), start)
        return None if end < 0 else (Response(status, headers, body), end)
    return Response(status, headers, b""), start


def open_socket(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def exchange(sock: socket.socket, buffer: bytearray, data: bytes) -> Response:
    sock.sendall(data)
    while True:
        parsed = parse(buffer)
        if parsed is not None:
            response, used = parsed
            del buffer[:used]
            return response
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("server closed the connection")
        buffer += chunk


def catch_up(url: str, path: str) -> tuple[int, float]:
    """Reads a whole stream from the start; returns (bytes, seconds)."""
    sock = open_socket(url)
    buffer = bytearray()
    offset, total = "-1", 0
    started = time.perf_counter()
    while True:
        response = exchange(sock, buffer, f"GET {path}?offset={offset} HTTP/1.1\r\nHost: lt\r\n\r\n".encode())
        if response.status != 200:
            raise RuntimeError(f"catch-up read answered {response.status}")
        total += len(response.body)
        offset = response.headers["stream-next-offset"]
        if response.headers.get("stream-up-to-date") == "true":
            break
    elapsed = time.perf_counter() - started
    sock.close()
    return total, elapsed


def producers(url: str, path: str, count: int, seconds: float) -> tuple[int, int]:
    """`count` idempotent producers append to one stream, each its own connection and sequence;
    returns (acknowledged appends, duplicates reported)."""
    socks = [open_socket(url) for _ in range(count)]
    for sock in socks:
        sock.setblocking(False)
    poll = select.epoll()
    state = {}
    run = int(time.time() * 1000) % 1_000_000

    def send(fd: int) -> None:
        sock, seq, _ = state[fd]
        body = b'{"producer": %d, "seq": %d}' % (fd, seq)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: lt\r\nContent-Type: application/json\r\n"
            f"Producer-Id: lt-{run}-{fd}\r\nProducer-Epoch: 0\r\nProducer-Seq: {seq}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock.send(head + body)

    for sock in socks:
        state[sock.fileno()] = (sock, 0, bytearray())
        poll.register(sock.fileno(), select.EPOLLIN)
        send(sock.fileno())
    acked = duplicates = 0
    end_at = time.monotonic() + seconds
    while time.monotonic() < end_at:
        for fd, _ in poll.poll(0.2):
            sock, seq, buffer = state[fd]
            buffer += sock.recv(65536)
            parsed = parse(buffer)
            if parsed is None:
                continue
            response, used = parsed
            del buffer[:used]
            if response.status == 204:
                duplicates += 1
            elif response.status != 200:
                raise RuntimeError(f"producer append answered {response.status}: {response.body[:200]!r}")
            acked += 1
            state[fd] = (sock, seq + 1, buffer)
            send(fd)
    for sock in socks:
        sock.close()
    return acked, duplicates
