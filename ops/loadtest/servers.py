"""The servers a load test compares, each started as its own process on a free loopback port."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ops.serverproc import ROOT, ServerProcess, launch, start

NODE_DIR = ROOT / "ops" / "bench"
# rakaia-streams' own virtualenv (ops/bench/rakaia-requirements.txt), made by the Makefile's bench targets.
RAKAIA_PYTHON = NODE_DIR / ".venv-rakaia" / "bin" / "python"


@dataclass(frozen=True)
class Kind:
    name: str
    durable: bool  # fsync before acknowledging
    h2c: bool  # speaks HTTP/2 with prior knowledge
    launch: Callable[[Path], ServerProcess]
    # Another project's server: a scenario it fails is noted in the table and the run goes on, where a
    # failure of ours stops the run.
    peer: bool = False


def streamkeep_memory(_: Path) -> ServerProcess:
    return start("--storage", "memory", "--log-level", "warning", "--max-total-bytes", "16GiB")


def streamkeep_disk(data: Path, *extra: str) -> ServerProcess:
    durable = ["--storage", "disk", "--data-dir", str(data / "streamkeep"), "--fsync", "always"]
    return start(*durable, "--log-level", "warning", *extra)


def node(data_dir: Path | None) -> ServerProcess:
    """The upstream reference server (@durable-streams/server) through ops/bench/node_ref_server.mjs."""
    env = {"DATA_DIR": str(data_dir)} if data_dir is not None else {"DATA_DIR": ""}
    return launch(["node", "node_ref_server.mjs"], cwd=NODE_DIR, env=env, timeout=30)


def rakaia(data_dir: Path | None) -> ServerProcess:
    """rakaia-streams, the Python peer, on uvicorn + uvloop + httptools (ops/bench/rakaia_server.py, run
    by its own virtualenv's Python): in memory, or on its JSONL store with fsync per append in `data_dir`."""
    env = {"DATA_DIR": str(data_dir) if data_dir is not None else ""}
    return launch([str(RAKAIA_PYTHON), "rakaia_server.py"], cwd=NODE_DIR, env=env, timeout=30)


def ceiling(_: Path) -> ServerProcess:
    return launch([sys.executable, "-m", "ops.loadtest.ceiling"])


def ceiling_with_headers(_: Path) -> ServerProcess:
    return launch([sys.executable, "-m", "ops.loadtest.ceiling", "--headers", "streamkeep"])


def streamkeep_disk_syncfs(data: Path) -> ServerProcess:
    return streamkeep_disk(data, "--sync-method", "syncfs")


KINDS = {
    kind.name: kind
    for kind in (
        Kind("streamkeep memory", False, True, streamkeep_memory),
        Kind("streamkeep disk", True, True, streamkeep_disk),
        Kind("node memory", False, False, lambda _: node(None), peer=True),
        Kind("node file", True, False, lambda data: node(data / "node"), peer=True),
        # uvicorn speaks HTTP/1.1 only: no h2c rows.
        Kind("rakaia memory", False, False, lambda _: rakaia(None), peer=True),
        Kind("rakaia jsonl", True, False, lambda data: rakaia(data / "rakaia"), peer=True),
        Kind("ceiling", False, True, ceiling),
        # Not in the default run; for questions the table raises (python -m ops.loadtest --servers ...).
        Kind("streamkeep disk syncfs", True, True, streamkeep_disk_syncfs),
        Kind("ceiling with streamkeep headers", False, True, ceiling_with_headers),
    )
}


def cpu_seconds(pid: int) -> float:
    """User + system CPU the process has used so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def pin(pid: int, cpu: int) -> None:
    """Pins every thread a server has to `cpu`; threads it starts later inherit the pinning."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), {cpu})
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def pinned_cpus() -> tuple[int, int] | None:
    """(the servers' CPU, the load's CPU): the first two this process may use; None with one."""
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else None
