"""The black box's real parts: the server process, its disk, the S3 server, a webhook receiver.

- `Disk`: the data directory on the plain file system, on a small tmpfs, or on an ext4 loop image
  (where ENOSPC can surface at fsync); `fill()` writes a ballast file until the disk is full (or
  nearly: a few KiB left, so writes come up short), `free()` deletes it. Mounts are always undone
  in `close()`.
- `S3`: a `moto_server` process behind a TCP proxy of ours. `stop()` closes the proxy (connections
  refused, open ones reset) while moto keeps the objects; `freeze()`/`thaw()` SIGSTOP/SIGCONT
  moto; `wipe()` restarts moto empty (moto keeps objects in memory only).
- `Server`: `streamkeep serve` on a fixed port (clients keep one URL across restarts), killed with
  SIGKILL or SIGTERM and started again; `open_fds()` lists its descriptors from /proc.
- `WebhookReceiver`: answers deliveries (seeded: done, failing, slow), verifies each Ed25519
  signature against the server's JWKS, and records each delivery in the history.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from ops.serverproc import ServerProcess, start
from ops.torture.history import Call, History, Outcome, classify

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---- disk -------------------------------------------------------------------------------------


class Disk:
    SIZES = {"tmpfs": 48 << 20, "ext4": 64 << 20}

    def __init__(self, kind: str, root: Path) -> None:
        self.kind = kind
        self.root = root
        self.mount = root / "mnt"
        self.data = self.mount / "data"
        self.image = root / "disk.img"
        self.ballast = self.mount / "ballast"
        self.mounted = False

    def setup(self) -> Path:
        self.mount.mkdir(parents=True, exist_ok=True)
        if self.kind == "tmpfs":
            size = self.SIZES["tmpfs"]
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.mount)], check=True
            )
            self.mounted = True
        elif self.kind == "ext4":
            subprocess.run(["truncate", "-s", str(self.SIZES["ext4"]), str(self.image)], check=True)
            subprocess.run(["mkfs.ext4", "-q", "-F", str(self.image)], check=True)
            subprocess.run(["mount", "-o", "loop", str(self.image), str(self.mount)], check=True)
            self.mounted = True
        self.data.mkdir(exist_ok=True)
        return self.data

    @property
    def can_fill(self) -> bool:
        return self.kind in ("tmpfs", "ext4")

    def fill(self, rng: random.Random) -> int:
        """Fills the disk with ballast, leaving nothing or a few pages, so the next appends fit,
        then one comes up short, then none fits; returns the bytes left free."""
        leave = rng.choice((0, 4096, 16384, 65536))
        block = b"\0" * (1 << 20)
        with open(self.ballast, "ab") as out:
            while True:
                free = self.free_bytes()
                if free <= leave:
                    break
                chunk = min(len(block), max(512, free - leave))
                try:
                    out.write(block[:chunk])
                    out.flush()
                    os.fsync(out.fileno())
                except OSError as error:
                    if error.errno in (errno.ENOSPC, errno.EDQUOT):
                        break
                    raise
                if chunk < 4096:
                    break
        return self.free_bytes()

    def free(self) -> None:
        try:
            self.ballast.unlink()
        except FileNotFoundError:
            pass

    def free_bytes(self) -> int:
        stat = os.statvfs(self.mount)
        return stat.f_bavail * stat.f_frsize

    def close(self) -> None:
        self.free()
        if self.mounted:
            for _ in range(20):
                if subprocess.run(["umount", str(self.mount)], capture_output=True).returncode == 0:
                    break
                time.sleep(0.25)
            else:
                subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)
            self.mounted = False
        if self.image.exists():
            self.image.unlink()


# ---- S3 ----------------------------------------------------------------------------------------


class TcpProxy:
    """Forwards 127.0.0.1:port to a target port; `stop()` refuses and resets, `start()` reopens."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()
            except OSError:
                pass

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            self._conns.discard(source)


class S3:
    def __init__(self) -> None:
        self.moto_port = free_port()
        self.proxy = TcpProxy(self.moto_port)
        self.process: subprocess.Popen[bytes] | None = None
        self.frozen = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.port}"

    def start_moto(self) -> None:
        binary = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
        self.process = subprocess.Popen(
            [binary, "-H", "127.0.0.1", "-p", str(self.moto_port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{self.moto_port}", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("moto_server did not start")

    def setup(self) -> None:
        self.start_moto()
        self.proxy.start()

    def stop(self) -> None:
        self.proxy.stop()

    def start(self) -> None:
        self.proxy.start()

    def freeze(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)
            self.frozen = False

    def wipe(self) -> None:
        self._kill_moto()
        self.start_moto()

    def count_objects(self) -> int:
        """Objects in the bucket now (straight from moto, past the proxy): proof that segments
        were sealed and uploaded. -1 when moto does not answer (frozen, or restarting)."""
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.moto_port}",
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
            config=Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}),
        )
        try:
            pages = client.get_paginator("list_objects_v2").paginate(Bucket="torture")
            return sum(len(page.get("Contents", [])) for page in pages)
        except Exception:
            return -1

    def _kill_moto(self) -> None:
        if self.process is not None:
            if self.frozen:
                self.thaw()
            self.process.kill()
            self.process.wait(10)
            self.process = None

    def close(self) -> None:
        self.proxy.stop()
        self._kill_moto()


