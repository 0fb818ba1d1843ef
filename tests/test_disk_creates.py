"""Group-committed stream creation (storage/disk/creates.py) on the simulated file system: creates
share rounds, a power cut at any call of a round leaves whole streams or none, and one failing
create fails only itself; a create on its own (`create_now`, restore's) is the same steps, with
the same guarantees."""

from __future__ import annotations

import contextlib
import errno
import os
import random
from pathlib import Path
from typing import Any

import pytest
import trio

from ops.torture.simfs import FaultPlan, SimFileSystem
from streamkeep.protocol.stream import StreamMeta
from streamkeep.segments import format as fmt
from streamkeep.segments import layout
from streamkeep.storage.base import ByteBudget
from streamkeep.storage.disk.creates import create_now
from streamkeep.storage.disk.directory import DataDirectory
from streamkeep.storage.disk.meta import encode_meta
from streamkeep.storage.disk.storage import DiskStorage
from streamkeep.storage.errors import StorageUnavailable

ROOT = Path("/data")
CREATES = 8


def new_meta(name: str) -> StreamMeta:
    return StreamMeta(name=name, stream_id=name, content_type="text/plain", created_at=0.0, last_access=0.0)


class Counting(SimFileSystem):
    """Counts fsyncs by path, cuts the power at the `cut_at`-th mutating call (then every call
    fails, as on a machine that lost power), and fails writes whose bytes hold `fail_marker`."""

    def __init__(self, cut_at: int | None = None, fail_marker: bytes | None = None) -> None:
        super().__init__(faults=FaultPlan(random.Random(3), rates={}, enabled=False))
        self.paths: dict[int, str] = {}
        self.fsyncs: dict[str, int] = {}
        self.calls = 0
        self.cut_at = cut_at
        self.after_cut: SimFileSystem | None = None
        self.fail_marker = fail_marker

    def _tick(self) -> None:
        self.calls += 1
        if self.cut_at is not None and self.calls == self.cut_at and self.after_cut is None:
            self.after_cut = self.power_cut(random.Random(self.cut_at))

    def open(self, path: Any, flags: int, mode: int = 0o644) -> int:
        self._tick()
        fd = super().open(path, flags, mode)
        self.paths[fd] = os.fspath(path)
        return fd

    def write(self, fd: int, data: Any) -> int:
        self._tick()
        if self.fail_marker is not None and self.fail_marker in bytes(data):
            raise OSError(errno.EIO, "Input/output error")
        return super().write(fd, data)

    def fsync(self, fd: int) -> None:
        self._tick()
        super().fsync(fd)
        path = self.paths.get(fd, "?")
        self.fsyncs[path] = self.fsyncs.get(path, 0) + 1

    def mkdir(self, path: Any) -> None:
        self._tick()
        super().mkdir(path)

    def rename(self, source: Any, target: Any) -> None:
        self._tick()
        super().rename(source, target)


def storage_on(fs: SimFileSystem) -> DiskStorage:
    return DiskStorage(ROOT, budget=ByteBudget(max_stream_bytes=1 << 24, max_total_bytes=1 << 26), fs=fs)


async def create_many(storage: DiskStorage, names: list[str]) -> dict[str, Any]:
    """Creates every name at once; returns each one's stream log or the exception it raised."""
    outcomes: dict[str, Any] = {}

    async def one(name: str) -> None:
        try:
            outcomes[name] = await storage.create(new_meta(name), [f"{name};".encode()])
        except Exception as error:  # collected: the test looks at each outcome
            outcomes[name] = error

    async with trio.open_nursery() as nursery:
        for name in names:
            nursery.start_soon(one, name)
    return outcomes


async def test_concurrent_creates_share_rounds_and_the_streams_directory_sync() -> None:
    fs = Counting()
    storage = storage_on(fs)
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        base_rounds = storage.creates.rounds
        streams_syncs = fs.fsyncs.get(str(ROOT / layout.STREAMS), 0)
        outcomes = await create_many(storage, [f"s{i}" for i in range(CREATES)])
        assert all(not isinstance(o, Exception) for o in outcomes.values()), outcomes
        # One create at a time took CREATES rounds and CREATES fsyncs of streams/; shared, fewer.
        assert storage.creates.rounds - base_rounds < CREATES
        assert fs.fsyncs.get(str(ROOT / layout.STREAMS), 0) - streams_syncs < CREATES
        assert storage.creates.created == CREATES
        nursery.cancel_scope.cancel()
    storage.close()


async def test_a_create_whose_caller_is_cancelled_ends_all_the_same() -> None:
    """A create already queued is waited for through a cancel (creates.py `PendingCreate.wait`):
    the stream made on disk is known to the storage, and the cancel comes at the next checkpoint."""
    fs = Counting()
    storage = storage_on(fs)
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        made: list[Any] = []
        with trio.CancelScope() as scope:
            scope.cancel()
            made.append(await storage.create(new_meta("c"), [b"c;"]))
            await trio.lowlevel.checkpoint()
            made.append("not cancelled")
        assert made == [storage.open("c")] and made[0] is not None
        assert storage.creates.created == 1
        nursery.cancel_scope.cancel()
    storage.close()


