"""The disk storage on the simulated file system (ops/torture/simfs.py): the bugs the deterministic
simulation found, each pinned down by a test that steers the faults by hand."""

from __future__ import annotations

import errno
import os
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from ops.torture.simfs import FaultPlan, SimFileSystem
from streamkeep.actors.messages import AttachFork, DetachFork
from streamkeep.actors.supervisor import Supervisor
from streamkeep.protocol.model import Headers, Request, Response
from streamkeep.protocol.stream import ForkSpec
from streamkeep.segments import format as fmt
from streamkeep.segments import layout
from streamkeep.server.service import Service, ServiceOptions
from streamkeep.storage.base import ByteBudget
from streamkeep.storage.disk.storage import DiskStorage

ROOT = Path("/data")
T = [("Content-Type", "text/plain")]


class Steered(SimFileSystem):
    """The simulated file system, with faults aimed by hand: `after_rename_into(path, n)` fails the
    next `n` fsyncs once something is renamed to `path`; `fail_reads` fails every pread while set."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity=capacity, faults=FaultPlan(random.Random(7), rates={}, enabled=False))
        self.armed: tuple[str, int] | None = None
        self.fail_reads = False

    def after_rename_into(self, path: Path, times: int) -> None:
        self.armed = (str(path), times)

    def rename(self, source: Any, target: Any) -> None:
        super().rename(source, target)
        if self.armed is not None and os.fspath(target) == self.armed[0]:
            for _ in range(self.armed[1]):
                self.faults.force("eio", "fsync")
            self.armed = None

    def pread(self, fd: int, length: int, offset: int) -> bytes:
        if self.fail_reads:
            raise OSError(errno.EIO, "Input/output error")
        return super().pread(fd, length, offset)


def new_fs(capacity: int = 1 << 30) -> Steered:
    return Steered(capacity)


@asynccontextmanager
async def server(fs: SimFileSystem, **options: Any) -> AsyncIterator[tuple[Service, DiskStorage]]:
    storage = DiskStorage(
        ROOT, budget=ByteBudget(max_stream_bytes=1 << 24, max_total_bytes=1 << 26), fs=fs, **options
    )
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        service = Service(Supervisor(storage, nursery), ServiceOptions(), spawn=nursery.start_soon)
        try:
            yield service, storage
        finally:
            nursery.cancel_scope.cancel()


async def call(
    service: Service, method: str, name: str, body: bytes = b"", headers: list | None = None, query: str = ""
) -> Response:
    return await service.handle(Request(method, f"/v1/stream/{name}", query, Headers(headers or []), body))


async def test_a_delete_done_but_not_made_durable_says_so_and_stays_done() -> None:
    """A DELETE whose rename succeeded while every directory fsync failed was answered 503 as if
    nothing happened, and the stream vanished at the next start. Now the answer says it was done."""
    fs = new_fs()
    async with server(fs) as (service, _):
        assert (await call(service, "PUT", "s", b"x;", T)).status == 201
        trash = ROOT / layout.TRASH
        fs.rename = _arm_on_prefix(fs, str(trash) + "/")  # type: ignore[method-assign]
        answer = await call(service, "DELETE", "s")
        assert answer.status == 503 and b"was done" in answer.body
        assert (await call(service, "HEAD", "s")).status == 404
    fs.crash()
    async with server(fs) as (service, _):
        assert (await call(service, "HEAD", "s")).status == 404


async def test_a_create_done_but_not_made_durable_is_usable() -> None:
    fs = new_fs()
    async with server(fs) as (service, _):
        fs.after_rename_into(ROOT / layout.STREAMS / "s", 3)  # every try of the directory commit
        answer = await call(service, "PUT", "s", b"x;", T)
        assert answer.status == 503 and b"was done" in answer.body
        assert (await call(service, "PUT", "s", b"", T)).status == 200  # it exists, as created
        assert (await call(service, "POST", "s", b"y;", T)).status == 204
        assert (await call(service, "GET", "s", query="offset=-1")).body == b"x;y;"


@pytest.mark.parametrize("fsync", ["interval", "never"])
async def test_a_fork_point_survives_a_power_cut(fsync: str) -> None:
    """Under a relaxed fsync policy a fork could be created at a point its source did not yet have
    on disk; after a power cut the fork pointed past its source's end and its reads spun forever."""
    fs = new_fs()
    async with server(fs, fsync=fsync, fsync_interval=1000.0) as (service, _):
        assert (await call(service, "PUT", "src", b"a;", T)).status == 201
        assert (await call(service, "POST", "src", b"b;", T)).status == 204
        fork = await call(service, "PUT", "fork", b"", [("Stream-Forked-From", "/v1/stream/src")])
        assert fork.status == 201
    fs = fs.power_cut(random.Random(1))
    async with server(fs, fsync=fsync, fsync_interval=1000.0) as (service, _):
        with trio.fail_after(5):
            assert (await call(service, "GET", "fork", query="offset=-1")).body == b"a;b;"


