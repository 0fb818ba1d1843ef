"""The file system's floor for stream creation: the server's own create steps, without the server.

    python -m ops.create_floor [--dir DIR] [--creates 6400] [--round 64] [--json FILE]

A durable create (storage/disk/creates.py) makes a stream's directory in staging with its two
files, syncs them, renames it into place and syncs `streams/` once a round. This runs exactly
those steps (`creates.build` and `creates.commit`, the code a create round runs) in one thread,
in rounds of `--round`, on `--dir`'s file system (default: a temporary directory, as
`bench-streams` uses), so what a create costs the kernel is measured apart from HTTP, actors and
the registry:

- `fdatasync`: the default `--sync-method`, each file and the staging directory synced;
- `syncfs`: nothing synced per create, one syncfs() a round;
- `one file`: for comparison, what a create would cost as one record in a shared file synced
  once a round (a catalog layout, which streamkeep does not have): the floor a different layout
  would have.

One thread is what a round of `syncfs` uses; an `fdatasync` round builds its creates in up to four
threads (creates.MAX_THREADS), which a journalled file system can turn into shared journal commits,
so there the server may beat this figure. Where each fsync is its own flush (the 2-core dev VM's
ext4 has no journal), `bench-streams` at or near the `fdatasync` figure means the kernel's work,
not Python, sets the pace (issue 26).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from streamkeep.storage.disk import creates
from streamkeep.storage.files import OsFileSystem

META = b"m" * 150  # about a real meta.cbor's size
SEGMENT = b"h" * 80  # about a real segment header's


@dataclass
class Floor:
    method: str
    creates: int
    per_second: float
    user_us: float
    sys_us: float


def cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def measure(method: str, count: int, round_size: int, run_round: Callable[[int], None]) -> Floor:
    user, system = cpu()
    started = time.perf_counter()
    for number in range(count // round_size):
        run_round(number)
    seconds = time.perf_counter() - started
    user_after, system_after = cpu()
    done = count // round_size * round_size
    return Floor(
        method, done, done / seconds, (user_after - user) / done * 1e6, (system_after - system) / done * 1e6
    )


def server_steps(fs: OsFileSystem, streams: Path, round_size: int, syncfs: bool) -> Callable[[int], None]:
    """One create round as the server runs it (its worker threads aside)."""
    root_fd = os.open(streams, os.O_RDONLY)  # as the storage keeps one: closed with the process

    def run_round(number: int) -> None:
        built = []
        for index in range(round_size):
            pending = creates.PendingCreate(
                streams / f"r{number}-s{index}", {"meta.cbor": META, "0000000000000000.seg": SEGMENT}
            )
            creates.build(fs, os.fspath(streams), pending, sync=not syncfs)
            if pending.error is not None:
                raise pending.error
            built.append(pending)
        creates.commit(fs, streams, built, (lambda: fs.syncfs(root_fd)) if syncfs else None)
        for pending in built:
            if pending.error is not None:
                raise pending.error

    return run_round


def one_file(path: Path, round_size: int) -> Callable[[int], None]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    record = META + SEGMENT

    def run_round(number: int) -> None:
        os.write(fd, record * round_size)
        os.fdatasync(fd)

    return run_round


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, help="a directory on the file system to measure")
    parser.add_argument("--creates", type=int, default=6400)
    parser.add_argument("--round", type=int, default=64, help="creates per round (one directory sync each)")
    parser.add_argument("--json", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args(argv)
    if args.creates < args.round:
        parser.error("--creates must be at least --round")
    base = Path(tempfile.mkdtemp(prefix="create-floor-", dir=args.dir))
    fs = OsFileSystem()
    floors = []
    try:
        for method in ("fdatasync", "syncfs", "one file"):
            work = base / method.replace(" ", "-")
            streams = work / "streams"
            streams.mkdir(parents=True)
            print(f"{method}: {args.creates} creates in rounds of {args.round} ...", flush=True)
            if method == "one file":
                run_round = one_file(work / "catalog", args.round)
            else:
                run_round = server_steps(fs, streams, args.round, syncfs=method == "syncfs")
            floors.append(measure(method, args.creates, args.round, run_round))
            shutil.rmtree(work)  # the next method starts from an empty directory, as the first did
    finally:
        shutil.rmtree(base, ignore_errors=True)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print()
    print(f"## Create floor ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load {load})")
    print(f"file system of {args.dir or tempfile.gettempdir()}, one thread, rounds of {args.round}")
    print("| method | creates/s | CPU per create (user + sys) |")
    print("|---|---|---|")
    for floor in floors:
        print(
            f"| {floor.method} | {floor.per_second:,.0f} "
            f"| {floor.user_us + floor.sys_us:.0f} us ({floor.user_us:.0f} + {floor.sys_us:.0f}) |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(floor) for floor in floors], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
