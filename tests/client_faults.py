"""A TCP proxy in front of a real server that cuts connections on purpose, for the client tests:
a reader must resume from its last offset, and a request must be retried only when that is safe."""

from __future__ import annotations

import socket
import struct
import threading
from urllib.parse import urlsplit


class CuttingProxy:
    """Forwards 127.0.0.1:<port> to the server. Each of the first `cuts` connections is reset
    (RST, no FIN) once `cut_after` bytes of the server's answers went through it; later ones pass
    everything."""

    def __init__(self, server_url: str, *, cut_after: int, cuts: int) -> None:
        target = urlsplit(server_url)
        assert target.hostname is not None and target.port is not None
        self.target = (target.hostname, target.port)
        self.cut_after = cut_after
        self.cuts_left = cuts
        self.cut = 0  # connections reset so far
        self.connections = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._closing = False
        self._sockets: list[socket.socket] = []
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self._lock:
                self.connections += 1
                budget = self.cut_after if self.cuts_left > 0 else None
                if budget is not None:
                    self.cuts_left -= 1
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, budget), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, budget: int | None) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                if budget is not None and len(data) >= budget:
                    sink.sendall(data[:budget])
                    with self._lock:
                        self.cut += 1
                    for sock in (source, sink):
                        _reset(sock)
                    return
                if budget is not None:
                    budget -= len(data)
                sink.sendall(data)
        except OSError:
            for sock in (source, sink):
                _reset(sock)

    def close(self) -> None:
        self._closing = True
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                _reset(sock)


def _reset(sock: socket.socket) -> None:
    """Drops the connection with an RST. `close` alone would not: the other pump thread, blocked
    in `recv` on this socket, keeps it open in the kernel. Shutting down reading wakes it first."""
    for step in (
        lambda: sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)),
        lambda: sock.shutdown(socket.SHUT_RD),
        sock.close,
    ):
        try:
            step()
        except OSError:
            pass
