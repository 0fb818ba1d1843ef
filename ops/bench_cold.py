"""Catch-up read speed from the cold tier vs the hot tier (moto_server as the S3 stand-in).

python -m ops.bench_cold [--mib 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.conftest import segment_files
from tests.test_cold import OCTETS, Moto, cold_server, wait_until


def catch_up(url: str) -> tuple[int, float]:
    started = time.perf_counter()
    total, offset = 0, "-1"
    with httpx.Client(timeout=60) as client:
        while True:
            response = client.get(url, params={"offset": offset})
            total += len(response.content)
            offset = response.headers["stream-next-offset"]
            if response.headers.get("stream-up-to-date") == "true":
                return total, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    moto = Moto()
    moto.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            server = cold_server(
                Path(tmp),
                moto,
                "--segment-max-bytes",
                "8MiB",
                "--cold-cache-bytes",
                "1MiB",
                "--log-level",
                "warning",
            )
            try:
                for name in ("hot", "cold"):
                    httpx.put(f"{server.url}/v1/stream/{name}", headers=OCTETS)
                block = os.urandom(1 << 20)
                for _ in range(args.mib):
                    httpx.post(f"{server.url}/v1/stream/cold", content=block, headers=OCTETS, timeout=60)
                wait_until(lambda: len(segment_files(Path(tmp), "cold")) == 1, timeout=300, what="upload")
                # The hot stream is written after the archiver is done, in one segment kept local.
                server.stop()
                server = cold_server(
                    Path(tmp),
                    moto,
                    "--segment-max-bytes",
                    f"{args.mib + 8}MiB",
                    "--cold-cache-bytes",
                    "1MiB",
                    "--log-level",
                    "warning",
                )
                for _ in range(args.mib):
                    httpx.post(f"{server.url}/v1/stream/hot", content=block, headers=OCTETS, timeout=60)
                for name in ("hot", "cold"):
                    size, seconds = catch_up(f"{server.url}/v1/stream/{name}")
                    print(
                        f"catch-up from {name}: {size / 2**20:.0f} MiB in {seconds:.2f} s = "
                        f"{size / 2**20 / seconds:.1f} MiB/s"
                    )
            finally:
                server.stop()
    finally:
        moto.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
