"""Plain TCP read and written by the lean edge itself, not through trio's SocketStream.

trio's `receive_some` tries the call first and yields around it; after our answer the client's
next request is almost never there yet, so that first try failed on every request. Waiting for
readability, then reading, costs one checkpoint; writing an answer the kernel takes whole costs
none (docs/benchmarks.md, "Where an append's microseconds go"). TLS streams go through trio.
"""

from __future__ import annotations

import os

import trio

READ_SIZE = 65536


async def receive(stream: trio.abc.Stream, fd: int | None) -> bytes:
    """The next bytes from the peer (b"" at its end): from `fd` directly when given."""
    if fd is None:
        return bytes(await stream.receive_some(READ_SIZE))  # bytes already: bytes() keeps it
    while True:
        await trio.lowlevel.wait_readable(fd)
        try:
            return os.read(fd, READ_SIZE)  # the socket is non-blocking
        except BlockingIOError:
            continue  # woken without data (rare): wait again


def write_now(fd: int, data: bytes | bytearray) -> int:
    """How much of `data` the kernel took at once (0 if its buffer is full); never waits."""
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0
