"""`python -m tests.crashing_server MARKER serve ARGS...`: `streamkeep serve`, killed with SIGKILL
the moment it is about to write segment bytes that contain MARKER (taken as UTF-8).

A deterministic crash point between two durable steps, for tests that need a kill -9 exactly
there: e.g. after a stream's create is on disk and before its `__registry__` entry is written
(tests/test_registry.py). It reuses the scripted file system of the in-process storage tests
(tests/faultyfs.py): every pwrite of the disk storage goes through it, and the server itself has
no test hook. Creates write their files with write(), so a marker in a stream's name alone does
not fire before the stream exists: pick one only the later write holds.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from streamkeep import assemble, cli
from streamkeep.storage.disk.storage import DiskStorage
from tests.faultyfs import FaultyFS


def main() -> int:
    marker = sys.argv[1].encode()
    fs = FaultyFS()

    def pwrite(real: Callable[..., int], fd: int, data: Any, offset: int) -> int:
        if marker in bytes(data):
            os.kill(os.getpid(), signal.SIGKILL)  # kill -9 itself: no cleanup, nothing flushed
        return real(fd, data, offset)

    fs.script("pwrite", pwrite)

    class CrashingDiskStorage(DiskStorage):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "fs": fs})  # in place of the real file system

    # A subclass, so the server's isinstance checks still see disk storage.
    assemble.DiskStorage = CrashingDiskStorage  # type: ignore[misc]
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
