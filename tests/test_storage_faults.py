"""The disk storage in process, on a real disk with scripted faults (tests/faultyfs.py): what a
failed write, sync or rotation leaves behind (issue 11)."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from streamkeep.actors.supervisor import Supervisor
from streamkeep.protocol.model import Headers, Request
from streamkeep.protocol.stream import StreamMeta
from streamkeep.server.service import Service, ServiceOptions
from streamkeep.storage.base import AppendRecord, ByteBudget
from streamkeep.storage.disk.log import DiskLog
from streamkeep.storage.disk.storage import DiskStorage
from streamkeep.storage.errors import StorageUnavailable
from tests.faultyfs import FaultyFS, eio, enospc


def budget() -> ByteBudget:
    return ByteBudget(max_stream_bytes=1 << 24, max_total_bytes=1 << 26)


def new_meta(name: str) -> StreamMeta:
    return StreamMeta(
        name=name, stream_id="a1b2c3d4e5f6", content_type="text/plain", created_at=0.0, last_access=0.0
    )


def record(log: DiskLog, body: bytes) -> AppendRecord:
    return AppendRecord([body], log.meta, None, False, None)


@asynccontextmanager
async def storage_on(path: Path, fs: FaultyFS, **options: Any) -> AsyncIterator[DiskStorage]:
    storage = DiskStorage(path, budget=budget(), fs=fs, **options)
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        storage.nursery = nursery  # type: ignore[attr-defined]
        try:
            yield storage
        finally:
            nursery.cancel_scope.cancel()
    storage.close()


def own_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_retried_duplicate_after_a_failed_write_is_answered_at_once(tmp_path: Path) -> None:
    """After a failed write, a retried duplicate (and an idempotent close) waited on the failed
    commit and got 503 until some other append succeeded."""
    fs = FaultyFS()
    async with storage_on(tmp_path, fs) as storage:
        service = Service(Supervisor(storage, storage.nursery), ServiceOptions())  # type: ignore[attr-defined]

        def post(body: bytes, seq: int) -> Request:
            headers = Headers(
                [
                    ("Content-Type", "text/plain"),
                    ("Producer-Id", "p"),
                    ("Producer-Epoch", "0"),
                    ("Producer-Seq", str(seq)),
                ]
            )
            return Request("POST", "/v1/stream/dup", "", headers, body)

        put = Request("PUT", "/v1/stream/dup", "", Headers([("Content-Type", "text/plain")]), b"")
        assert (await service.handle(put)).status == 201
        assert (await service.handle(post(b"zero;", 0))).status == 200
        fs.script("pwrite", enospc)
        assert (await service.handle(post(b"one;", 1))).status == 507
        fs.clear()
        retried = await service.handle(post(b"zero;", 0))  # a duplicate of what is on disk
        assert retried.status == 204, retried.body
        close = Request("POST", "/v1/stream/dup", "", Headers([("Stream-Closed", "true")]), b"")
        assert (await service.handle(close)).status == 204
        assert (await service.handle(close)).status == 204  # closing again is idempotent


async def test_a_failed_rotation_leaks_no_descriptor(tmp_path: Path) -> None:
    """The new segment's descriptor leaked when its write failed during a rotation."""
    fs = FaultyFS()
    async with storage_on(tmp_path, fs, segment_max_messages=1) as storage:
        log = await storage.create(new_meta("rot"), [b"first;"])

        def fail_new_segments(real: Any, fd: int, data: Any, offset: int) -> int:
            if offset == 0:  # a new segment's header and first record
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, data, offset)

        fs.script("pwrite", fail_new_segments)
        before = own_fds()
        for i in range(50):
            with pytest.raises(StorageUnavailable):
                await log.submit(record(log, b"x%d;" % i)).wait()
        assert own_fds() <= before + 1
        assert sorted(p.name for p in log.directory.glob("*.seg")) == ["0000000000000000.seg"]
        fs.clear()
        assert await log.submit(record(log, b"second;")).wait() == len(b"first;second;")


