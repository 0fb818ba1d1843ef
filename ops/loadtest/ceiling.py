"""The ceiling: a bare trio loop driving h11 (HTTP/1.1) or h2 (h2c) with no app (every request -> 204).

    python -m ops.loadtest.ceiling [--port 0]

No routing, no protocol rules, no storage, no limits or timeouts: what a trio server built on the
well-known sans-I/O libraries costs per request before it does anything. streamkeep's memory-mode
appends are compared with it (issue 7: at least 60 %).
"""

from __future__ import annotations

import argparse
import signal

import h2.config
import h2.connection
import h2.events
import h11
import trio

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# With --headers streamkeep, responses carry the headers a streamkeep append answers with, to tell
# what the h2 library spends on them (HPACK, frames) from what streamkeep spends elsewhere.
STREAMKEEP_HEADERS = [
    (b"stream-next-offset", b"0000000000000000_0000000000000001"),
    (b"access-control-allow-origin", b"*"),
    (
        b"access-control-expose-headers",
        b"Stream-Next-Offset, Stream-Cursor, Stream-Up-To-Date, Stream-Closed, Stream-TTL, Stream-Expires-At, "
        b"Stream-SSE-Data-Encoding, Producer-Epoch, Producer-Seq, Producer-Expected-Seq, Producer-Received-Seq, "
        b"ETag, Location, Content-Type, Retry-After",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"cross-origin-resource-policy", b"cross-origin"),
]
response_headers: list[tuple[bytes, bytes]] = []


async def serve_h11(stream: trio.SocketStream, first: bytes) -> None:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(first)
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(65536)
            if not data:
                return
            conn.receive_data(data)
        elif isinstance(event, h11.EndOfMessage):
            response = h11.Response(status_code=204, headers=response_headers, reason=b"No Content")
            await stream.send_all(conn.send(response) + conn.send(h11.EndOfMessage()))
            conn.start_next_cycle()
        elif isinstance(event, h11.ConnectionClosed):
            return


async def serve_h2(stream: trio.SocketStream, first: bytes) -> None:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    conn.initiate_connection()
    data = first
    while data:
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if isinstance(event, h2.events.StreamEnded):
                conn.send_headers(event.stream_id, [(b":status", b"204"), *response_headers], end_stream=True)
        await stream.send_all(conn.data_to_send())
        data = await stream.receive_some(65536)


async def serve(stream: trio.SocketStream) -> None:
    try:
        first = await stream.receive_some(65536)
        if first.startswith(PREFACE[: len(first)]) and first:
            await serve_h2(stream, first)
        else:
            await serve_h11(stream, first)
    except Exception:  # a client's mistake ends its connection, never the server
        pass


async def main(port: int) -> None:
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1", backlog=1024)
    url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    print(f"streamkeep listening on {url}", flush=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, serve, listeners)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                nursery.cancel_scope.cancel()
                return


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--headers", choices=("none", "streamkeep"), default="none")
    args = parser.parse_args()
    if args.headers == "streamkeep":
        response_headers[:] = STREAMKEEP_HEADERS
    trio.run(main, args.port)