async def test_an_inherited_range_that_ends_early_is_an_error_not_a_spin() -> None:
    """If a fork's source is shorter than its fork point (damage, or a power cut before the fix
    above), SSE and catch-up reads of the fork answer 503 instead of looping without end."""
    fs = new_fs()
    async with server(fs) as (service, _):
        await call(service, "PUT", "src", b"abcdef", T)
        await call(service, "PUT", "fork", b"", [("Stream-Forked-From", "/v1/stream/src")])
    source = ROOT / layout.STREAMS / "src" / layout.segment_filename(0)
    header_end = fmt.scan(_read(fs, source))[0][0].end
    fd = fs.open(source, os.O_RDWR)
    fs.ftruncate(fd, header_end)  # the source lost its only append
    fs.close(fd)
    async with server(fs) as (service, _):
        with trio.fail_after(5):
            assert (await call(service, "GET", "fork", query="offset=-1")).status == 503
            sse = await call(service, "GET", "fork", query="offset=-1&live=sse")
            assert sse.status == 503


async def test_a_gap_before_the_last_segment_removes_nothing() -> None:
    """Recovery took a whole segment that starts later than the segments before it end (some are
    missing) for a torn new segment, and deleted it: data lost to a misdiagnosis."""
    fs = new_fs()
    async with server(fs, segment_max_messages=1) as (service, _):
        await call(service, "PUT", "s", b"", T)
        for body in (b"one;", b"two;", b"three;"):
            assert (await call(service, "POST", "s", body, T)).status == 204
    directory = ROOT / layout.STREAMS / "s"
    segments = sorted(n for n in fs.listdir(directory) if n.endswith(layout.SEGMENT_SUFFIX))
    fs.unlink(directory / segments[1])  # a segment in the middle is gone
    async with server(fs) as (service, storage):
        assert storage.open("s") is None  # skipped, for inspection
    assert sorted(n for n in fs.listdir(directory) if n.endswith(layout.SEGMENT_SUFFIX)) == [
        segments[0],
        segments[2],
    ]


async def test_recovery_starts_when_it_cannot_finish_a_delete() -> None:
    """Recovery wrote while finishing a cascading delete, and a full disk stopped the server. Now
    the delete waits for the next start and the server serves."""
    fs = new_fs()
    async with server(fs) as (service, _):
        await call(service, "PUT", "src", b"a;", T)
        await call(service, "PUT", "fork", b"", [("Stream-Forked-From", "/v1/stream/src")])
        assert (await call(service, "DELETE", "src")).status == 204  # soft-deleted: the fork reads it
    # The fork's directory vanishes behind the server's back (a crash mid-cascade), and renames fail.
    for name in fs.listdir(ROOT / layout.STREAMS / "fork"):
        fs.unlink(ROOT / layout.STREAMS / "fork" / name)
    fs.rmdir(ROOT / layout.STREAMS / "fork")
    fs.faults.force("enospc", "rename")
    async with server(fs) as (service, _):
        assert (await call(service, "GET", "src")).status == 410  # still soft-deleted, not lost
        assert (await call(service, "PUT", "other", b"x", T)).status == 201
    async with server(fs) as (service, _):
        assert (await call(service, "GET", "src")).status == 404  # the next start finished it


@pytest.mark.parametrize("cut_seed", range(6))
async def test_after_a_crash_what_recovery_read_is_made_durable(cut_seed: int) -> None:
    """After an unclean stop the page cache can hold what was never synced (fsync=interval); the
    next start syncs it, so a power cut later cannot take back what readers were shown."""
    fs = new_fs()
    async with server(fs, fsync="interval", fsync_interval=1000.0) as (service, _):
        await call(service, "PUT", "s", b"", T)
        assert (await call(service, "POST", "s", b"kept;", T)).status == 204
    fs.crash()  # no clean stop: nothing synced the append
    async with server(fs, fsync="interval", fsync_interval=1000.0) as (service, _):
        assert (await call(service, "GET", "s", query="offset=-1")).body == b"kept;"
    fs = fs.power_cut(random.Random(cut_seed))
    async with server(fs, fsync="interval", fsync_interval=1000.0) as (service, _):
        assert (await call(service, "GET", "s", query="offset=-1")).body == b"kept;"


