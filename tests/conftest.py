"""Fixtures: real `streamkeep serve` processes on free loopback ports, and httpx clients for them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ops.run_conformance import make_certificates
from ops.serverproc import ServerProcess, start
from streamkeep.segments import layout

FAST = [
    "--storage",
    "memory",
    "--long-poll-timeout",
    "1",
    "--sse-close-after",
    "5",
    "--max-body-bytes",
    "1MiB",
    "--body-timeout",
    "2",
]
_names = itertools.count()


@pytest.fixture(scope="session", params=["lean", "quart"])
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """The server, once per HTTP edge: every HTTP test runs against both."""
    process = start(*FAST, "--edge", request.param)
    yield process
    process.stop()


@pytest.fixture(scope="session", params=["lean", "quart"])
def tls_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, Path]]:
    ca, cert, key = make_certificates(tmp_path_factory.mktemp("tls"))
    process = start(*FAST, "--tls-cert", str(cert), "--tls-key", str(key), "--edge", request.param)
    yield process, ca
    process.stop()


@pytest.fixture(params=["http/1.1", "h2c"])
def client(request: pytest.FixtureRequest, server: ServerProcess) -> Iterator[httpx.Client]:
    """A client over HTTP/1.1, and the same over HTTP/2 with prior knowledge (h2c)."""
    h2 = request.param == "h2c"
    with httpx.Client(base_url=server.url, http1=not h2, http2=h2, timeout=10) as c:
        yield c


@pytest.fixture
def stream_url() -> str:
    return f"/v1/stream/test-{next(_names)}-{id(object())}"


def assert_alive(server: ServerProcess) -> None:
    assert server.alive, "server died:\n" + "".join(server.output[-50:])
    response = httpx.get(f"{server.url}/healthz", timeout=5)
    assert response.status_code == 200 and response.text == "ok"


def segment_files(data_dir: Path, name: str) -> list[Path]:
    """A stream's local segment files under a data directory, in stream order."""
    return sorted((data_dir / layout.STREAMS / layout.stream_dirname(name)).glob("*" + layout.SEGMENT_SUFFIX))


@pytest.fixture(params=[""], ids=["no-secret"])
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """Two members (a, b) on disk storage behind a real HAProxy (tests/test_cluster.py's Cluster);
    `@pytest.mark.parametrize("cluster", [SECRET], indirect=True)` gives them a cluster secret."""
    from tests.test_cluster import HAPROXY, Cluster

    assert Path(HAPROXY).exists(), (
        "haproxy is missing: make system-tools installs it (apt-get install haproxy)"
    )
    built = Cluster(tmp_path, request.param)
    try:
        built.start_member("a")
        built.start_member("b")
        built.start_haproxy()
        yield built
    finally:
        built.stop()
