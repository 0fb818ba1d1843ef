"""Clients that hang up mid-request are not errors of ours: no ERROR line, no traceback, no leaked
descriptor; a genuine failure of a connection is still logged with its traceback (issue 11)."""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import h2.config
import h2.connection
import httpx
import pytest
import trio

from ops.run_conformance import make_certificates
from ops.serverproc import ServerProcess, start
from streamkeep.http.accept import serve_connection
from streamkeep.http.edge import Connections, EdgeLimits, hung_up
from tests.conftest import assert_alive
from tests.mounts import open_fds

T = {"Content-Type": "text/plain"}
REQUESTS = {
    "mid-headers": b"POST /v1/stream/s HTTP/1.1\r\nHost: x\r\nContent-Ty",
    "mid-body": b"POST /v1/stream/s HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n\r\nabc",
    "awaiting an append": b"POST /v1/stream/s HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n\r\nabc",
    "long-poll": b"GET /v1/stream/s?offset=now&live=long-poll HTTP/1.1\r\nHost: x\r\n\r\n",
    "sse": b"GET /v1/stream/s?offset=-1&live=sse HTTP/1.1\r\nHost: x\r\n\r\n",
    "large catch-up": b"GET /v1/stream/s?offset=-1 HTTP/1.1\r\nHost: x\r\n\r\n",
}


@pytest.fixture(scope="module", params=["lean", "quart"])
def servers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess, Path]]:
    ca, cert, key = make_certificates(tmp_path_factory.mktemp("tls"))
    common = (
        "--storage",
        "memory",
        "--edge",
        request.param,
        "--long-poll-timeout",
        "3",
        "--sse-close-after",
        "3",
    )
    plain = start(*common)
    tls = start(*common, "--tls-cert", str(cert), "--tls-key", str(key))
    for server, verify in ((plain, True), (tls, ssl.create_default_context(cafile=str(ca)))):
        with httpx.Client(base_url=server.url, verify=verify) as client:
            client.put("/v1/stream/s", headers=T)
            for _ in range(60):  # enough that a catch-up is still being written when the client goes
                client.post("/v1/stream/s", content=b"x" * 20_000, headers=T)
    yield plain, tls, ca
    plain.stop()
    tls.stop()


def address(server: ServerProcess) -> tuple[str, int]:
    host, port = server.url.split("//")[1].rsplit(":", 1)
    return host, int(port)


def reset(sock: socket.socket) -> None:
    """Closes with a TCP reset (SO_LINGER 0), as a client that crashes or loses its network."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def quiet(server: ServerProcess, since: int) -> list[str]:
    return [line for line in server.output[since:] if " ERROR " in line or "Traceback" in line]


def tls_socket(server: ServerProcess, ca: Path, alpn: str) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols([alpn])
    raw = socket.create_connection(address(server))
    return context.wrap_socket(raw, server_hostname="localhost")


def test_http11_clients_hanging_up_anywhere_log_nothing(
    servers: tuple[ServerProcess, ServerProcess, Path],
) -> None:
    plain, tls, ca = servers
    for server in (plain, tls):
        since = len(server.output)
        before = open_fds(server.process.pid)[0]
        for _name, request in REQUESTS.items():
            for _ in range(20):
                sock = (
                    socket.create_connection(address(server))
                    if server is plain
                    else tls_socket(server, ca, "http/1.1")
                )
                sock.sendall(request)
                time.sleep(0.01)
                reset(sock)
        # Live reads end at the latest when their timeouts pass (3 s here): then every one of
        # the 120 connections is gone, with its descriptor.
        deadline = time.monotonic() + 20
        while open_fds(server.process.pid)[0] > before + 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert open_fds(server.process.pid)[0] <= before + 5
        assert quiet(server, since) == [], "".join(server.output[since:])[-3000:]
    assert_alive(plain)


def h2_request(sock: socket.socket, path: str) -> h2.connection.H2Connection:
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    stream_id = connection.get_next_available_stream_id()
    connection.send_headers(
        stream_id,
        [(":method", "GET"), (":path", path), (":scheme", "https"), (":authority", "localhost")],
        end_stream=True,
    )
    sock.sendall(connection.data_to_send())
    sock.recv(65536)  # the server's settings, maybe data
    return connection


@pytest.mark.parametrize("ending", ["rst_stream", "goaway", "tcp reset"])
def test_h2_clients_hanging_up_log_nothing(
    servers: tuple[ServerProcess, ServerProcess, Path], ending: str
) -> None:
    _, tls, ca = servers
    since = len(tls.output)
    for path in (
        "/v1/stream/s?offset=-1&live=sse",
        "/v1/stream/s?offset=-1",
        "/v1/stream/s?offset=now&live=long-poll",
    ):
        for _ in range(10):
            sock = tls_socket(tls, ca, "h2")
            connection = h2_request(sock, path)
            if ending == "rst_stream":
                connection.reset_stream(1)
                sock.sendall(connection.data_to_send())
                sock.close()
            elif ending == "goaway":
                connection.close_connection()
                sock.sendall(connection.data_to_send())
                sock.close()
            else:
                reset(sock)
    time.sleep(1.5)
    assert quiet(tls, since) == [], "".join(tls.output[since:])[-3000:]


def test_hang_ups_are_told_apart_from_failures() -> None:
    assert hung_up(trio.BrokenResourceError("reset"))
    assert hung_up(ExceptionGroup("both tasks", [trio.BrokenResourceError(), ConnectionResetError()]))
    assert not hung_up(ExceptionGroup("mixed", [trio.BrokenResourceError(), RuntimeError("a bug")]))
    assert not hung_up(KeyError("a bug"))


async def test_a_genuine_connection_failure_is_still_logged(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        """A connection whose reads fail with something that is not the peer going away."""

        async def receive_some(self, max_bytes: int | None = None) -> bytes:
            raise RuntimeError("a bug in the edge")

        async def send_all(self, data: bytes) -> None:
            pass

        async def aclose(self) -> None:
            pass

    limits = EdgeLimits(max_body_bytes=1 << 20, body_timeout=5.0, h2_max_concurrent_streams=10, budget=None)  # type: ignore[arg-type]
    with caplog.at_level(logging.DEBUG, logger="streamkeep.http.accept"):
        await serve_connection(Broken(), None, limits, Connections(), None)  # type: ignore[arg-type]
    failures = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert (
        failures and failures[0].exc_info is not None and "a bug in the edge" in str(failures[0].exc_info[1])
    )