class Ledger:
    """Scripts that record, per descriptor, whether what was written to it was synced."""

    def __init__(self, fs: FaultyFS) -> None:
        self.unsynced: dict[int, bool] = {}
        self.paths: dict[int, str] = {}
        self.sealed_unsynced: list[str] = []
        fs.script("open", self.open)
        fs.script("pwrite", self.pwrite)
        fs.script("fdatasync", self.sync)
        fs.script("fsync", self.sync)
        fs.script("syncfs", self.syncfs)

    def open(self, real: Any, path: Any, flags: int, mode: int = 0o644) -> int:
        fd = real(path, flags, mode)
        self.paths[fd] = os.fspath(path)
        self.unsynced[fd] = False
        if flags & os.O_CREAT and os.fspath(path).endswith(".seg"):
            # a new segment: every other segment of the stream must be whole on disk by now
            directory = os.path.dirname(os.fspath(path))
            self.sealed_unsynced += [
                p for f, p in self.paths.items() if self.unsynced.get(f) and os.path.dirname(p) == directory
            ]
        return fd

    def pwrite(self, real: Any, fd: int, data: Any, offset: int) -> int:
        self.unsynced[fd] = True
        return real(fd, data, offset)

    def sync(self, real: Any, fd: int) -> None:
        real(fd)
        self.unsynced[fd] = False

    def syncfs(self, real: Any, fd: int) -> None:
        real(fd)
        self.unsynced = dict.fromkeys(self.unsynced, False)


@pytest.mark.parametrize(
    ("fsync", "sync_method"), [("interval", "fdatasync"), ("always", "syncfs"), ("never", "fdatasync")]
)
async def test_a_segment_is_synced_before_it_is_sealed(tmp_path: Path, fsync: str, sync_method: str) -> None:
    """Under --fsync interval (and with syncfs) a segment was sealed without being synced while its
    successor was synced at once: a power cut then damaged the sealed one."""
    fs = FaultyFS()
    ledger = Ledger(fs)
    options = {
        "fsync": fsync,
        "sync_method": sync_method,
        "fsync_interval": 1000.0,
        "segment_max_messages": 2,
    }
    async with storage_on(tmp_path, fs, **options) as storage:
        log = await storage.create(new_meta("seal"), [b"r0;"])
        for i in range(1, 12, 3):  # three appends per round: rounds that write to a segment and seal it
            commits = [log.submit(record(log, b"r%d;" % n)) for n in range(i, i + 3)]
            for commit in commits:
                await commit.wait()
        assert len(log.segments) >= 5
    assert ledger.sealed_unsynced == []