async def test_a_failed_write_is_cut_back_even_when_the_file_cannot_be_read() -> None:
    """The undo of a failed write re-read the last record before cutting: a read error left the
    failed bytes in the file, and the next start took them for data."""
    fs = new_fs()
    async with server(fs, sync_method="syncfs") as (service, _):
        await call(service, "PUT", "s", b"kept;", T)
        fs.faults.force("eio", "syncfs")
        fs.fail_reads = True
        assert (await call(service, "POST", "s", b"failed;", T)).status == 503
        fs.fail_reads = False
    fs.crash()
    async with server(fs, sync_method="syncfs") as (service, _):
        assert (await call(service, "GET", "s", query="offset=-1")).body == b"kept;"


def _arm_on_prefix(fs: Steered, prefix: str) -> Any:
    """A rename that, once something is renamed under `prefix`, fails every try of the commit."""
    real = fs.rename

    def rename(source: Any, target: Any) -> None:
        real(source, target)
        if os.fspath(target).startswith(prefix):
            for _ in range(6):  # streams/ and trash/, three tries each
                fs.faults.force("eio", "fsync")

    return rename


def _read(fs: SimFileSystem, path: Path) -> bytes:
    fd = fs.open(path, os.O_RDONLY)
    try:
        return fs.pread(fd, 1 << 20, 0)
    finally:
        fs.close(fd)


async def test_a_segment_of_only_a_close_is_never_sealed_by_age() -> None:
    """Found by the black box: age-sealing a segment whose only record is an empty close started a
    segment of the same name (FileExistsError), which ended the server at every start."""
    fs = new_fs()
    async with server(fs, segment_max_age=0.01) as (service, storage):
        assert (await call(service, "PUT", "done", b"", [*T, ("Stream-Closed", "true")])).status == 201
        await trio.sleep(0.05)
        log = storage.open("done")
        assert log is not None and not log.should_seal(1e15, 0.01)
        assert await log.seal_idle() is False
        assert (await call(service, "GET", "done", query="offset=-1")).header("Stream-Closed") == "true"


async def test_a_failed_writes_undo_stays_cut_when_its_sync_fails() -> None:
    """Found by the simulation (seeds 232, 252, 277 under syncfs): a failed syncfs wrote a failed
    append to disk, the undo's cut was followed by a failed fdatasync, and the simulated file
    system dropped the cut with the failed write's pages. At the next power cut the failed append
    came back, or (after a rotation) its segment overlapped the next and the stream was skipped.
    A cut is journaled metadata: it stays pending, and the next successful sync keeps it."""
    fs = new_fs()
    options: dict[str, Any] = {"sync_method": "syncfs", "segment_max_messages": 2}
    async with server(fs, **options) as (service, _):
        await call(service, "PUT", "s", b"kept;", T)
        real_syncfs = fs.syncfs

        def syncfs(fd: int) -> None:  # writeback wrote this stream's file; another one's failed
            fs.syncfs = real_syncfs  # type: ignore[method-assign]
            fs.sync()
            fs.faults.force("eio", "fdatasync")  # and the undo's own sync fails too
            raise OSError(errno.EIO, "Input/output error")

        fs.syncfs = syncfs  # type: ignore[method-assign]
        assert (await call(service, "POST", "s", b"failed;", T)).status == 503
        assert (await call(service, "POST", "s", b"next;", T)).status == 204
        assert (await call(service, "POST", "s", b"rotated;", T)).status == 204  # a new segment
    fs = fs.power_cut(random.Random(1))
    async with server(fs, **options) as (service, _):
        assert (await call(service, "GET", "s", query="offset=-1")).body == b"kept;next;rotated;"


