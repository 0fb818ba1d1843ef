"""Real etcd processes on loopback: for the tests, and for `streamkeep cluster run` when no etcd is
given. Synchronous (subprocesses), like the rest of `cluster run`'s process handling.

`LocalEtcd(directory, members=3).start()` starts one etcd cluster of `members` processes on free
ports, each with its data directory and its log file in `directory`, and returns once each answers
`/health`. Members can be killed and restarted on their own data and ports, as a test needs to
take one away and bring it back.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

# Elections on loopback: a heartbeat every 100 ms and a new election after 500 ms without one, so
# a 3-member cluster has a new leader within about a second of losing one (etcd's defaults, 100 ms
# and 1 s, are for real networks).
HEARTBEAT_MS = 100
ELECTION_MS = 500
# Keep the last 1,000 revisions of history (we never read old revisions); the rest is compacted.
COMPACTION_REVISIONS = 1000
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0


class EtcdNotInstalled(RuntimeError):
    pass


class EtcdStartFailed(RuntimeError):
    pass


def etcd_binary() -> str:
    """The etcd executable: Debian's /usr/bin/etcd, or one on PATH."""
    if os.access("/usr/bin/etcd", os.X_OK):
        return "/usr/bin/etcd"
    found = shutil.which("etcd")
    if found is None:
        raise EtcdNotInstalled("etcd is not installed: apt-get install etcd-server (make system-tools does)")
    return found


def free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports free on `host` now (all held open together, so none repeats)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class _Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log: Path
    process: subprocess.Popen[bytes] | None = None


class LocalEtcd:
    """`members` etcd processes on `host`, one cluster, state and logs under `directory`."""

    def __init__(self, directory: Path, members: int = 1, host: str = "127.0.0.1") -> None:
        if members < 1:
            raise ValueError("an etcd cluster needs at least one member")
        self.directory = Path(directory)
        self.host = host
        self.count = members
        self._members: list[_Member] = []
        # One token per cluster: members of another test's cluster on a reused port never join ours.
        self._token = f"streamkeep-{os.getpid()}-{time.monotonic_ns()}"

    @property
    def endpoints(self) -> list[str]:
        """The client URLs, member 0 first."""
        return [self._url(m.client_port) for m in self._members]

    def start(self) -> None:
        binary = etcd_binary()
        self.directory.mkdir(parents=True, exist_ok=True)
        ports = free_ports(self.host, 2 * self.count)
        self._members = [
            _Member(
                name=f"etcd{i}",
                client_port=ports[2 * i],
                peer_port=ports[2 * i + 1],
                data_dir=self.directory / f"etcd{i}.data",
                log=self.directory / f"etcd{i}.log",
            )
            for i in range(self.count)
        ]
        try:
            # Every member first, then the waits: one member alone has no quorum and is never healthy.
            for member in self._members:
                self._spawn(member, binary)
            deadline = time.monotonic() + START_TIMEOUT
            for member in self._members:
                self._wait_healthy(member, deadline)
        except BaseException:
            self.stop()
            raise

    def kill(self, index: int) -> None:
        """SIGKILL member `index` (its data stays, for `restart`)."""
        member = self._members[index]
        if member.process is not None and member.process.poll() is None:
            member.process.send_signal(signal.SIGKILL)
            member.process.wait()

    def restart(self, index: int, *, wait: bool = True) -> None:
        """Start member `index` again on its data directory and ports. With `wait`, return once it
        is healthy (it has a leader: needs a quorum of the others)."""
        member = self._members[index]
        if member.process is not None and member.process.poll() is None:
            raise RuntimeError(f"etcd member {index} is running (pid {member.process.pid})")
        self._spawn(member, etcd_binary())
        if wait:
            self._wait_healthy(member, time.monotonic() + START_TIMEOUT)

    def running(self, index: int) -> bool:
        process = self._members[index].process
        return process is not None and process.poll() is None

    def stop(self) -> None:
        """SIGTERM every member, then wait (SIGKILL after STOP_TIMEOUT)."""
        alive = [m.process for m in self._members if m.process is not None and m.process.poll() is None]
        for process in alive:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for process in alive:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> LocalEtcd:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- one member

    def _url(self, port: int) -> str:
        return f"http://{self.host}:{port}"

    def _spawn(self, member: _Member, binary: str) -> None:
        cluster = ",".join(f"{m.name}={self._url(m.peer_port)}" for m in self._members)
        args = [
            binary,
            "--name", member.name,
            "--data-dir", str(member.data_dir),
            "--listen-client-urls", self._url(member.client_port),
            "--advertise-client-urls", self._url(member.client_port),
            "--listen-peer-urls", self._url(member.peer_port),
            "--initial-advertise-peer-urls", self._url(member.peer_port),
            "--initial-cluster", cluster,
            "--initial-cluster-token", self._token,
            # "new" is ignored once the data directory holds the member's state: a restart rejoins.
            "--initial-cluster-state", "new",
            "--heartbeat-interval", str(HEARTBEAT_MS),
            "--election-timeout", str(ELECTION_MS),
            "--auto-compaction-mode", "revision",
            "--auto-compaction-retention", str(COMPACTION_REVISIONS),
            "--snapshot-count", "10000",
            "--logger", "zap",
            "--log-outputs", "stderr",
        ]  # fmt: skip
        # ETCD_* variables would override these flags (and etcd refuses a flag set both ways).
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        with member.log.open("ab") as log:
            member.process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )

    def _wait_healthy(self, member: _Member, deadline: float) -> None:
        url = self._url(member.client_port) + "/health"
        last = "no answer yet"
        with httpx.Client(timeout=1.0, trust_env=False) as client:
            while True:
                process = member.process
                if process is not None and process.poll() is not None:
                    raise EtcdStartFailed(
                        f"etcd {member.name} exited with status {process.returncode} while starting: "
                        f"see {member.log}\n{_tail(member.log)}"
                    )
                try:
                    answer = client.get(url)
                    if answer.status_code == 200 and answer.json().get("health") == "true":
                        return
                    last = f"HTTP {answer.status_code} {answer.text.strip()}"
                except (httpx.HTTPError, ValueError) as error:
                    last = f"{type(error).__name__} {error}"
                if time.monotonic() > deadline:
                    raise EtcdStartFailed(
                        f"etcd {member.name} was not healthy at {url} within {START_TIMEOUT:g}s ({last}): "
                        f"see {member.log}\n{_tail(member.log)}"
                    )
                time.sleep(0.05)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
