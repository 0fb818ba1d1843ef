"""`streamkeep cluster run`: N single-writer processes on this machine behind HAProxy, for development.

Each member gets its own data directory under DIR (`DIR/m0`, `DIR/m1`, ...) and a free loopback
port; DIR/cluster.toml records the member ids (the placement depends on the ids only, so ports may
change between runs). HAProxy listens on the given port (clear-text HTTP/1.1 and h2c by prior
knowledge, or TLS with ALPN h2 when given a certificate) and routes each stream to its owner. The
command prints `streamkeep listening on URL` once every part answers, and stops them all on Ctrl-C
or SIGTERM, or as soon as any one of them exits.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

from streamkeep.cluster import haproxy
from streamkeep.cluster.placement import Member, Placement
from streamkeep.storage import files

STOP_GRACE = 15.0


class ClusterError(Exception):
    """What the person starting the cluster must fix, said so they can."""


def recorded(data_dir: Path) -> tuple[list[str], int]:
    """The member ids and placement epoch DIR/cluster.toml records ([], 1 for a new directory)."""
    path = data_dir / "cluster.toml"
    if not path.exists():
        return [], 1
    table = tomllib.loads(path.read_text()).get("cluster", {})
    return [m["id"] for m in table.get("members", [])], int(table.get("epoch", 1))


def member_ids(data_dir: Path, processes: int) -> tuple[list[str], int]:
    """The member ids of DIR's cluster and its epoch: recorded at its first run, and only ever
    those (`streamkeep cluster resize` changes them)."""
    if (data_dir / "resize.json").exists():
        raise ClusterError(
            f"a resize of {data_dir} was interrupted ({data_dir / 'resize.json'}); run "
            "`streamkeep cluster resize` again with the same --processes to finish it"
        )
    ids = [f"m{i}" for i in range(processes)]
    known, epoch = recorded(data_dir)
    if known and known != ids:
        raise ClusterError(
            f"{data_dir} holds a cluster of {len(known)} processes ({', '.join(known)}); run it with "
            f"--processes {len(known)}, or move its streams first with `streamkeep cluster resize "
            f"--data-dir {data_dir} --processes {processes}` (docs/scaling.md §9)"
        )
    return ids, epoch


def relay(member_id: str, process: subprocess.Popen[str]) -> None:
    """A member's output on our stderr, each line marked with its id; its own "listening on" line
    is reworded, so whatever watches our output for the front door's URL does not take it."""
    assert process.stdout is not None
    for line in process.stdout:
        sys.stderr.write(f"[{member_id}] {line.replace('streamkeep listening on', 'member listening on')}")


def wait_until_listening(host: str, port: int, process: subprocess.Popen[Any], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ClusterError(
                f"haproxy exited with status {process.returncode} while starting; see its output above"
            )
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise ClusterError(f"haproxy did not listen on {host}:{port} within {seconds:g} s")


def cluster_secret(data_dir: Path) -> str:
    """The secret members sign forwarded requests with: made once per cluster directory (0600)."""
    path = data_dir / "cluster.secret"
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(32))
    return path.read_text().strip()


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def write_toml(path: Path, members: list[Member], epoch: int, replicas: list[Member] | None = None) -> None:
    listed = ", ".join(f'{{id = "{m.id}", address = "{m.address}"}}' for m in members)
    text = f"# Written by `streamkeep cluster`.\n[cluster]\nepoch = {epoch}\nmembers = [{listed}]\n"
    if replicas:
        text += (
            "replicas = ["
            + ", ".join(f'{{id = "{r.id}", address = "{r.address}"}}' for r in replicas)
            + "]\n"
        )
    files.replace(files.OS, path.parent, path.name, text.encode())  # whole or not at all


