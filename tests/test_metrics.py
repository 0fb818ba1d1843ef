"""Operability over real sockets: /metrics in Prometheus' format (parsed by prometheus_client's own
parser) moving with appends, live readers and commit rounds; the access log; /readyz."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ops.serverproc import ServerProcess, start
from tests.conftest import FAST

JSON = {"Content-Type": "application/json"}


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum over every series of `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, series), v in samples.items() if n == name and wanted <= set(series))


@pytest.fixture(scope="module")
def disk_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    data = tmp_path_factory.mktemp("metrics-data")
    log = data.parent / "access.log"
    fast = [arg if arg != "memory" else "disk" for arg in FAST]
    process = start(*fast, "--data-dir", str(data), "--access-log", str(log), "--log-format", "json")
    yield process, log
    process.stop()


def test_metrics_move_with_appends_readers_and_commits(disk_server: tuple[ServerProcess, Path]) -> None:
    server, _ = disk_server
    before = scrape(server.url)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.put("/v1/stream/m/a", headers=JSON).status_code == 201
        for n in range(5):
            assert (
                client.post("/v1/stream/m/a", content=json.dumps({"n": n}).encode(), headers=JSON).status_code
                == 204
            )
        held = threading.Event()
        done = threading.Event()

        def long_poll() -> None:
            with httpx.Client(base_url=server.url, timeout=10) as reader:
                tail = reader.head("/v1/stream/m/a").headers["stream-next-offset"]
                held.set()
                reader.get(f"/v1/stream/m/a?offset={tail}&live=long-poll")
            done.set()

        thread = threading.Thread(target=long_poll)
        thread.start()
        held.wait(5)
        deadline = time.monotonic() + 5
        while True:  # the reader is waiting once the gauge says so
            during = scrape(server.url)
            if value(during, "streamkeep_live_readers", mode="long-poll") >= 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert value(during, "streamkeep_live_readers", mode="long-poll") >= 1
        thread.join(10)
    after = scrape(server.url)
    assert value(after, "streamkeep_appends_total") - value(before, "streamkeep_appends_total") == 5
    assert value(after, "streamkeep_appended_bytes_total") - value(
        before, "streamkeep_appended_bytes_total"
    ) == 5 * len(b'{"n": 0}')
    rounds = value(after, "streamkeep_commit_round_seconds_count") - value(
        before, "streamkeep_commit_round_seconds_count"
    )
    assert 1 <= rounds <= 6  # one round per append here (they came one by one), plus the create
    assert (
        value(after, "streamkeep_commit_round_records_sum")
        - value(before, "streamkeep_commit_round_records_sum")
        >= 5
    )
    assert value(after, "streamkeep_live_readers", mode="long-poll") == 0
    appends = total(after, "streamkeep_http_requests_total", method="POST", route="append", status="204")
    assert (
        appends - total(before, "streamkeep_http_requests_total", method="POST", route="append", status="204")
        == 5
    )
    assert total(after, "streamkeep_http_request_duration_seconds_count", route="live_read") >= 1
    assert value(after, "streamkeep_streams") >= 1
    assert value(after, "streamkeep_stored_bytes", tier="hot") > 0
    assert value(after, "streamkeep_disk_free_bytes") > 0
    assert value(after, "streamkeep_ready") == 1
    assert value(after, "streamkeep_process_resident_memory_bytes") > 0


def test_access_log_lines(disk_server: tuple[ServerProcess, Path]) -> None:
    server, log = disk_server
    marker = f"/v1/stream/logged-{time.monotonic_ns()}"
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.put(marker, headers=JSON).status_code == 201
        assert client.get(f"{marker}?offset=-1&token=super-secret-token").status_code == 200
        assert client.get(f"{marker}?offset=-1&%74oken=encoded-secret-token").status_code == 200
    deadline = time.monotonic() + 5
    lines: list[dict] = []
    while time.monotonic() < deadline:  # flushed once a second
        text = log.read_text() if log.exists() else ""
        lines = [json.loads(line) for line in text.splitlines() if marker in line]
        if len(lines) >= 2:
            break
        time.sleep(0.2)
    assert "super-secret-token" not in log.read_text() and "encoded-secret-token" not in log.read_text()
    create, read = lines[0], lines[1]
    assert create["method"] == "PUT" and create["status"] == 201 and create["path"] == marker
    assert read["path"] == f"{marker}?offset=-1&token=REDACTED"
    assert read["status"] == 200 and read["http_version"] == "1.1" and read["client"] == "127.0.0.1"
    assert read["bytes"] == 2 and read["duration_ms"] >= 0  # "[]"


def test_readiness(tmp_path: Path) -> None:
    # A reserve larger than any disk: the data directory cannot take appends, so not ready.
    server = start("--storage", "disk", "--data-dir", str(tmp_path / "d"), "--min-free-bytes", "1000000GiB")
    try:
        response = httpx.get(f"{server.url}/readyz", timeout=5)
        assert response.status_code == 503
        assert "min-free-bytes" in response.json()["reason"]
        assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
    finally:
        server.stop()


def test_metrics_port_and_switch(tmp_path: Path) -> None:
    server = start(*FAST, "--metrics-port", "0")
    try:
        line = next(line for line in server.output if "streamkeep metrics on " in line)
        metrics_url = line.split("streamkeep metrics on ", 1)[1].strip()
        assert httpx.get(metrics_url, timeout=5).status_code == 200
        assert httpx.get(f"{server.url}/metrics", timeout=5).status_code == 404  # not on the main port
        assert httpx.get(metrics_url.replace("/metrics", "/v1/stream/x"), timeout=5).status_code == 404
        with httpx.Client(http1=False, http2=True, timeout=5) as h2c:  # prior knowledge, as Prometheus may
            answer = h2c.get(metrics_url)
            assert answer.http_version == "HTTP/2" and answer.status_code == 200
            assert "streamkeep_" in answer.text
    finally:
        server.stop()
    off = start(*FAST, "--no-metrics")
    try:
        assert httpx.get(f"{off.url}/metrics", timeout=5).status_code == 404
    finally:
        off.stop()


async def test_streams_wait_for_recovery_while_probes_answer() -> None:
    import trio

    from streamkeep.actors.supervisor import Supervisor
    from streamkeep.protocol.model import Headers, Request
    from streamkeep.server.service import Recovered, Service, ServiceOptions
    from streamkeep.storage.memory import MemoryStorage

    async with trio.open_nursery() as nursery:
        service = Service(Supervisor(MemoryStorage(max_stream_bytes=1 << 20, max_total_bytes=1 << 20), nursery),
                          ServiceOptions(), recovering="recovering streams from the data directory")  # fmt: skip
        put = Request("PUT", "/v1/stream/a", headers=Headers([("Content-Type", "text/plain")]))
        refused = await service.handle(put)
        assert refused.status == 503 and refused.header("Retry-After") == "1"
        assert json.loads(refused.body)["error"]["code"] == "not_ready"
        ready = await service.handle(Request("GET", "/readyz"))
        assert ready.status == 503 and "recovering" in json.loads(ready.body)["reason"]
        assert (await service.handle(Request("GET", "/healthz"))).status == 200
        service.serve_streams(Recovered())
        assert (await service.handle(put)).status == 201
        assert (await service.handle(Request("GET", "/readyz"))).status == 200
        nursery.cancel_scope.cancel()
