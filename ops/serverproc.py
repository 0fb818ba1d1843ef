"""Start `streamkeep serve` as a real process on a free port, and stop it; for tests and ops scripts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class ServerProcess:
    process: subprocess.Popen[str]
    url: str
    output: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.alive:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start(*args: str, env: dict[str, str] | None = None, timeout: float = 20.0) -> ServerProcess:
    """Runs `python -m streamkeep serve --port 0 ARGS` and waits for its 'listening on' line."""
    return launch(
        [sys.executable, "-m", "streamkeep", "serve", "--port", "0", *args], env=env, timeout=timeout
    )


def launch(
    command: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float = 20.0
) -> ServerProcess:
    """Runs any server that prints 'streamkeep listening on URL' (ours, the ceiling, the Node wrapper)."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: list[str] = []
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            if "streamkeep listening on " in line and not found:
                found.append(line.split("streamkeep listening on ", 1)[1].strip())
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.05):
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{command[0]} did not start in time:\n" + "".join(output))
    if not found:
        process.wait()
        raise RuntimeError(f"{' '.join(command)} exited at start:\n" + "".join(output))
    return ServerProcess(process, found[0], output)