def wait_until_up(url: str, process: subprocess.Popen[Any], what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ClusterError(
                f"{what} exited with status {process.returncode} while starting; see its output above"
            )
        try:
            with urllib.request.urlopen(url, timeout=1) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise ClusterError(f"{what} did not answer {url} within {seconds:g} s")


def stop_all(processes: list[subprocess.Popen[Any]]) -> None:
    """SIGTERM to each in the order given, then waits for all of them together (SIGKILL after
    STOP_GRACE): the front door first, so no request reaches a process that is stopping."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def check_arguments(processes: int, tls_cert: str | None, tls_key: str | None) -> None:
    if processes < 1:
        raise ClusterError("--processes must be at least 1")
    if (tls_cert is None) != (tls_key is None):
        raise ClusterError("--tls-cert and --tls-key go together")


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/sbin/haproxy") if Path(p).exists()), None
    )
    if found is None:
        raise ClusterError("haproxy is not installed: apt-get install haproxy (make system-tools does)")
    return found


def front_door_pem(data_dir: Path, tls_cert: str | None, tls_key: str | None) -> Path | None:
    """HAProxy wants certificate and key in one file: written into DIR/haproxy (0600)."""
    if tls_cert is None or tls_key is None:
        return None
    lb = data_dir / "haproxy"
    lb.mkdir(parents=True, exist_ok=True)
    pem = lb / "tls.pem"
    pem.write_text(Path(tls_cert).read_text() + Path(tls_key).read_text())
    pem.chmod(0o600)
    return pem


def run(
    *,
    processes: int,
    port: int,
    data_dir: Path,
    host: str = "127.0.0.1",
    tls_cert: str | None = None,
    tls_key: str | None = None,
    serve_args: list[str] | None = None,
) -> int:
    check_arguments(processes, tls_cert, tls_key)
    found = haproxy_binary()
    data_dir.mkdir(parents=True, exist_ok=True)
    ids, epoch = member_ids(data_dir, processes)
    if port == 0:
        port = free_port(host)  # HAProxy would pick one too, but not tell us which
    members = [Member(member_id, f"127.0.0.1:{free_port('127.0.0.1')}") for member_id in ids]
    placement = Placement.of(members, epoch)
    toml = data_dir / "cluster.toml"
    write_toml(toml, members, placement.epoch)
    secret = cluster_secret(data_dir)
    lb = data_dir / "haproxy"
    pem = front_door_pem(data_dir, tls_cert, tls_key)
    config = haproxy.write(placement, lb, bind=host, port=port, tls_cert=None if pem is None else str(pem))
    children: list[tuple[str, subprocess.Popen[Any]]] = []
    stop = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for member in members:
            command = [sys.executable, "-m", "streamkeep", "serve", *(serve_args or []), "--config", str(toml),
                       "--cluster-member", member.id, "--host", "127.0.0.1",
                       "--port", member.address.rsplit(":", 1)[1], "--data-dir", str(data_dir / member.id)]  # fmt: skip
            env = {**os.environ, "DS_CLUSTER__SECRET": secret}  # not in argv, which `ps` shows
            process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
            threading.Thread(target=relay, args=(member.id, process), daemon=True).start()
            children.append((f"member {member.id}", process))
        for (what, process), member in zip(children, members, strict=True):
            wait_until_up(f"http://{member.address}/healthz", process, what)
        checked = subprocess.run([found, "-c", "-q", "-f", str(config)], capture_output=True, text=True)
        if checked.returncode != 0:
            raise ClusterError(f"haproxy refused {config}: {checked.stdout}{checked.stderr}".strip())
        balancer = subprocess.Popen([found, "-db", "-f", str(config)])
        children.append(("haproxy", balancer))
        scheme = "https" if pem is not None else "http"
        shown = f"[{host}]" if ":" in host else host
        url = f"{scheme}://{shown}:{port}"
        wait_until_listening(host, port, balancer)
        for member in members:
            print(
                f"member {member.id} at http://{member.address}: {placement.slots_of(member.id)} of 4096 slots"
            )
        print(f"streamkeep listening on {url}", flush=True)
        while not stop:
            for what, process in children:
                if process.poll() is not None:
                    print(
                        f"{what} exited with status {process.returncode}; stopping the cluster",
                        file=sys.stderr,
                    )
                    return 1
            time.sleep(0.2)
        return 0
    finally:
        stop_all([process for _, process in reversed(children)])
        for sig, handler in previous.items():
            signal.signal(sig, handler)