async def test_one_failing_create_fails_only_itself() -> None:
    fs = Counting(fail_marker=b"bad-one")
    storage = storage_on(fs)
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        rounds = storage.creates.rounds
        names = ["bad-one", *(f"good{i}" for i in range(CREATES - 1))]
        outcomes = await create_many(storage, names)
        assert isinstance(outcomes["bad-one"], StorageUnavailable)
        assert all(not isinstance(outcomes[n], Exception) for n in names[1:]), outcomes
        assert storage.creates.rounds - rounds < CREATES  # they did share rounds with the failing one
        assert storage.open("bad-one") is None
        assert not [n for n in fs.listdir(ROOT / layout.STREAMS) if n.startswith(".tmp-")]
        nursery.cancel_scope.cancel()
    storage.close()
    # After a power cut the good ones are all there (acknowledged means durable), the bad one not.
    after = fs.power_cut(random.Random(5))
    again = storage_on(after)
    async with trio.open_nursery() as nursery:
        report = await again.start(nursery)
        assert not report.skipped
        assert set(again.names()) == set(names[1:])
        nursery.cancel_scope.cancel()
    again.close()


async def _calls_of_a_round() -> int:
    fs = Counting()
    storage = storage_on(fs)
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        before = fs.calls
        await create_many(storage, [f"s{i}" for i in range(CREATES)])
        nursery.cancel_scope.cancel()
    storage.close()
    return fs.calls - before


@pytest.mark.parametrize("sync_method", ["fdatasync", "syncfs"])
async def test_a_power_cut_at_any_call_of_the_creates_leaves_whole_streams_or_none(sync_method: str) -> None:
    steps = await _calls_of_a_round()
    assert steps > CREATES  # a mkdir, files and renames per create at least
    for cut_at in range(1, steps + 1):
        fs = Counting()
        storage = DiskStorage(
            ROOT,
            budget=ByteBudget(max_stream_bytes=1 << 24, max_total_bytes=1 << 26),
            fs=fs,
            sync_method=sync_method,
        )
        async with trio.open_nursery() as nursery:
            await storage.start(nursery)
            fs.cut_at = fs.calls + cut_at
            outcomes = await create_many(storage, [f"s{i}" for i in range(CREATES)])
            nursery.cancel_scope.cancel()
        with contextlib.suppress(OSError):  # the machine is off after the cut
            storage.close()
        acknowledged = {name for name, o in outcomes.items() if not isinstance(o, Exception)}
        after = fs.after_cut or fs.power_cut(random.Random(cut_at))
        again = storage_on(after)
        async with trio.open_nursery() as nursery:
            report = await again.start(nursery)
            # Whole or nothing: no stream is damaged, every one there holds its first message,
            # no staging directory is left, and every acknowledged create survived.
            assert not report.skipped, (cut_at, report.skipped)
            for name in again.names():
                stream_log = again.open(name)
                assert stream_log is not None and stream_log.published_tail == len(f"{name};"), (cut_at, name)
            assert acknowledged <= set(again.names()), cut_at
            assert not [n for n in after.listdir(ROOT / layout.STREAMS) if n.startswith(".tmp-")]
            nursery.cancel_scope.cancel()
        again.close()


def stream_contents(name: str) -> dict[str, bytes]:
    """What storage.create writes for a stream holding one message (restore writes the same kind)."""
    meta = new_meta(name)
    segment = fmt.encode_segment_header(name, 0, meta.content_type, meta.stream_id)
    segment += fmt.encode_append(0, 0, [f"{name};".encode()])
    return {layout.META: encode_meta(meta), layout.segment_filename(0): segment}


def create_alone(fs: SimFileSystem, name: str) -> bool:
    """One create through `create_now` (restore's path, a round of one); True if it was acknowledged."""
    directory = DataDirectory(fs, ROOT)
    try:
        create_now(fs, directory.streams, directory.stream_dir(name), stream_contents(name))
    except OSError:  # NotDurable too: it may not survive, so it counts as not acknowledged
        return False
    return True


async def test_a_create_on_its_own_is_the_same_whole_or_nothing_at_a_power_cut_at_any_call() -> None:
    def prepared(cut_at: int | None = None) -> Counting:
        fs = Counting()
        DataDirectory(fs, ROOT).open()
        fs.cut_at = None if cut_at is None else fs.calls + cut_at
        return fs

    fs = prepared()
    before = fs.calls
    assert create_alone(fs, "alone")
    steps = fs.calls - before
    # mkdir, two files (open, write, fsync each), the staging directory's and streams/'s fsyncs, a rename
    assert steps >= 9 and fs.fsyncs.get(str(ROOT / layout.STREAMS), 0) >= 1
    for cut_at in range(1, steps + 1):
        fs = prepared(cut_at)
        acknowledged = create_alone(fs, "alone")
        after = fs.after_cut or fs.power_cut(random.Random(cut_at))
        again = storage_on(after)
        async with trio.open_nursery() as nursery:
            report = await again.start(nursery)
            assert not report.skipped, (cut_at, report.skipped)
            names = set(again.names())
            assert names <= {"alone"} and (not acknowledged or names == {"alone"}), (cut_at, names)
            for name in names:
                stream_log = again.open(name)
                assert stream_log is not None and stream_log.published_tail == len(b"alone;"), cut_at
            assert not [n for n in after.listdir(ROOT / layout.STREAMS) if n.startswith(".tmp-")]
            nursery.cancel_scope.cancel()
        again.close()


def test_a_create_on_its_own_that_fails_leaves_nothing_and_a_taken_name_is_refused() -> None:
    fs = Counting(fail_marker=b"broken;")
    DataDirectory(fs, ROOT).open()
    with pytest.raises(OSError, match="Input/output error"):
        create_now(fs, ROOT / layout.STREAMS, ROOT / layout.STREAMS / "broken", stream_contents("broken"))
    assert fs.listdir(ROOT / layout.STREAMS) == []
    assert create_alone(fs, "taken")
    with pytest.raises(FileExistsError):
        directory = DataDirectory(fs, ROOT)
        create_now(fs, directory.streams, directory.stream_dir("taken"), stream_contents("taken"))
    assert len(fs.listdir(ROOT / layout.STREAMS)) == 1