# ---- the server ----------------------------------------------------------------------------------


class Server:
    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.port = free_port()
        self.args = [*args, "--port", str(self.port)]
        self.env = env
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: ServerProcess | None = None
        self.outputs: list[str] = []  # the output of every process so far, last lines

    def start(self) -> None:
        try:
            self.process = start(*self.args, env=self.env, timeout=60)
            self._wait_recovered(60.0)
        except RuntimeError as error:
            self.outputs.append(str(error))
            raise

    def _wait_recovered(self, timeout: float) -> None:
        """Returns once the server has read its data directory back: it listens before then and
        answers 503 not_ready (with Retry-After), which is the restart's doing, so the run counts
        the server down until recovery ends. Other reasons /readyz gives (a full disk) are faults
        of their own, judged as such."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.process.alive:
                raise RuntimeError(
                    "the server exited while recovering:\n" + "".join(self.process.output[-40:])
                )
            try:
                answer = httpx.get(f"{self.url}/readyz", timeout=2.0)
                if answer.status_code == 200 or "recovering" not in answer.text:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        tail = self.output_tail(40)
        self.process.stop(signal.SIGKILL)  # the caller starts another on this port
        raise RuntimeError(f"the server was still recovering after {timeout:.0f} s:\n" + tail)

    def all_output(self) -> str:
        """Every process's output, in order, for the dump of a failing run."""
        current = "".join(self.process.output) if self.process is not None and self.process.alive else ""
        return "\n==== next process ====\n".join([*self.outputs, current])

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.alive

    @property
    def pid(self) -> int | None:
        return self.process.process.pid if self.process is not None else None

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 20.0) -> int | None:
        if self.process is None:
            return None
        code = self.process.stop(sig, timeout)
        self.outputs.append("".join(self.process.output))
        return code

    def output_tail(self, lines: int = 30) -> str:
        return "".join(self.process.output[-lines:]) if self.process is not None else ""

    def open_fds(self) -> dict[str, Any]:
        """The server's descriptors: how many, and which point at deleted files."""
        pid = self.pid
        out: dict[str, Any] = {"pid": pid, "total": 0, "deleted": []}
        if pid is None:
            return out
        base = Path(f"/proc/{pid}/fd")
        try:
            entries = list(base.iterdir())
        except OSError:
            return out
        out["total"] = len(entries)
        for entry in entries:
            try:
                target = os.readlink(entry)
            except OSError:
                continue
            if target.endswith(" (deleted)") or "/trash/" in target:
                out["deleted"].append(f"{entry.name} {target}")
        return out


# ---- webhooks --------------------------------------------------------------------------------------


class WebhookReceiver:
    def __init__(self, history: History, rng: random.Random) -> None:
        self.history = history
        self.rng = rng
        self.lock = threading.Lock()
        self.server_url: str | None = None
        self.keys: dict[str, Any] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.deliver(self, body)

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/hook"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def deliver(self, handler: BaseHTTPRequestHandler, raw: bytes) -> None:
        try:
            body = json.loads(raw)
        except ValueError:
            body = {"unparsed": raw[:200].decode("latin-1")}
        ok, why = self.verify(handler.headers.get("Webhook-Signature", ""), raw)
        with self.lock:
            roll = self.rng.random()
        answer, status, delay = ({"done": True}, 200, 0.0) if roll < 0.8 else ({}, 500, 0.0)
        if 0.9 <= roll:
            answer, status, delay = {"done": True}, 200, 1.5
        params = {"body": body, "signature_ok": ok, "signature_error": why, "answer": status}
        started = self.history.start("webhook", "receiver", None, params, Call("POST", "/hook"))
        time.sleep(delay)
        data = json.dumps(answer).encode()
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
        except OSError:
            pass
        self.history.end(started, Outcome(status, body=json.dumps(answer), verdict=classify(status)))

    def verify(self, header: str, raw: bytes) -> tuple[bool, str]:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            fields = dict(part.split("=", 1) for part in header.split(","))
            timestamp, kid, signature = fields["t"], fields["kid"], fields["ed25519"]
        except (ValueError, KeyError):
            return False, f"malformed header {header[:80]!r}"
        if kid not in self.keys and self.server_url:
            try:
                jwks = httpx.get(f"{self.server_url}/v1/stream/__ds/jwks.json", timeout=5).json()
                self.keys.update({k["kid"]: k for k in jwks.get("keys", [])})
            except (httpx.HTTPError, ValueError):
                return True, "JWKS unreachable; not judged"
        jwk = self.keys.get(kid)
        if jwk is None:
            return False, f"kid {kid} is not in the server's JWKS"
        public = Ed25519PublicKey.from_public_bytes(base64.urlsafe_b64decode(jwk["x"] + "=="))
        try:
            public.verify(base64.urlsafe_b64decode(signature + "=="), f"{timestamp}.".encode() + raw)
        except (InvalidSignature, ValueError):
            return False, "bad signature"
        return True, ""

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
