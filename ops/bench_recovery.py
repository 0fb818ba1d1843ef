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
from streamkeep.segments import format as fmt
from streamkeep.segments import layout
from streamkeep.storage import files
from streamkeep.storage.base import ByteBudget
from streamkeep.storage.disk.directory import DataDirectory
from streamkeep.storage.disk.meta import encode_meta
from streamkeep.storage.disk.storage import DiskStorage


def budget() -> ByteBudget:
    return ByteBudget(max_stream_bytes=1 << 30, max_total_bytes=1 << 40)


def write_streams(root: Path, names: list[str], appends: int, body: bytes = b"created;") -> None:
    """Writes stream directories as disk storage's create and appends leave them (meta, one
    segment of `1 + appends` records), straight to files: fast, and no descriptor stays open, so
    100,000 streams fit under a 20,000-descriptor limit. Progress every 10,000."""
    directory = DataDirectory(files.OS, root)
    directory.open()
    now = time.time()
    for number, name in enumerate(names, 1):
        meta = StreamMeta(name=name, stream_id=f"{number:012x}", content_type="text/plain", created_at=now)
        segment = bytearray(fmt.encode_segment_header(name, 0, meta.content_type, meta.stream_id))
        position = 0
        for payload in [body, *(b"append-%d;" % n for n in range(appends))]:
            segment += fmt.encode_append(position, int(now * 1000), [payload])
            position += len(payload)
        stream_dir = directory.stream_dir(name)
        stream_dir.mkdir()
        (stream_dir / layout.META).write_bytes(encode_meta(meta))
        (stream_dir / layout.segment_filename(0)).write_bytes(bytes(segment))
        if number % 10_000 == 0:
            print(f"  wrote {number}/{len(names)} streams", flush=True)
    os.sync()


def build(root: Path, streams: int, appends: int) -> None:
    write_streams(root, [f"tenant-{i % 100}/stream-{i}" for i in range(streams)], appends)


async def recover(root: Path) -> tuple[float, int, int]:
    storage = DiskStorage(root, budget=budget())
    async with trio.open_nursery() as nursery:
        started = time.perf_counter()
        report = await storage.start(nursery)
        elapsed = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    return elapsed, report.streams, report.records


async def serve_early(root: Path, name: str) -> tuple[float, float, float]:
    """`start(serve_after=0)` (what `--read-before-serving 0` does): seconds until it returned,
    until `name` (the last stream in reading order) was open, and until every stream was read."""
    storage = DiskStorage(root, budget=budget())
    async with trio.open_nursery() as nursery:
        started = time.perf_counter()
        await storage.start(nursery, serve_after=0)
        serving = time.perf_counter() - started
        assert storage.open(name) is not None
        first = time.perf_counter() - started
        await storage.recovered()
        every = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    return serving, first, every


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
        build(Path(tmp), args.streams, args.appends)
        cache = "warm page cache"
        if args.cold:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            cache = "cold page cache"
        elapsed, streams, records = trio.run(recover, Path(tmp))
        last = sorted(Path(tmp, layout.STREAMS).iterdir())[-1].name
        serving, first, every = trio.run(serve_early, Path(tmp), layout.stream_name(last) or last)
        print(
            f"recovered {streams} streams ({records} appends, every record checksummed) in {elapsed:.2f} s, "
            f"{cache}",
            flush=True,
        )
        print(
            f"served early (--read-before-serving 0): serving after {serving:.2f} s, the last stream in "
            f"reading order open after {first:.2f} s, every stream read after {every:.2f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
