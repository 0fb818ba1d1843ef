"""Rows/s of the Spark batch source over 1M messages, from local segments and from S3 segments.

    python -m ops.bench_spark [--messages 1000000]

The messages go in through the HTTP API (JSON batches of 1,000) with the cold tier on moto_server
and --cold-keep-local, so the same sealed segments exist on disk and in the bucket. Each read
forces every row (count and payload bytes); Spark's start-up is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.test_cold import CREDENTIALS, Moto, cold_server, wait_until


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=1_000_000)
    args = parser.parse_args()
    os.environ.update(CREDENTIALS)
    moto = Moto()
    moto.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            server = cold_server(
                Path(tmp), moto, "--cold-keep-local", "--segment-max-bytes", "4MiB", "--log-level", "warning"
            )
            started = time.perf_counter()
            with httpx.Client(base_url=server.url, timeout=60) as client:
                client.put("/v1/stream/bench/events", headers={"Content-Type": "application/json"})
                for batch in range(args.messages // 1000):
                    body = json.dumps([{"n": batch * 1000 + i, "kind": "tick"} for i in range(1000)])
                    client.post(
                        "/v1/stream/bench/events", content=body, headers={"Content-Type": "application/json"}
                    )
                    if batch % 200 == 199:
                        print(f"  written {(batch + 1) * 1000:,} messages", file=sys.stderr, flush=True)
                client.post(
                    "/v1/stream/bench/events",
                    content=b'{"last":true}',
                    headers={"Content-Type": "application/json"},
                )
            print(f"wrote {args.messages:,} messages in {time.perf_counter() - started:.1f} s", flush=True)
            directory = Path(tmp) / "streams" / "bench%2Fevents"

            def uploaded() -> bool:
                import cbor2

                local = len(list(directory.glob("*.seg")))
                manifest = directory / "cold.cbor"
                cold = len(cbor2.loads(manifest.read_bytes())["segments"]) if manifest.exists() else 0
                return cold == local - 1

            wait_until(uploaded, timeout=600, what="every sealed segment in the bucket")
            server.stop()
            from ops.spark.common import session

            spark = session("streamkeep-bench")
            for label, path, options in (
                ("local segments", tmp, {}),
                ("S3 segments", "s3://archive/prod", {"endpoint": moto.url}),
            ):
                reader = spark.read.format("streamkeep")
                for key, value in options.items():
                    reader = reader.option(key, value)
                frame = reader.load(path)
                frame.selectExpr("count(*)").collect()  # warm up: plan, workers, JIT
                started = time.perf_counter()
                rows, size = frame.selectExpr("count(*)", "coalesce(sum(length(payload)), 0)").collect()[0]
                seconds = time.perf_counter() - started
                print(
                    f"{label}: {rows:,} rows ({size / 2**20:.0f} MiB payload) in {seconds:.2f} s = "
                    f"{rows / seconds:,.0f} rows/s",
                    flush=True,
                )
    finally:
        moto.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
