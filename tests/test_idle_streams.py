"""An idle stream gives back its segment's descriptor when its actor hibernates (issue 26).

Kept, one per stream ever written, the descriptors reached the process's limit with enough
streams: every append then answered 503 ("Too many open files") and accept failed with EMFILE,
for good, since nothing gave them back. Here a real disk server hibernates written streams, holds
no descriptor of theirs, and appends to them again as before.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from ops.serverproc import ServerProcess, start

STREAMS = 24
TEXT = {"Content-Type": "text/plain"}


def segment_fds(server: ServerProcess, data_dir: Path) -> int:
    """Descriptors the server holds on segment files under `data_dir`."""
    count = 0
    for fd in os.listdir(f"/proc/{server.process.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{server.process.pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(data_dir)) and target.endswith(".seg"):
            count += 1
    return count


def wait_until(check: object, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.1)


@pytest.mark.parametrize("fsync", ["always", "interval"])
def test_a_hibernated_stream_holds_no_descriptor_and_takes_appends_again(tmp_path: Path, fsync: str) -> None:
    data = (tmp_path / "data").resolve()
    server = start("--storage", "disk", "--data-dir", str(data), "--fsync", fsync, "--fsync-interval", "0.2",
                   "--hibernate-after", "0.4", "--log-level", "warning")  # fmt: skip
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            idle = client.get("/stats").json()["actors_active"]
            names = [f"idle/{i}" for i in range(STREAMS)]
            for name in names:
                assert client.put(f"/v1/stream/{name}", headers=TEXT).status_code == 201
                assert client.post(f"/v1/stream/{name}", content=b"a,", headers=TEXT).status_code == 204
            assert segment_fds(server, data) >= STREAMS  # written: each holds its descriptor
            wait_until(lambda: client.get("/stats").json()["actors_active"] <= idle)
            wait_until(lambda: segment_fds(server, data) == 0)
            for name in names:  # awake again: the next write opens the segment again
                assert client.post(f"/v1/stream/{name}", content=b"b,", headers=TEXT).status_code == 204
            for name in names:
                assert client.get(f"/v1/stream/{name}?offset=-1").content == b"a,b,"
    finally:
        server.stop()
    again = start("--storage", "disk", "--data-dir", str(data), "--log-level", "warning")
    try:
        for name in names:  # and it was all on disk
            assert httpx.get(f"{again.url}/v1/stream/{name}?offset=-1", timeout=10).content == b"a,b,"
    finally:
        again.stop()
