"""Subscription state on disk: one CBOR file per subscription, replaced crash-safely (write, fsync,
rename, fsync the directory), and changes that are saved before anyone is told, or undone.

Without a directory (memory storage) nothing is written, but changes still undo when they fail
half way, so a rejected request never leaves half its acks applied.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import cbor2
import trio

from streamkeep.storage import files
from streamkeep.subscriptions.faults import Faults
from streamkeep.subscriptions.state import Subscription

log = logging.getLogger("streamkeep.subscriptions")

SUFFIX = ".cbor"


class Store:
    def __init__(self, directory: Path | None, faults: Faults, fs: files.FileSystem = files.OS) -> None:
        self.directory = directory
        self.faults = faults
        self.fs = fs

    def load(self) -> list[Subscription]:
        """Every saved subscription (blocking: run it in a thread). A damaged file is logged and
        skipped: it must not stop the server."""
        if self.directory is None:
            return []
        files.makedirs(self.fs, self.directory)
        loaded = []
        for name in sorted(self.fs.listdir(self.directory)):
            if not name.endswith(SUFFIX) or name.startswith("."):  # `.x.cbor.tmp`: an unfinished save
                continue
            path = os.path.join(self.directory, name)
            try:
                loaded.append(Subscription.from_state(cbor2.loads(files.read_file(self.fs, path))))
            except Exception as error:
                log.error("subscriptions: cannot load %s: %s", path, error)
        if loaded:
            log.info("subscriptions: recovered %d", len(loaded))
        return loaded

    async def save(self, sub: Subscription) -> None:
        """Raises SaveFailed (507/503) when the file system refuses."""
        if self.directory is None:
            return
        data = cbor2.dumps(sub.to_state())
        try:
            await trio.to_thread.run_sync(files.replace, self.fs, self.directory, sub.id + SUFFIX, data)
        except OSError as error:
            raise self.faults.save_failed(error) from error
        self.faults.save_ok()

    async def forget(self, sub: Subscription) -> None:
        if self.directory is None:
            return
        path = os.path.join(self.directory, sub.id + SUFFIX)
        try:
            await trio.to_thread.run_sync(files.unlink_quietly, self.fs, path)
        except OSError as error:
            raise self.faults.save_failed(error) from error

    @asynccontextmanager
    async def change(self, sub: Subscription, *, links: bool = True) -> AsyncIterator[None]:
        """`async with store.change(sub):` (holding `sub.lock`) makes the block's changes to `sub`
        durable before it ends; if the block or the save fails, `sub` is as it was before.
        `links=False` for a block that never moves a cursor (saves copying every link)."""
        before = sub.capture(links=links)
        try:
            yield
            if sub.capture(links=links) != before:
                await self.save(sub)
        except BaseException:
            sub.restore(before)
            raise