class DescriptorEvents:
    """FaultyFS scripts that note opens, closes and syncs by descriptor; the first sync fails."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def opened(self, real: Any, path: Any, flags: int, mode: int = 0o644) -> int:
        fd = real(path, flags, mode)
        self.events.append(("open", fd))
        return fd

    def closed(self, real: Any, fd: int) -> None:
        self.events.append(("close", fd))
        real(fd)

    def synced(self, real: Any, fd: int) -> None:
        failed = not any(kind == "failed" for kind, _ in self.events)
        self.events.append(("failed" if failed else "sync", fd))
        if failed:
            raise OSError(errno.EIO, "Input/output error")
        real(fd)


async def test_a_failed_fsync_is_never_retried_on_the_same_descriptor(tmp_path: Path) -> None:
    """After a failed fsync the kernel may have dropped the pages: the descriptor is closed, the
    file reopened and cut back to what was acknowledged, and later syncs use the new descriptor."""
    fs = FaultyFS()
    noted = DescriptorEvents()
    events = noted.events
    opened, closed, synced = noted.opened, noted.closed, noted.synced

    async with storage_on(tmp_path, fs) as storage:
        log = await storage.create(new_meta("eio"), [b"kept;"])
        assert await log.submit(record(log, b"fine;")).wait()
        for op, script in (("open", opened), ("close", closed), ("fdatasync", synced)):
            fs.script(op, script)
        with pytest.raises(StorageUnavailable) as failed:
            await log.submit(record(log, b"lost;")).wait()
        assert failed.value.status == 503
        assert await log.submit(record(log, b"after;")).wait() == len(b"kept;fine;after;")
        fs.clear()
    bad = next(fd for kind, fd in events if kind == "failed")
    after = events[events.index(("failed", bad)) + 1 :]
    assert ("close", bad) in after  # the failed descriptor was let go
    closed_at = after.index(("close", bad))
    for kind, fd in after[closed_at:]:
        if kind == "sync":  # every later sync is on a descriptor opened after the close
            assert ("open", fd) in after[closed_at : after.index((kind, fd))], events
    data = (tmp_path / "streams" / "eio" / "0000000000000000.seg").read_bytes()
    assert b"lost;" not in data and data.endswith(b"after;")


async def test_a_stream_whose_acknowledged_records_vanish_goes_read_only(tmp_path: Path) -> None:
    """If re-verification after a failed write finds the published records damaged, the stream
    refuses appends with the reason instead of writing after them."""
    fs = FaultyFS()
    async with storage_on(tmp_path, fs) as storage:
        log = await storage.create(new_meta("ro"), [b"kept;"])
        segment = log.active_segment.path
        fs.script("fdatasync", eio)
        with pytest.raises(StorageUnavailable):
            await log.submit(record(log, b"lost;")).wait()
        fs.clear()
        with open(segment, "r+b") as handle:  # the disk lost acknowledged bytes meanwhile
            handle.truncate(os.path.getsize(segment) - 2)
        with pytest.raises(StorageUnavailable) as refused:
            await log.submit(record(log, b"more;")).wait()
        with pytest.raises(StorageUnavailable) as again:
            log.submit(record(log, b"more;"))
        assert "restart the server" in str(refused.value) and "restart the server" in str(again.value)
        assert storage.stats()["read_only_streams"] == ["ro"]


@pytest.mark.parametrize("fsync", ["interval", "never"])
async def test_a_clean_stop_syncs_what_the_relaxed_modes_left(tmp_path: Path, fsync: str) -> None:
    """SIGTERM is not a power cut: after a clean stop nothing acknowledged depends on the page cache."""
    fs = FaultyFS()
    ledger = Ledger(fs)
    storage = DiskStorage(tmp_path, budget=budget(), fs=fs, fsync=fsync, fsync_interval=1000.0)
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        log = await storage.create(new_meta("calm"), [])
        for i in range(5):
            await log.submit(record(log, b"%d;" % i)).wait()
        assert any(ledger.unsynced.values())
        nursery.cancel_scope.cancel()
    await storage.stop()
    assert not any(ledger.unsynced.values())


async def test_a_failed_write_that_cannot_be_cut_off_says_it_may_survive(tmp_path: Path) -> None:
    """A failed sync whose undo fails too (the truncate or its sync): the bytes may still be on
    disk after a power cut, so the append is answered 503 `not_durable` ("may have happened"),
    not a plain failure a client would repeat. (Found by the simulation, seed 403 always/syncfs.)
    Once the disk heals, the next write cuts them off first."""
    fs = FaultyFS()
    async with storage_on(tmp_path, fs) as storage:
        log = await storage.create(new_meta("uncut"), [b"kept;"])
        fs.script("fdatasync", eio)
        fs.script("ftruncate", eio)
        with pytest.raises(StorageUnavailable) as failed:
            await log.submit(record(log, b"maybe;")).wait()
        assert failed.value.status == 503 and failed.value.code == "not_durable", failed.value
        assert "power loss may still keep it" in str(failed.value)
        fs.clear()
        assert await log.submit(record(log, b"after;")).wait() == len(b"kept;after;")
    data = (tmp_path / "streams" / "uncut" / "0000000000000000.seg").read_bytes()
    assert data.endswith(b"after;") and b"maybe;" not in data


async def test_a_failed_write_that_was_cut_off_is_a_plain_failure(tmp_path: Path) -> None:
    """The same failed sync with an undo that works: a plain 503, nothing of it left."""
    fs = FaultyFS()
    async with storage_on(tmp_path, fs) as storage:
        log = await storage.create(new_meta("cut"), [b"kept;"])
        fails = iter([True])

        def once(real: Any, fd: int) -> None:
            if next(fails, False):
                raise OSError(errno.EIO, "Input/output error")
            real(fd)

        fs.script("fdatasync", once)
        with pytest.raises(StorageUnavailable) as failed:
            await log.submit(record(log, b"gone;")).wait()
        assert failed.value.status == 503 and failed.value.code == "storage_unavailable", failed.value
    data = (tmp_path / "streams" / "cut" / "0000000000000000.seg").read_bytes()
    assert b"gone;" not in data


async def test_an_append_is_not_refused_for_a_close_that_then_fails(tmp_path: Path) -> None:
    """An append racing a close got 409 stream_closed as soon as the close was accepted; the
    close's write then failed (a full disk) and was taken back, and the next append was taken:
    the stream had been reported closed and then grew (torture seed 55, --fsync never)."""
    fs = FaultyFS()
    entered, release = threading.Event(), threading.Event()

    def stalled_enospc(*_: Any) -> Any:
        entered.set()
        release.wait(10)
        raise OSError(errno.ENOSPC, "No space left on device")

    async with storage_on(tmp_path, fs) as storage:
        service = Service(Supervisor(storage, storage.nursery), ServiceOptions())  # type: ignore[attr-defined]
        put = Request("PUT", "/v1/stream/c", "", Headers([("Content-Type", "text/plain")]), b"")
        assert (await service.handle(put)).status == 201
        close = Request("POST", "/v1/stream/c", "", Headers([("Stream-Closed", "true")]), b"")

        def post(body: bytes) -> Request:
            return Request("POST", "/v1/stream/c", "", Headers([("Content-Type", "text/plain")]), body)

        answers: dict[str, int] = {}

        async def send(key: str, request: Request) -> None:
            answers[key] = (await service.handle(request)).status

        fs.script("pwrite", stalled_enospc)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, "close", close)
            while not entered.is_set():  # the close is accepted, its write under way
                await trio.sleep(0.005)
            nursery.start_soon(send, "append", post(b"racing;"))
            await trio.sleep(0.2)  # the append is planned against the accepted close
            release.set()
        fs.clear()
        assert answers["close"] >= 500
        # Not "closed": the close was never made. A 503 (retry) is the honest answer.
        assert answers["append"] != 409, answers
        assert (await service.handle(post(b"after;"))).status == 204


async def test_a_seal_whose_fsync_failed_never_syncs_through_that_descriptor_again(tmp_path: Path) -> None:
    """Under fsync=interval an append is written and acknowledged before it is synced. If sealing
    the segment (--segment-max-age, a compaction's fresh segment) fails its fsync, the pages may
    be gone; a later fsync through the same descriptor would report them durable. The descriptor
    is let go, and the next sync writes them again through a new one."""
    fs = FaultyFS()
    noted = DescriptorEvents()
    events = noted.events

    async with storage_on(tmp_path, fs, fsync="interval", fsync_interval=3600) as storage:
        log = await storage.create(new_meta("seal"), [b"kept;"])
        log.on_publish = lambda: None  # an awake stream: nothing gives its descriptor back as idle
        assert await log.submit(record(log, b"unsynced;")).wait() == len(b"kept;unsynced;")
        fs.script("fdatasync", noted.synced)
        fs.script("open", noted.opened)
        with pytest.raises(OSError):
            await log.seal_idle()
        bad = next(fd for kind, fd in events if kind == "failed")
        assert log.kept_writer is not None and log.kept_writer.needs_repair
        assert log.kept_writer.open_fd() != bad
        await log.sync()
        fs.clear()
    later = events[events.index(("failed", bad)) + 1 :]
    syncs = [fd for kind, fd in later if kind == "sync"]
    assert syncs and all(("open", fd) in later[: later.index(("sync", fd))] for fd in syncs), events
    data = (tmp_path / "streams" / "seal" / "0000000000000000.seg").read_bytes()
    assert data.endswith(b"unsynced;")
