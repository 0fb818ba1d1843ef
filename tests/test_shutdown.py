"""SIGTERM: live readers get a clean end (SSE finishes its last event, long-polls answer 204)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from ops.serverproc import start


@pytest.mark.parametrize("edge", ["lean", "quart"])
def test_sigterm_ends_sse_and_long_poll_cleanly(edge: str) -> None:
    server = start(
        "--storage", "memory", "--long-poll-timeout", "30", "--sse-close-after", "60", "--edge", edge
    )
    try:
        url = f"{server.url}/v1/stream/shutdown"
        httpx.put(url, headers={"Content-Type": "text/plain"})
        httpx.post(url, content=b"before", headers={"Content-Type": "text/plain"})
        results: dict[str, object] = {}

        def sse_reader() -> None:
            try:
                with httpx.stream("GET", url, params={"offset": "-1", "live": "sse"}, timeout=20) as response:
                    results["sse"] = "".join(response.iter_text())  # raises if the stream is cut
            except Exception as error:
                results["sse_error"] = repr(error)

        def long_poller() -> None:
            try:
                response = httpx.get(url, params={"offset": "now", "live": "long-poll"}, timeout=20)
                results["long_poll"] = response.status_code
            except Exception as error:
                results["long_poll_error"] = repr(error)

        threads = [threading.Thread(target=sse_reader), threading.Thread(target=long_poller)]
        for thread in threads:
            thread.start()
        time.sleep(0.8)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(20)
        code = server.process.wait(20)
        assert code == 0, "".join(server.output)
        assert time.monotonic() - started < 10
        assert "sse_error" not in results and "long_poll_error" not in results, results
        sse_text = str(results["sse"])
        assert "data:before" in sse_text and sse_text.endswith("\n\n")
        assert results["long_poll"] == 204
    finally:
        server.stop(signal.SIGKILL)
