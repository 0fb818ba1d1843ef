"""Many live readers of one stream in one process: a bare epoll loop, so the client is not the bottleneck.

    python -m ops.loadtest.subscribers URL PATH --count N --mode sse|long-poll --offset OFFSET --out FILE

The stream holds JSON messages {"i": n, "t": send time}; {"i": -1} ends the run. Each reader
records when its bytes arrived and parses them only afterwards, so the loop does nothing but
recv. It prints "ready" once every reader is connected (SSE: has its first event) and writes, per
reader, the message numbers it got in order and the delay of each, as JSON to FILE.
"""

from __future__ import annotations

import argparse
import bisect
import errno
import json
import resource
import select
import socket
import sys
import time
from urllib.parse import urlsplit

END = b'"i":-1'


class Reader:
    __slots__ = ("buffer", "chunks", "done", "offset", "pending", "responses", "sock")

    def __init__(self, sock: socket.socket, offset: str) -> None:
        self.sock = sock
        self.chunks: list[tuple[float, bytes]] = []  # SSE: raw bytes as they came
        self.buffer = b""  # long-poll: the response being read
        self.responses: list[tuple[float, bytes]] = []  # long-poll: (arrival, body)
        self.offset = offset
        self.done = False
        self.pending = False


def connect_all(host: str, port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for attempt in range(50):
            try:
                sock.connect((host, port))
                break
            except OSError as error:  # a full accept queue: back off and retry
                if error.errno not in (errno.ECONNREFUSED, errno.EAGAIN, errno.ETIMEDOUT) or attempt == 49:
                    raise
                time.sleep(0.05)
        sock.setblocking(False)
        socks.append(sock)
    return socks


def request(path: str, offset: str, mode: str) -> bytes:
    return f"GET {path}?offset={offset}&live={mode} HTTP/1.1\r\nHost: loadtest\r\n\r\n".encode()


def run(url: str, path: str, count: int, mode: str, offset: str, deadline: float) -> list[Reader]:
    parts = urlsplit(url)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks = connect_all(parts.hostname or "127.0.0.1", parts.port or 80, count)
    readers = {sock.fileno(): Reader(sock, offset) for sock in socks}
    poll = select.epoll()
    for fd, reader in readers.items():
        reader.sock.send(request(path, offset, mode))
        poll.register(fd, select.EPOLLIN)
    waiting = set(readers) if mode == "sse" else set()
    if mode == "long-poll":
        time.sleep(0.5)  # no bytes come before data; give the server time to park every poll
        print("ready", flush=True)
    open_readers = len(readers)
    end_at = time.monotonic() + deadline
    while open_readers and time.monotonic() < end_at:
        for fd, _ in poll.poll(0.5):
            reader = readers[fd]
            try:
                data = reader.sock.recv(262144)
            except BlockingIOError:
                continue
            except ConnectionError:
                data = b""
            now = time.time()
            if not data:
                poll.unregister(fd)
                open_readers -= 1
                continue
            if mode == "sse":
                reader.chunks.append((now, data))
                if waiting:
                    waiting.discard(fd)
                    if not waiting:
                        print("ready", flush=True)
                if END in data or (len(reader.chunks) > 1 and END in reader.chunks[-2][1][-16:] + data[:16]):
                    reader.done = True
                    poll.unregister(fd)
                    open_readers -= 1
            else:
                if long_poll_received(reader, data, now, path):
                    poll.unregister(fd)
                    open_readers -= 1
    return list(readers.values())


def long_poll_received(reader: Reader, data: bytes, now: float, path: str) -> bool:
    """Collects one response; sends the next poll from its Stream-Next-Offset. True when done."""
    reader.buffer += data
    while True:
        head_end = reader.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return False
        head = reader.buffer[:head_end].decode("latin-1").lower()
        fields = dict(line.split(":", 1) for line in head.split("\r\n")[1:] if ":" in line)
        status = int(head.split(" ", 2)[1])
        body_start = head_end + 4
        if "content-length" in fields:
            end = body_start + int(fields["content-length"])
            if len(reader.buffer) < end:
                return False
            body = reader.buffer[body_start:end]
        elif fields.get("transfer-encoding", "").strip() == "chunked":
            body, end = dechunk(reader.buffer, body_start)
            if end < 0:
                return False
        else:
            body, end = b"", body_start
        reader.buffer = reader.buffer[end:]
        if status == 200:
            reader.responses.append((now, body))
            if END in body:
                reader.done = True
                return True
        elif status != 204:
            raise RuntimeError(f"long-poll answered {status}")
        reader.offset = fields["stream-next-offset"].strip()
        reader.sock.send(request(path, reader.offset, "long-poll"))


def dechunk(buffer: bytes, start: int) -> tuple[bytes, int]:
    """A whole chunked body from `start`, and where it ends; (b"", -1) if it has not all arrived."""
    out = bytearray()
    position = start
    while True:
        line_end = buffer.find(b"\r\n", position)
        if line_end < 0:
            return b"", -1
        size = int(buffer[position:line_end].split(b";")[0], 16)
        if size == 0:
            trailer_end = buffer.find(b"\r\n", line_end + 2)
            return (bytes(out), trailer_end + 2) if trailer_end >= 0 else (b"", -1)
        data_start = line_end + 2
        if len(buffer) < data_start + size + 2:
            return b"", -1
        out += buffer[data_start : data_start + size]
        position = data_start + size + 2


def sse_messages(chunks: list[tuple[float, bytes]]) -> list[tuple[int, float, float]]:
    """(i, sent, arrived) for every message in an SSE response's raw bytes (chunked or not)."""
    raw = b"".join(data for _, data in chunks)
    ends, times = [], []
    total = 0
    for arrived, data in chunks:
        total += len(data)
        ends.append(total)
        times.append(arrived)
    head_end = raw.find(b"\r\n\r\n")
    head = raw[:head_end].lower()
    body_start = head_end + 4
    # Map each body byte back to the raw position it came from, to know when it arrived.
    pieces: list[tuple[int, int]] = []  # (body offset, raw offset) at the start of each piece
    body = bytearray()
    if b"transfer-encoding: chunked" in head:
        position = body_start
        while True:
            line_end = raw.find(b"\r\n", position)
            if line_end < 0:
                break
            size = int(raw[position:line_end].split(b";")[0] or b"0", 16)
            if size == 0:
                break
            pieces.append((len(body), line_end + 2))
            body += raw[line_end + 2 : line_end + 2 + size]
            position = line_end + 2 + size + 2
    else:
        pieces.append((0, body_start))
        body += raw[body_start:]
    starts = [p[0] for p in pieces]
    text = bytes(body)
    found = []
    position = 0
    while True:
        event_end = text.find(b"\n\n", position)
        if event_end < 0:
            break
        block = text[position:event_end]
        position = event_end + 2
        if not block.startswith(b"event: data") and not block.startswith(b"event:data"):
            continue
        piece = bisect.bisect_right(starts, event_end) - 1
        raw_end = pieces[piece][1] + (event_end - pieces[piece][0])
        arrived = times[bisect.bisect_left(ends, raw_end + 1)]
        payload = b"\n".join(
            line[5:].lstrip(b" ") if line.startswith(b"data:") else b"" for line in block.split(b"\n")[1:]
        )
        for message in json.loads(payload):
            found.append((message["i"], message["t"], arrived))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("url")
    parser.add_argument("path")
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--mode", choices=("sse", "long-poll"), required=True)
    parser.add_argument("--offset", required=True)
    parser.add_argument("--deadline", type=float, default=120.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    readers = run(args.url, args.path, args.count, args.mode, args.offset, args.deadline)
    print("done", flush=True)  # before closing: the server's CPU for the run excludes the hang-ups
    results = []
    for reader in readers:
        if args.mode == "sse":
            got = sse_messages(reader.chunks)
        else:
            got = [
                (message["i"], message["t"], arrived)
                for arrived, body in reader.responses
                for message in json.loads(body)
            ]
        results.append({"done": reader.done, "i": [g[0] for g in got], "delay": [g[2] - g[1] for g in got]})
        reader.sock.close()
    with open(args.out, "w") as out:
        json.dump(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
