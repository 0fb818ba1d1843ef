"""A scriptable webhook receiver on a real loopback socket, for subscription tests."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    """Answers each POST with the next scripted (status, body, delay), recording what came."""

    def __init__(self, script: list[tuple[int, dict, float]]) -> None:
        self.script = script
        self.requests: list[tuple[float, dict]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append((time.monotonic(), json.loads(body)))
                status, answer, delay = receiver.script.pop(0) if receiver.script else (200, {}, 0.0)
                time.sleep(delay)
                data = json.dumps(answer).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, count: int, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while len(self.requests) < count:
            assert time.monotonic() < deadline, f"only {len(self.requests)} of {count} webhook calls arrived"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.shutdown()
