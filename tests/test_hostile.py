"""Hostile and broken clients: every answer is a clear 4xx, never a 500, and the server lives on."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from ops.serverproc import ServerProcess
from tests.conftest import assert_alive

LIMIT = 1 << 20  # the --max-body-bytes the test server runs with


def raw_exchange(
    server: ServerProcess, payload: bytes, *, pause: float = 0.0, read_timeout: float = 5
) -> bytes:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=read_timeout) as sock:
        sock.sendall(payload)
        if pause:
            time.sleep(pause)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
                if b"\r\n\r\n" in b"".join(chunks):
                    break
        except (TimeoutError, ConnectionResetError):
            pass
    return b"".join(chunks)


def status_line(reply: bytes) -> str:
    return reply.split(b"\r\n", 1)[0].decode("latin-1")


@pytest.mark.parametrize(
    "path",
    [
        "/v1/stream/a/../../etc/passwd",
        "/v1/stream/..%2F..%2Fetc",
        "/v1/stream/%2e%2e/x",
        "/v1/stream/a%00b",
        "/v1/stream/%FF%FE",
        "/v1/stream/a//b",
        "/v1/stream/" + "n" * 5000,
    ],
)
def test_stream_names_that_could_escape_are_rejected(
    client: httpx.Client, server: ServerProcess, path: str
) -> None:
    for method in ("PUT", "POST", "GET", "HEAD", "DELETE"):
        response = client.request(method, path, headers={"Content-Type": "text/plain"}, content=b"x")
        assert 400 <= response.status_code < 500, (method, path, response.status_code)
    assert_alive(server)


@pytest.mark.parametrize(
    ("params", "headers"),
    [
        ({"offset": "zzzz"}, {}),
        ({"offset": "0" * 300}, {}),
        ({"offset": "ffffffffffffffff"}, {}),
        ({"offset": ["-1", "-1"]}, {}),
        ({"offset": "-1", "live": "websocket"}, {}),
        ({"live": "long-poll"}, {}),
        ({"live": "sse"}, {}),
        ({"offset": "-1", "cursor": "9" * 400, "live": "long-poll"}, {"If-None-Match": '"' * 200}),
    ],
)
def test_malformed_reads_are_4xx(client: httpx.Client, stream_url: str, params: dict, headers: dict) -> None:
    client.put(stream_url, headers={"Content-Type": "text/plain"})
    response = client.get(stream_url, params=params, headers=headers)
    assert response.status_code in (200, 204, 400), response.status_code
    if response.status_code == 400:
        assert response.json()["error"]["message"]


@pytest.mark.parametrize(
    "headers",
    [
        {"Producer-Id": "p", "Producer-Epoch": "1e3", "Producer-Seq": "0"},
        {"Producer-Id": "p", "Producer-Epoch": "99999999999999999999", "Producer-Seq": "0"},
        {"Producer-Id": "p"},
        {"Stream-Seq": b"\xff" * 10},
        {"Content-Type": "not a type"},
        {"Content-Type": ""},
    ],
)
def test_malformed_append_headers_are_4xx(client: httpx.Client, stream_url: str, headers: dict) -> None:
    client.put(stream_url, headers={"Content-Type": "text/plain"})
    response = client.post(stream_url, content=b"x", headers={"Content-Type": "text/plain", **headers})
    assert 200 <= response.status_code < 500 and response.status_code != 500
    assert client.get(stream_url, params={"offset": "-1"}).status_code == 200


def test_body_past_the_limit_is_413_and_nothing_is_stored(client: httpx.Client, stream_url: str) -> None:
    client.put(stream_url, headers={"Content-Type": "application/octet-stream"})
    response = client.post(
        stream_url, content=b"x" * (LIMIT + 1), headers={"Content-Type": "application/octet-stream"}
    )
    assert response.status_code == 413 and "at most" in response.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit must trip while reading
        for _ in range(LIMIT // 65536 + 2):
            yield b"y" * 65536

    streamed = client.post(
        stream_url, content=chunked(), headers={"Content-Type": "application/octet-stream"}
    )
    assert streamed.status_code == 413
    assert client.get(stream_url, params={"offset": "-1"}).content == b""


def test_huge_headers_are_refused_without_harm(server: ServerProcess) -> None:
    reply = raw_exchange(
        server, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"
    )
    assert not reply or status_line(reply).split()[1].startswith("4")
    assert_alive(server)


@pytest.mark.parametrize(
    "payload",
    [
        b"\x00\x01\x02garbage\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"POST /v1/stream/x HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"POST /v1/stream/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 64,
        b"GET /v1/stream/\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
)
def test_garbage_on_the_wire_never_takes_the_server_down(server: ServerProcess, payload: bytes) -> None:
    reply = raw_exchange(server, payload, read_timeout=3)
    if reply.startswith(b"HTTP/1.1"):
        assert status_line(reply).split()[1] != "500"
    assert_alive(server)


def test_slow_body_times_out_with_408(server: ServerProcess, stream_url: str) -> None:
    httpx.put(f"{server.url}{stream_url}", headers={"Content-Type": "text/plain"})
    head = (
        f"POST {stream_url} HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n\r\nab"
    ).encode()
    reply = raw_exchange(server, head, read_timeout=8)  # the server's --body-timeout is 2 s
    assert status_line(reply).split()[1] == "408"
    assert httpx.get(f"{server.url}{stream_url}?offset=-1").content == b""
    assert_alive(server)


def test_unknown_method_is_405(client: httpx.Client, stream_url: str) -> None:
    response = client.request("PATCH", stream_url)
    assert response.status_code == 405 and "allow" in response.headers


def test_h2_body_after_early_answer_does_not_crash(server: ServerProcess, tmp_path: Path) -> None:
    """Regression: DATA after the response (413 here) used to kill hypercorn's trio worker."""
    big = tmp_path / "big"
    big.write_bytes(b"z" * (2 * LIMIT))
    for _ in range(3):
        result = subprocess.run(
            [
                "curl",
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--http2-prior-knowledge",
                "--data-binary",
                f"@{big}",
                f"{server.url}/v1/stream/missing",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.stdout == "413"
    assert_alive(server)


def test_no_request_above_ever_logged_a_traceback(server: ServerProcess) -> None:
    output = "".join(server.output)
    assert "Traceback" not in output, output[output.find("Traceback") - 500 :][:4000]


def test_http11_status_lines_carry_reason_phrases(server: ServerProcess) -> None:
    reply = raw_exchange(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_line(reply) == "HTTP/1.1 200 OK"
    reply = raw_exchange(server, b"GET /v1/stream/absent HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_line(reply) == "HTTP/1.1 404 Not Found"


@pytest.mark.parametrize("edge", ["lean", "quart"])
def test_bodies_in_flight_are_capped_server_wide(edge: str) -> None:
    """Three clients each half-send a large body: the one that would pass the cap gets 503 at once."""
    from ops.serverproc import start

    server = start(
        "--storage",
        "memory",
        "--edge",
        edge,
        "--max-body-bytes",
        "1MiB",
        "--max-inflight-body-bytes",
        "2MiB",
        "--body-timeout",
        "20",
    )
    try:
        httpx.put(f"{server.url}/v1/stream/budget", headers={"Content-Type": "application/octet-stream"})
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        head = (
            b"POST /v1/stream/budget HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
            b"Content-Length: 1000000\r\n\r\n"
        )
        held = []
        for _ in range(2):
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(head + b"a" * 900_000)  # most of a body, then silence
            held.append(sock)
        time.sleep(0.5)
        third = socket.create_connection((host, int(port)), timeout=10)
        third.sendall(head + b"b" * 900_000)
        reply = third.recv(65536)
        assert status_line(reply).split()[1] == "503" and b"retry-after: 1" in reply.lower()
        third.close()
        for sock in held:
            sock.close()
        time.sleep(0.5)  # the held bodies are released when their connections end
        ok = httpx.post(
            f"{server.url}/v1/stream/budget",
            content=b"c" * 900_000,
            headers={"Content-Type": "application/octet-stream"},
        )
        assert ok.status_code == 204
        assert_alive(server)
    finally:
        server.stop()


def test_http2_bodies_return_their_budget() -> None:
    """Hundreds of h2c bodies through a 2 MiB budget: any leak would turn into 503s within 20."""
    from ops.serverproc import start

    server = start("--storage", "memory", "--max-body-bytes", "1MiB", "--max-inflight-body-bytes", "2MiB")
    try:
        with httpx.Client(base_url=server.url, http1=False, http2=True, timeout=10) as client:
            client.put("/v1/stream/h2budget", headers={"Content-Type": "application/octet-stream"})
            statuses = {
                client.post(
                    "/v1/stream/h2budget",
                    content=b"z" * 100_000,
                    headers={"Content-Type": "application/octet-stream"},
                ).status_code
                for _ in range(300)
            }
            too_big = client.post(
                "/v1/stream/h2budget",
                content=b"z" * 2_000_000,
                headers={"Content-Type": "application/octet-stream"},
            )
            after = client.post(
                "/v1/stream/h2budget",
                content=b"z" * 100_000,
                headers={"Content-Type": "application/octet-stream"},
            )
        assert statuses == {204} and too_big.status_code == 413 and after.status_code == 204
    finally:
        server.stop()


def test_an_endless_header_line_is_cut_off_at_the_head_limit(server: ServerProcess) -> None:
    """A header value that never ends must not be buffered without bound (431, then close)."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        sent = 0
        reply = b""
        try:
            while sent < 8 << 20:  # 8 MiB of one header value, far past the 64 KiB head limit
                sock.sendall(b"a" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            reply = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            pass
    assert sent < 8 << 20 or reply.startswith(b"HTTP/1.1 4"), "the server kept reading one header line"
    assert_alive(server)


def test_slow_h2_bodies_time_out_with_408_and_fast_ones_still_pass(
    server: ServerProcess, stream_url: str
) -> None:
    """h2c: bodies that stall past --body-timeout (2 s here) get 408 on their own stream, while
    complete requests on the same connection are answered as usual."""
    import h2.config
    import h2.connection
    import h2.events

    httpx.put(f"{server.url}{stream_url}", headers={"Content-Type": "text/plain"})
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    request = [
        (":method", "POST"),
        (":scheme", "http"),
        (":authority", "x"),
        (":path", stream_url),
        ("content-type", "text/plain"),
    ]
    statuses: dict[int, str] = {}
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for stream_id in (1, 3, 5):  # three bodies that never finish
            conn.send_headers(stream_id, request)
            conn.send_data(stream_id, b"partial")
        conn.send_headers(7, request)
        conn.send_data(7, b"whole", end_stream=True)
        sock.sendall(conn.data_to_send())
        deadline = time.monotonic() + 8
        while len(statuses) < 4 and time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    statuses[event.stream_id] = dict(event.headers)[":status"]
            sock.sendall(conn.data_to_send())
    assert statuses == {1: "408", 3: "408", 5: "408", 7: "204"}
    assert httpx.get(f"{server.url}{stream_url}?offset=-1").content == b"whole"
    assert_alive(server)
