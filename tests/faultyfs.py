"""The real file system with scripted faults, for in-process storage tests on a real disk.

    fs = FaultyFS()
    fs.script("pwrite", short_then_enospc)   # every pwrite goes through the function until cleared
    fs.clear()

A script gets the real call and its arguments and decides: call it, call it with less, raise.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

from streamkeep.storage.files import OsFileSystem


class FaultyFS(OsFileSystem):
    def __init__(self) -> None:
        self.scripts: dict[str, Callable[..., Any]] = {}
        self.calls: dict[str, int] = {}

    def script(self, op: str, fn: Callable[..., Any]) -> None:
        self.scripts[op] = fn

    def clear(self) -> None:
        self.scripts.clear()

    def __getattribute__(self, name: str) -> Any:
        scripts = object.__getattribute__(self, "scripts")
        real = object.__getattribute__(self, name)
        if name.startswith("_") or not callable(real) or name in ("script", "clear"):
            return real
        calls = object.__getattribute__(self, "calls")

        def call(*args: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            fn = scripts.get(name)
            return real(*args) if fn is None else fn(real, *args)

        return call


def enospc(*_: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


def eio(*_: Any) -> Any:
    raise OSError(errno.EIO, "Input/output error")


def half_then_enospc() -> Callable[..., Any]:
    """pwrite: writes half of the first call's data and returns the short count (as a filling disk
    does), then raises ENOSPC for the rest."""
    state = {"short": False}

    def pwrite(real: Callable[..., int], fd: int, data: Any, offset: int) -> int:
        if not state["short"]:
            state["short"] = True
            return real(fd, bytes(data)[: max(1, len(data) // 2)], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    return pwrite
