"""Starts rakaia-streams, the Python Durable Streams server on PyPI, on uvicorn with uvloop and httptools.

    DATA_DIR= ops/bench/.venv-rakaia/bin/python ops/bench/rakaia_server.py          # in memory
    DATA_DIR=DIR ops/bench/.venv-rakaia/bin/python ops/bench/rakaia_server.py       # JSONL files, fsync'd

In memory it is rakaia's `StreamStore`; with DATA_DIR set, its `JsonlStreamStore` on that directory with
fsync on (its default: an append is acknowledged once its line and, for a new segment, the directory
entry have reached the disk). Access log off and log level warning, as streamkeep runs in the load tests.
It prints the same "listening on" line as streamkeep for ops/serverproc.py, on PORT (default: a free
port). Runs in its own virtualenv (ops/bench/rakaia-requirements.txt, installed by `make bench`), not
streamkeep's: this file imports only rakaia, uvicorn and the standard library.
"""

from __future__ import annotations

import os
import socket

import uvicorn
from rakaia import JsonlStreamStore, StreamStore, create_app


class Server(uvicorn.Server):
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        port = self.servers[0].sockets[0].getsockname()[1]
        print(f"streamkeep listening on http://127.0.0.1:{port}", flush=True)


def main() -> None:
    data_dir = os.environ.get("DATA_DIR")
    store = JsonlStreamStore(data_dir, fsync=True) if data_dir else StreamStore()
    config = uvicorn.Config(
        create_app(store=store),
        host="127.0.0.1",
        port=int(os.environ.get("PORT", "0")),
        loop="uvloop",
        http="httptools",
        lifespan="off",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    Server(config).run()


if __name__ == "__main__":
    main()
