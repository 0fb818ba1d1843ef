"""Group-committed stream creation on a real disk (issue 26): a create whose staging directory
cannot be made (a full disk) fails alone with 507, leaves nothing, and its name is free again;
tests/test_disk_creates.py covers rounds and power cuts on the simulated file system."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import trio

from streamkeep.segments import layout
from streamkeep.storage.disk.storage import DiskStorage
from streamkeep.storage.errors import StorageUnavailable
from tests.faultyfs import FaultyFS
from tests.test_storage_faults import new_meta, storage_on

CREATES = 40


async def create_all(storage: DiskStorage, names: list[str]) -> dict[str, Exception | None]:
    outcomes: dict[str, Exception | None] = {}

    async def one(name: str) -> None:
        try:
            await storage.create(new_meta(name), [b"first;"])
        except (StorageUnavailable, OSError) as error:
            outcomes[name] = error
        else:
            outcomes[name] = None

    async with trio.open_nursery() as nursery:
        for name in names:
            nursery.start_soon(one, name)
    return outcomes


def staging_left(root: Path) -> list[str]:
    return [p.name for p in (root / layout.STREAMS).iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("failing_call", [3, 17])
async def test_one_failed_create_fails_only_itself_and_leaves_nothing(
    tmp_path: Path, failing_call: int
) -> None:
    fs = FaultyFS()
    calls = {"mkdir": 0}

    def mkdir(real: Any, path: Any) -> Any:
        calls["mkdir"] += 1
        if calls["mkdir"] == failing_call:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path)

    names = [f"some/{i}" for i in range(CREATES)]
    async with storage_on(tmp_path, fs) as storage:
        fs.script("mkdir", mkdir)
        outcomes = await create_all(storage, names)
        fs.clear()
        failed = {name: error for name, error in outcomes.items() if error is not None}
        assert len(failed) == 1
        (error,) = failed.values()
        assert isinstance(error, StorageUnavailable) and error.status == 507
        made = [name for name, error in outcomes.items() if error is None]
        assert len(made) == CREATES - 1
        (lost,) = failed
        assert lost not in storage._logs and all(name in storage._logs for name in made)
        # The name is free again: a retry creates it.
        await storage.create(new_meta(lost), [b"again;"])
    assert staging_left(tmp_path) == []