async def test_a_new_segment_taken_back_without_a_directory_sync_is_not_a_definite_failure() -> None:
    """Found by the torture run with retention (sim seed 7): an append that rotated to a new
    segment failed at the directory's sync; the undo unlinked the segment, its own directory sync
    failed too and was ignored, and the append was answered 507. The power cut that followed kept
    the file but not the unlink, and the append answered as failed was in the stream. Until a
    directory sync covers the unlink, the failure is not definite (503 not_durable)."""
    import json

    for seed in range(12):
        fs = new_fs()
        options: dict[str, Any] = {"segment_max_messages": 2}
        async with server(fs, **options) as (service, _):
            await call(service, "PUT", "s", b"a;", T)
            await call(service, "POST", "s", b"b;", T)
            real_fsync = fs.fsync
            failing = [2]

            def fsync(
                fd: int, fs: Steered = fs, failing: list[int] = failing, real: Any = real_fsync
            ) -> None:
                if failing[0] and fs.open_fds().get(fd, "").endswith("streams/s"):
                    failing[0] -= 1
                    raise OSError(errno.EIO, "Input/output error")
                real(fd)

            fs.fsync = fsync  # type: ignore[method-assign]
            answer = await call(service, "POST", "s", b"c;", T)  # the third record: a new segment
            fs.fsync = real_fsync  # type: ignore[method-assign]
            assert failing[0] == 0, "the fault did not hit the directory syncs"
            code = json.loads(answer.body)["error"]["code"]
        fs = fs.power_cut(random.Random(seed))
        async with server(fs, **options) as (service, _):
            body = (await call(service, "GET", "s", query="offset=-1")).body
        assert body in (b"a;b;", b"a;b;c;")
        if b"c;" in body:
            assert answer.status == 503 and code == "not_durable", (seed, answer.status, code)


