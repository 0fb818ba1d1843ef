"""`streamkeep` under tracemalloc, writing a snapshot every few seconds (ops/soak.py --tracemalloc).

    python -m ops.traced_serve DIR SECONDS FRAMES serve [flags]

A daemon thread takes a snapshot (after a collection, so cycles that are garbage are not counted)
every SECONDS into DIR/NNNN.snapshot; the soak diffs two of them by traceback to say where the
memory that stayed went. Everything after FRAMES is `python -m streamkeep`'s command line.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import tracemalloc
from pathlib import Path


def _dump(folder: Path, every: float) -> None:
    number = 0
    while True:
        time.sleep(every)
        gc.collect()
        snapshot = tracemalloc.take_snapshot()
        path = folder / f"{number:04d}.snapshot"
        snapshot.dump(str(path) + ".part")
        Path(str(path) + ".part").rename(path)  # the soak never reads half a snapshot
        with open(folder / "traced.txt", "a") as totals:  # the trend, not only two points
            totals.write(f"{number} {tracemalloc.get_traced_memory()[0]}\n")
        number += 1


def main() -> None:
    folder, every, frames = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    folder.mkdir(parents=True, exist_ok=True)
    from streamkeep.cli import main as cli_main  # imported untraced: a start under it takes long

    tracemalloc.start(frames)
    threading.Thread(target=_dump, args=(folder, every), daemon=True).start()
    raise SystemExit(cli_main(sys.argv[4:]))


if __name__ == "__main__":
    main()
