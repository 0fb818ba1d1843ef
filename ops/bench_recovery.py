"""Recovery time: build N streams with a few appends each on disk, then time a cold start.

python -m ops.bench_recovery [--streams 10000] [--appends 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import trio

from streamkeep.protocol.stream import StreamMeta
from streamkeep.storage.base import AppendRecord, ByteBudget
from streamkeep.storage.disk.storage import DiskStorage


def budget() -> ByteBudget:
    return ByteBudget(max_stream_bytes=1 << 30, max_total_bytes=1 << 40)


async def build(root: Path, streams: int, appends: int) -> None:
    storage = DiskStorage(root, budget=budget(), fsync="never")
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        for i in range(streams):
            meta = StreamMeta(
                name=f"tenant-{i % 100}/stream-{i}",
                stream_id=str(i),
                content_type="text/plain",
                created_at=time.time(),
            )
            log = await storage.create(meta, [b"created;"])
            for n in range(appends):
                await log.submit(AppendRecord([b"append-%d;" % n], log.meta, None, False, None)).wait()
            if (i + 1) % 2000 == 0:
                print(f"  built {i + 1}/{streams} streams", flush=True)
        nursery.cancel_scope.cancel()


async def recover(root: Path) -> tuple[float, int, int]:
    storage = DiskStorage(root, budget=budget())
    async with trio.open_nursery() as nursery:
        started = time.perf_counter()
        report = await storage.start(nursery)
        elapsed = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    return elapsed, report.streams, report.records


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=10_000)
    parser.add_argument("--appends", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="drop the page cache first (needs root)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"building {args.streams} streams with {args.appends + 1} appends each ...", flush=True)
        trio.run(build, Path(tmp), args.streams, args.appends)
        cache = "warm page cache"
        if args.cold:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            cache = "cold page cache"
        elapsed, streams, records = trio.run(recover, Path(tmp))
    print(
        f"recovered {streams} streams ({records} appends, every record checksummed) in {elapsed:.2f} s, {cache}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