async def test_a_read_that_races_a_delete_is_a_404() -> None:
    """Found by the simulation (seed 277): a read found a segment file gone because a delete had
    just moved the stream into trash/, but the delete had not yet marked the stream deleted, so the
    read answered 503 "segment file ... is missing". It waits for the delete's outcome now."""
    reading, files_gone, read_failed = trio.Event(), trio.Event(), trio.Event()

    async def steered(fn: Any, *args: Any, limiter: Any = None) -> Any:
        name = getattr(fn, "__name__", "")
        if name == "pread_exact" and not reading.is_set():
            reading.set()  # the read is on its way to the file, and the delete starts
            await files_gone.wait()
            try:
                return await trio.to_thread.run_sync(fn, *args, limiter=limiter)
            except FileNotFoundError:
                read_failed.set()
                raise
        result = await trio.to_thread.run_sync(fn, *args, limiter=limiter)
        if name == "_delete_files":  # moved to trash/; not yet marked deleted
            files_gone.set()
            await read_failed.wait()
            await trio.testing.wait_all_tasks_blocked()  # the read answers, or waits for this
        return result

    async with server(new_fs(), cache_bytes=0, run_sync=steered) as (service, _):
        await call(service, "PUT", "s", b"x;", T)
        answers = []

        async def read() -> None:
            answers.append(await call(service, "GET", "s", query="offset=-1"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await reading.wait()
            assert (await call(service, "DELETE", "s")).status == 204
        assert answers[0].status == 404, answers[0].body


def sealing_every_append(fs: SimFileSystem) -> DiskStorage:
    """Disk storage that seals a segment after each append, so the archiver has work at once."""
    return DiskStorage(
        ROOT,
        budget=ByteBudget(max_stream_bytes=1 << 24, max_total_bytes=1 << 26),
        fs=fs,
        segment_max_messages=1,
        cache_bytes=0,
    )


async def test_a_cold_read_of_a_stream_deleted_meanwhile_is_a_delete_not_a_bucket_failure() -> None:
    """A read on its way to the bucket when its stream was deleted found the objects deleted
    (rightly: the delete was durable) and answered 503 cold_tier_unavailable, a bucket failure no
    fault explained (sim seed 126). It is the delete: StreamDeleted, as for a local segment."""
    from ops.torture.sim import SimStore
    from ops.torture.sims3 import SimS3
    from streamkeep.protocol.stream import StreamMeta
    from streamkeep.storage.base import AppendRecord
    from streamkeep.storage.cold.archiver import Archiver
    from streamkeep.storage.cold.store import ColdConfig
    from streamkeep.storage.errors import StreamDeleted

    gate, waiting = trio.Event(), trio.Event()

    class Gated(Archiver):
        async def read(self, key: str, start: int, length: int) -> bytes:
            waiting.set()
            await gate.wait()  # the stream is deleted, and its objects with it, meanwhile
            return await super().read(key, start, length)

    fs = new_fs()
    config = ColdConfig("archive", "sim", None, None, create_bucket=True)
    s3 = SimS3(random.Random(0))
    storage = sealing_every_append(fs)
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        archiver = Gated(storage, SimStore(s3, config), config)
        storage.cold = archiver
        await trio.to_thread.run_sync(SimStore(s3, config).ensure_bucket)
        meta = StreamMeta(name="s", stream_id="a1b2c3d4e5f6", content_type="text/plain", created_at=0.0)
        log = await storage.create(meta, [b"0;"])
        for i in range(1, 3):
            await log.submit(AppendRecord([b"%d;" % i], log.meta, None, False, None)).wait()
        await archiver.pass_once()
        assert log.cold_entries and not log.segments[0].local  # the first segment is only in the bucket
        outcome: list[object] = []

        async def read() -> None:
            try:
                outcome.append(await log.read(0, 1 << 20, whole_messages=False))
            except Exception as error:
                outcome.append(error)

        nursery.start_soon(read)
        with trio.fail_after(5):
            await waiting.wait()
        await storage.delete("s")
        await archiver.pass_once()  # deletes the objects of the deleted stream
        assert not [key for key in s3.objects if "/s/" in key]
        gate.set()
        with trio.fail_after(5):
            while not outcome:
                await trio.sleep(0.01)
        assert isinstance(outcome[0], StreamDeleted), outcome
        nursery.cancel_scope.cancel()


async def test_an_upload_gives_back_a_deleted_streams_descriptor_at_its_next_retry() -> None:
    """An upload whose stream is deleted meanwhile must not keep the deleted file's blocks pinned
    through boto3's retries and timeouts (minutes against a frozen bucket; the black box's fd-leak
    finding, seeds 12 and 85 interval/ext4). The archiver reads the segment whole and closes its
    descriptor before uploading, and the body refuses reads once its stream is deleted, so the
    next retry ends the upload."""
    import threading

    from ops.torture.sim import SimStore
    from ops.torture.sims3 import SimS3
    from streamkeep.protocol.stream import StreamMeta
    from streamkeep.storage.base import AppendRecord
    from streamkeep.storage.cold.archiver import Archiver
    from streamkeep.storage.cold.store import ColdConfig

    failed_once, frozen = threading.Event(), threading.Event()

    class Flaky(SimStore):
        def upload(self, reader: Any, key: str, size: int, sha256: str) -> None:
            reader.seek(0)
            reader.read(size)
            failed_once.set()  # "connection closed before a response": boto3 retries after a pause
            time.sleep(0.3)
            reader.seek(0)
            reader.read(size)  # the retry reads the body again
            frozen.wait(30)  # and the bucket does not answer
            super().upload(reader, key, size, sha256)

    fs = new_fs()
    config = ColdConfig("archive", "sim", None, None, create_bucket=True)
    s3 = SimS3(random.Random(0))
    storage = sealing_every_append(fs)
    try:
        async with trio.open_nursery() as nursery:
            await storage.start(nursery)
            archiver = Archiver(storage, Flaky(s3, config), config)
            storage.cold = archiver
            await trio.to_thread.run_sync(SimStore(s3, config).ensure_bucket)
            meta = StreamMeta(name="s", stream_id="a1b2c3d4e5f6", content_type="text/plain", created_at=0.0)
            log = await storage.create(meta, [b"0;"])
            await log.submit(AppendRecord([b"1;"], log.meta, None, False, None)).wait()
            nursery.start_soon(archiver.pass_once)
            with trio.fail_after(5):
                while not failed_once.is_set():
                    await trio.sleep(0.01)
            await storage.delete("s")
            with trio.fail_after(5):  # well before the frozen bucket would let the upload go
                while any("/streams/s/" in path for path in fs.open_fds().values()):
                    await trio.sleep(0.05)
            assert not frozen.is_set()
            assert "cold tier upload" not in str(archiver.health.stats()), archiver.health.stats()
            nursery.cancel_scope.cancel()
    finally:
        frozen.set()


async def test_a_fork_counted_while_a_failed_append_is_undone_keeps_its_source() -> None:
    """Found by the simulation (seed 7582, interval/fdatasync): the source counted a new fork on
    the meta it had read before syncing the fork point; an append to the source failed meanwhile,
    and its undo put a copy of the last durable meta in place, so the count went to a meta no one
    read any more. The source's DELETE then removed it outright (a 404, and the fork's inherited
    range gone) instead of keeping it soft-deleted (410) for the fork."""
    writing, release = trio.Event(), trio.Event()
    armed = [False]

    async def steered(fn: Any, *args: Any, limiter: Any = None) -> Any:
        if getattr(fn, "__name__", "") == "_write_group" and armed[0]:
            armed[0] = False
            writing.set()
            await release.wait()
            for batch in args[0]:  # the disk is full: nothing written, the appends fail
                batch.error = OSError(errno.ENOSPC, "No space left on device")
            return None
        return await trio.to_thread.run_sync(fn, *args, limiter=limiter)

    options: dict[str, Any] = {"fsync": "interval", "fsync_interval": 1000.0, "run_sync": steered}
    async with server(new_fs(), **options) as (service, storage):
        assert (await call(service, "PUT", "src", b"a;", T)).status == 201
        assert (await call(service, "POST", "src", b"b;", T)).status == 204  # written, not yet synced
        source = storage.open("src")
        assert source is not None and source.dirty
        answers: dict[str, Response] = {}

        async def send(key: str, method: str, name: str, body: bytes, headers: list) -> None:
            answers[key] = await call(service, method, name, body, headers)

        armed[0] = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, "append", "POST", "src", b"c;", T)
            await writing.wait()  # the append is being written, under the stream's I/O lock
            nursery.start_soon(send, "fork", "PUT", "fork", b"", [("Stream-Forked-From", "/v1/stream/src")])
            with trio.fail_after(5):  # the fork's source waits for that lock to sync the fork point
                while source.io_lock.statistics().tasks_waiting == 0:
                    await trio.sleep(0.01)
            release.set()
        assert answers["append"].status == 507, answers["append"].body
        assert answers["fork"].status == 201, answers["fork"].body
        assert source.meta.fork_count == 1
        assert (await call(service, "DELETE", "src")).status == 204
        assert (await call(service, "GET", "src", query="offset=-1")).status == 410  # soft-deleted
        assert (await call(service, "GET", "fork", query="offset=-1")).body == b"a;b;"
        assert (await call(service, "DELETE", "fork")).status == 204
        assert (await call(service, "GET", "src", query="offset=-1")).status == 404  # the last fork took it


async def test_a_failed_append_keeps_the_pins_of_remote_forks() -> None:
    """The undo of a failed append put the last durable meta back but for the fork count and the
    soft deletion: a pin of a fork on another member, saved to meta.cbor since, went from memory
    (its detach then found no pin and left the count up), and the next save of the meta would
    have dropped it from disk too."""
    failing = [False]

    async def steered(fn: Any, *args: Any, limiter: Any = None) -> Any:
        if getattr(fn, "__name__", "") == "_write_group" and failing[0]:
            for batch in args[0]:  # the disk is full: nothing written, the appends fail
                batch.error = OSError(errno.ENOSPC, "No space left on device")
            return None
        return await trio.to_thread.run_sync(fn, *args, limiter=limiter)

    async with server(new_fs(), run_sync=steered) as (service, storage):
        assert (await call(service, "PUT", "src", b"a;", T)).status == 201
        assert (await call(service, "POST", "src", b"b;", T)).status == 204
        failing[0] = True  # the disk fills up: the meta in place is a copy of the durable one now
        assert (await call(service, "POST", "src", b"c;", T)).status == 507
        # A fork that another member will own: its pin is saved in the source's meta.
        spec = ForkSpec("src", None, None, 0)
        await service.supervisor.call("src", AttachFork(spec, None, ("f1", "fork")))
        source = storage.open("src")
        assert source is not None
        assert [pin[:2] for pin in source.meta.remote_forks] == [("f1", "fork")]
        assert (await call(service, "POST", "src", b"c;", T)).status == 507
        failing[0] = False
        assert [pin[:2] for pin in source.meta.remote_forks] == [("f1", "fork")]
        assert source.meta.fork_count == 1
        assert (await call(service, "DELETE", "src")).status == 204  # soft-deleted: the fork reads it
        await service.supervisor.call("src", DetachFork("f1"))
        assert storage.open("src") is None  # its last fork gone, the source goes too
