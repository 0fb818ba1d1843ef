"""`streamkeep cluster resize` (issue 16's member-addition tool): streams move to their new owner
with every byte, fork pairs that end up apart get a pin (and together lose it), and the commands
refuse what would be unsafe (a member still running, a different size mid-resize)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx

from ops.serverproc import ServerProcess, launch
from streamkeep.cluster.forward import stamp_header
from streamkeep.cluster.placement import Member, Placement
from streamkeep.cluster.resize import PLAN
from streamkeep.cluster.run import free_port

TEXT = {"Content-Type": "text/plain"}


def placement(processes: int, epoch: int) -> Placement:
    return Placement.of([Member(f"m{i}", "x:1") for i in range(processes)], epoch)


def run_cluster(data: Path, processes: int) -> ServerProcess:
    command = [sys.executable, "-m", "streamkeep", "cluster", "run", "--processes", str(processes),
               "--port", str(free_port("127.0.0.1")), "--data-dir", str(data), "--storage", "disk",
               "--fsync", "always", "--log-level", "warning"]  # fmt: skip
    return launch(command, timeout=90)


def resize(data: Path, processes: int) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "streamkeep", "cluster", "resize", "--data-dir", str(data),
               "--processes", str(processes)]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def own_streams(runner: ServerProcess, data: Path) -> dict[str, set[str]]:
    """Each member's own list, asked as a member asks (signed), so it is not the cluster's."""
    secret = (data / "cluster.secret").read_text().strip()
    members = {
        line.split()[1]: line.split()[3].rstrip(":") for line in runner.output if line.startswith("member m")
    }
    held = {}
    for member, url in members.items():
        target = "/v1/admin/streams?match=rs/**"
        signed = {"Streamkeep-Forwarded": stamp_header(secret, member, "GET", target)}
        held[member] = {row["name"] for row in httpx.get(f"{url}{target}", headers=signed).json()["streams"]}
    return held


def pair(before: Placement, after: Placement, together_before: bool) -> tuple[str, str]:
    """A (source, fork) pair together under one placement and apart under the other."""
    for i in range(2000):
        source, fork = f"rs/src{i}", f"rs/fork{i}"
        same_before = before.owner(source).id == before.owner(fork).id
        same_after = after.owner(source).id == after.owner(fork).id
        if same_before == together_before and same_after != together_before:
            return source, fork
    raise AssertionError("no such pair")


def test_growing_and_shrinking_moves_streams_with_their_data_and_fork_pins(tmp_path: Path) -> None:
    data = tmp_path / "cluster"
    two, three = placement(2, 1), placement(3, 2)
    names = [f"rs/{i}" for i in range(24)]
    split = pair(two, three, together_before=True)  # needs a pin after the resize
    joined = pair(two, three, together_before=False)  # its pin goes
    runner = run_cluster(data, 2)
    try:
        with httpx.Client(base_url=runner.url, timeout=10) as client:
            for name in names:
                assert (
                    client.put(f"/v1/stream/{name}", headers=TEXT, content=f"{name}:".encode()).status_code
                    == 201
                )
                assert client.post(f"/v1/stream/{name}", headers=TEXT, content=b"more").status_code == 204
            for source, fork in (split, joined):
                assert (
                    client.put(f"/v1/stream/{source}", headers=TEXT, content=b"inherited;").status_code == 201
                )
                made = client.put(
                    f"/v1/stream/{fork}", headers={"Stream-Forked-From": f"/v1/stream/{source}"}
                )
                assert made.status_code == 201
                assert client.post(f"/v1/stream/{fork}", headers=TEXT, content=b"own").status_code == 204
                assert client.delete(f"/v1/stream/{source}").status_code == 204  # soft: its fork reads it
    finally:
        runner.stop(signal.SIGTERM)
    assert run_cluster_refused(data, 3)  # a different size without a resize
    (data / "m1" / "RUNNING").write_bytes(b"")
    refused = resize(data, 3)
    assert refused.returncode == 2 and "did not stop cleanly" in refused.stderr
    (data / "m1" / "RUNNING").unlink()
    grown = resize(data, 3)
    assert grown.returncode == 0, grown.stderr
    assert "fork pins: 1 added, 1 dropped" in grown.stdout and not (data / PLAN).exists()
    runner = run_cluster(data, 3)
    try:
        held = own_streams(runner, data)
        everything = [*names, *split, *joined]  # soft-deleted sources are listed too (as deleted)
        expected = {m: {n for n in everything if three.owner(n).id == m} for m in ("m0", "m1", "m2")}
        assert expected == held, {m: (expected[m] - held[m], held[m] - expected[m]) for m in held}
        assert held["m2"], "the newcomer took streams"
        with httpx.Client(base_url=runner.url, timeout=10) as client:
            for name in names:
                assert client.get(f"/v1/stream/{name}?offset=-1").content == f"{name}:more".encode()
            for source, fork in (split, joined):
                assert client.get(f"/v1/stream/{fork}?offset=-1").content == b"inherited;own"
                assert client.get(f"/v1/stream/{source}?offset=-1").status_code == 410
                assert client.post(f"/v1/stream/{fork}", headers=TEXT, content=b"!").status_code == 204
            # The pin written by the resize holds the split source until its fork goes.
            assert client.delete(f"/v1/stream/{split[1]}").status_code == 204
            assert client.put(f"/v1/stream/{split[0]}", headers=TEXT).status_code == 201
    finally:
        runner.stop(signal.SIGTERM)
    shrunk = resize(data, 2)
    assert shrunk.returncode == 0, shrunk.stderr
    runner = run_cluster(data, 2)
    try:
        with httpx.Client(base_url=runner.url, timeout=10) as client:
            for name in names:
                assert client.get(f"/v1/stream/{name}?offset=-1").content == f"{name}:more".encode()
            assert client.get(f"/v1/stream/{joined[1]}?offset=-1").content == b"inherited;own!"
            assert client.get(f"/v1/stream/{joined[0]}?offset=-1").status_code == 410  # held, apart again
            assert client.delete(f"/v1/stream/{joined[1]}").status_code == 204
            assert client.put(f"/v1/stream/{joined[0]}", headers=TEXT).status_code == 201
        assert set(own_streams(runner, data)) == {"m0", "m1"}
    finally:
        runner.stop(signal.SIGTERM)


def run_cluster_refused(data: Path, processes: int) -> bool:
    command = [sys.executable, "-m", "streamkeep", "cluster", "run", "--processes", str(processes),
               "--data-dir", str(data)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    return done.returncode == 2 and "streamkeep cluster resize" in done.stderr


def test_an_interrupted_resize_blocks_the_cluster_until_it_is_finished(tmp_path: Path) -> None:
    data = tmp_path / "cluster"
    runner = run_cluster(data, 2)
    runner.stop(signal.SIGTERM)
    (data / PLAN).write_text('{"from": ["m0", "m1"], "to": ["m0", "m1", "m2"], "epoch": 2}')
    blocked = subprocess.run(
        [sys.executable, "-m", "streamkeep", "cluster", "run", "--processes", "2", "--data-dir", str(data)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert blocked.returncode == 2 and "was interrupted" in blocked.stderr
    other = resize(data, 4)
    assert other.returncode == 2 and "--processes 3" in other.stderr
    finished = resize(data, 3)
    assert finished.returncode == 0 and "finishing the interrupted resize" in finished.stdout
    assert (
        "epoch = 2" in (data / "cluster.toml").read_text()
        and 'id = "m2"' in (data / "cluster.toml").read_text()
    )
