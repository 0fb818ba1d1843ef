"""Compaction of a big State Protocol stream: how long, how much memory, and what it does to the
appends of other streams meanwhile.

    python -m ops.bench_compaction [--gib 1] [--keys 100000]

Starts `streamkeep serve` on disk (fsync always), fills one JSON stream with change messages
(inserts, updates and deletes over `--keys` keys, ~1 KiB each, 1 MiB per POST) to `--gib`, then
runs `streamkeep compact` against it while a second client appends 100 B messages to another
stream one at a time. Reports the compaction's time and the server's peak RSS (from /proc, sampled
every 50 ms), and the other stream's append latency before and during the compaction.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from ops.loadtest.servers import rss_bytes
from ops.serverproc import ROOT, start

JSON = {"Content-Type": "application/json"}


def fill(url: str, target: int, keys: int) -> int:
    rng = random.Random(1)
    padding = "x" * 900
    written = 0
    n = 0
    with httpx.Client(timeout=60) as client:
        while written < target:
            batch = []
            size = 0
            while size < (1 << 20):
                op = rng.choices(["insert", "update", "delete"], [3, 6, 1])[0]
                message: dict = {
                    "type": "item",
                    "key": f"k{rng.randrange(keys)}",
                    "headers": {"operation": op},
                }
                if op != "delete":
                    message["value"] = {"n": n, "pad": padding}
                encoded = json.dumps(message)
                batch.append(encoded)
                size += len(encoded) + 1
                n += 1
            body = ("[" + ",".join(batch) + "]").encode()
            response = client.post(url, content=body, headers=JSON)
            response.raise_for_status()
            written += len(body)
            if written // (64 << 20) != (written - len(body)) // (64 << 20):
                print(f"  filled {written >> 20} MiB", flush=True)
    return n


def latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.post(url, content=b'{"ping": 1}', headers=JSON).raise_for_status()
            out.append(time.perf_counter() - started)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))] * 1000 if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--keys", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        server = start("--storage", "disk", "--data-dir", str(Path(tmp) / "d"), "--log-level", "warning",
                       "--max-total-bytes", "64GiB", "--max-stream-bytes", "32GiB", "--max-body-bytes", "8MiB")  # fmt: skip
        try:
            big = f"{server.url}/v1/stream/state/big"
            other = f"{server.url}/v1/stream/other"
            httpx.put(big, headers=JSON).raise_for_status()
            httpx.put(other, headers=JSON).raise_for_status()
            print(f"filling {args.gib:g} GiB over {args.keys:,} keys ...", flush=True)
            started = time.monotonic()
            messages = fill(big, int(args.gib * (1 << 30)), args.keys)
            print(f"  {messages:,} messages in {time.monotonic() - started:.0f} s", flush=True)
            before: list[float] = []
            stop = threading.Event()
            thread = threading.Thread(target=latencies, args=(other, stop, before))
            thread.start()
            time.sleep(5)
            stop.set()
            thread.join()
            rss_idle = rss_bytes(server.process.pid)
            during: list[float] = []
            stop = threading.Event()
            peak = [rss_idle]

            def sample() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], rss_bytes(server.process.pid))
                    time.sleep(0.05)

            samplers = [
                threading.Thread(target=sample),
                threading.Thread(target=latencies, args=(other, stop, during)),
            ]
            for thread in samplers:
                thread.start()
            started = time.monotonic()
            result = subprocess.run([sys.executable, "-m", "streamkeep", "compact", server.url, "state/big"],
                                    capture_output=True, text=True, cwd=ROOT)  # fmt: skip
            seconds = time.monotonic() - started
            stop.set()
            for thread in samplers:
                thread.join()
            if result.returncode != 0:
                print(result.stderr)
                return 1
            report = json.loads(result.stdout)
        finally:
            server.stop()
    print(
        f"\ncompaction of a {args.gib:g} GiB State Protocol stream ({messages:,} messages, {args.keys:,} keys)\n"
    )
    print("| measure | value |\n|---|---|")
    print(f"| compaction time (streamkeep compact, wall) | {seconds:.1f} s |")
    print(
        f"| history folded | {report['history_bytes'] / (1 << 20):,.0f} MiB, {report['messages_folded']:,} messages |"
    )
    print(f"| snapshot | {report['snapshot_bytes'] / (1 << 20):,.1f} MiB, {report['keys']:,} keys |")
    print(f"| server RSS idle before / peak during | {rss_idle >> 20} MiB / {peak[0] >> 20} MiB |")
    print(f"| other stream's appends before: p50 / p99 / max | {percentile(before, .5):.2f} / "
          f"{percentile(before, .99):.2f} / {max(before) * 1000:.1f} ms ({len(before)} appends) |")  # fmt: skip
    print(f"| during the compaction: p50 / p99 / max | {percentile(during, .5):.2f} / "
          f"{percentile(during, .99):.2f} / {max(during) * 1000:.1f} ms ({len(during)} appends) |")  # fmt: skip
    print(f"| appends/s of the other stream before / during | {len(before) / 5:.0f} / "
          f"{len(during) / seconds:.0f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
