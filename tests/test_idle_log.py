"""What an idle stream's log on disk keeps (issue 26: <= 2 KiB per idle stream at 100,000 streams).

A stream going idle gives back its descriptor and drops what it can make again (its I/O lock, tail
cache and writer); background work on an idle stream (sealing it for the cold tier, retention, the
tier's description) gives them back again when it ends; and what it made again is the same as what
it dropped, so appends, reads and a restart see nothing of it. In process, on a real directory.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from streamkeep.protocol.stream import StreamMeta
from streamkeep.storage.base import AppendRecord, ByteBudget
from streamkeep.storage.disk.index import Segment
from streamkeep.storage.disk.log import DiskLog
from streamkeep.storage.disk.log_state import NO_PRODUCERS
from streamkeep.storage.disk.storage import DiskStorage
from streamkeep.storage.disk.writer import ReadOnly, SegmentWriter
from streamkeep.storage.errors import StorageUnavailable
from tests.faultyfs import FaultyFS

BUDGET = ByteBudget(max_stream_bytes=1 << 20, max_total_bytes=1 << 22)


def new_meta(name: str) -> StreamMeta:
    return StreamMeta(name=name, stream_id="0123456789ab", content_type="text/plain", created_at=0.0)


def plain(stream_log: DiskLog, body: bytes) -> AppendRecord:
    return AppendRecord([body], stream_log.meta, None, False, None)


def segment_fds(data_dir: Path) -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += target.startswith(str(data_dir)) and target.endswith(".seg")
    return count


def holds_nothing_it_can_remake(stream_log: DiskLog) -> bool:
    return stream_log.kept_writer is None and stream_log._io_lock is None and stream_log._cache is None


async def read_back(stream_log: DiskLog) -> bytes:
    return b"".join((await stream_log.read(0, 1 << 20, whole_messages=False)).messages)


async def read_after_a_restart(data_dir: Path, fsync: str, name: str) -> bytes:
    """What a new storage over the same directory reads back of the stream."""
    again = DiskStorage(data_dir, budget=BUDGET, fsync=fsync)
    async with trio.open_nursery() as nursery:
        await again.start(nursery)
        reopened = again.open(name)
        assert reopened is not None
        data = await read_back(reopened)
        nursery.cancel_scope.cancel()
    return data


@pytest.mark.parametrize("fsync", ["always", "interval"])
async def test_an_idle_log_drops_what_it_can_remake_and_makes_it_again_the_same(
    tmp_path: Path, fsync: str
) -> None:
    storage = DiskStorage(tmp_path, budget=BUDGET, fsync=fsync, fsync_interval=0.05)
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        stream_log = await storage.create(new_meta("s"), [b"one;"])
        assert await stream_log.submit(plain(stream_log, b"two;")).wait() == 8
        assert stream_log.kept_writer is not None and stream_log.kept_writer.open_fd() is not None
        if fsync == "interval":
            await stream_log.sync()
        storage.idle("s")
        assert holds_nothing_it_can_remake(stream_log)
        assert segment_fds(tmp_path) == 0
        # Made again at the next append: the same offsets, the same bytes.
        assert await stream_log.submit(plain(stream_log, b"three;")).wait() == 14
        assert await read_back(stream_log) == b"one;two;three;"
        if fsync == "interval":
            await stream_log.sync()
        storage.idle("s")
        assert holds_nothing_it_can_remake(stream_log)
        nursery.cancel_scope.cancel()
    assert await read_after_a_restart(tmp_path, fsync, "s") == b"one;two;three;"


async def test_sealing_an_idle_stream_leaves_no_descriptor_or_lock(tmp_path: Path) -> None:
    """The cold tier seals idle streams (--segment-max-age): the new segment's descriptor was kept,
    one per sealed idle stream, until the stream was next written and hibernated."""
    storage = DiskStorage(tmp_path, budget=BUDGET)
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        logs = [await storage.create(new_meta(f"s{i}"), [b"x" * 10]) for i in range(5)]
        for stream_log in logs:
            storage.idle(stream_log.meta.name)
            assert await stream_log.seal_idle()
            assert len(stream_log.segments) == 2
            assert holds_nothing_it_can_remake(stream_log)
        assert segment_fds(tmp_path) == 0
        # An awake stream (its actor listening) keeps what it uses.
        awake = logs[0]
        awake.on_publish = lambda: None
        assert await awake.submit(plain(awake, b"y;")).wait() == 12
        async with awake.exclusive():
            pass
        assert awake.kept_writer is not None and awake._io_lock is not None
        assert await read_back(awake) == b"x" * 10 + b"y;"
        nursery.cancel_scope.cancel()


def test_the_shared_empty_producer_table_refuses_every_write() -> None:
    """Streams no producer wrote to share one table: a write to it would reach all of them."""
    for write in (
        lambda: NO_PRODUCERS.__setitem__("p", None),  # type: ignore[arg-type]
        lambda: NO_PRODUCERS.setdefault("p", None),  # type: ignore[arg-type]
        lambda: NO_PRODUCERS.update(p=None),
        lambda: NO_PRODUCERS.pop("p", None),
        NO_PRODUCERS.clear,
    ):
        with pytest.raises(TypeError, match="read-only"):
            write()
    assert NO_PRODUCERS == {}


def test_streams_of_one_content_type_share_one_copy_of_it_and_the_table_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """~60 B per idle stream (issue 26): a create's content type, parsed from its own request, and
    one decoded from each stream's meta at start, are the one shared copy; a client inventing
    content types stops being shared once the table is full, and nothing else changes."""
    from streamkeep.protocol import stream as stream_module
    from streamkeep.protocol.model import Headers
    from streamkeep.protocol.stream import CreateSpec, shared_content_type
    from streamkeep.storage.disk.meta import decode_meta, encode_meta

    monkeypatch.setattr(stream_module, "_SHARED_CONTENT_TYPES", {})  # this test fills it

    def created(content_type: str) -> str:
        spec = CreateSpec.from_request(Headers([("Content-Type", content_type)]), b"")
        return spec.new_meta("s", "a1b2c3d4e5f6", 0.0).content_type

    first, second = created("text/plain; charset=utf-8"), created("text/plain; charset=utf-8")
    assert first == second and first is second
    recovered = decode_meta(
        encode_meta(
            stream_module.StreamMeta("s", "a1b2c3d4e5f6", "".join(["text/", "plain; charset=utf-8"]), 0.0)
        )
    )
    assert recovered.content_type is first
    for number in range(stream_module.MAX_SHARED_CONTENT_TYPES + 10):
        shared_content_type(f"application/x-{number}")
    assert len(stream_module._SHARED_CONTENT_TYPES) == stream_module.MAX_SHARED_CONTENT_TYPES
    late = "".join(["application/x-", "late"])
    assert shared_content_type(late) is late and created(late) == late


@pytest.mark.parametrize("fsync", ["always", "interval", "never"])
async def test_write_descriptors_stay_within_the_budget_while_streams_are_awake(
    tmp_path: Path, fsync: str
) -> None:
    """Streams written faster than they hibernate kept a descriptor each until their actor slept:
    at 100,000 streams that reached the process's limit and appends failed 503 (EMFILE). Past the
    budget the least recently written give theirs back, and the next write to one opens it again.
    A stream holding writes not yet synced (fsync=interval between its syncs, fsync=never always)
    is synced first, at the budget's ask: under fsync=never nothing gave a descriptor back, and
    12,000 streams written under a 4,096-descriptor limit answered most appends 5xx."""
    limit = 4
    # The interval sync is kept out of the way: the budget's ask alone must sync what it gives back.
    storage = DiskStorage(tmp_path, budget=BUDGET, fsync=fsync, fsync_interval=600, write_descriptors=limit)
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        logs = [await storage.create(new_meta(f"s{i}"), []) for i in range(12)]
        for stream_log in logs:
            stream_log.on_publish = lambda: None  # as an awake actor listens: not given back as idle
        for number, stream_log in enumerate(logs):
            assert await stream_log.submit(plain(stream_log, b"a%02d;" % number)).wait() == 4
            if fsync == "always":
                assert segment_fds(tmp_path) <= limit
        with trio.fail_after(10):  # the asked syncs run in worker threads
            while segment_fds(tmp_path) > limit:
                await trio.sleep(0.01)
        given_back = [stream_log for stream_log in logs if not stream_log.descriptor_open()]
        assert len(given_back) >= 12 - limit
        assert not any(stream_log.dirty for stream_log in given_back), "given back before its sync"
        stats = storage.stats()
        assert stats["write_descriptors"] <= limit and stats["write_descriptors_given_back"] >= 12 - limit
        for number, stream_log in enumerate(logs):  # given back, opened again
            assert await stream_log.submit(plain(stream_log, b"c%02d;" % number)).wait() > 4
        for number, stream_log in enumerate(logs):
            assert await read_back(stream_log) == b"a%02d;c%02d;" % (number, number)
        nursery.cancel_scope.cancel()
    assert await read_after_a_restart(tmp_path, fsync, "s11") == b"a11;c11;"


async def test_a_deleted_stream_leaves_the_descriptor_budget(tmp_path: Path) -> None:
    """A delete closes the stream's descriptor; the budget must let go of its log too, or every
    stream written then deleted would stay there with its index and tail cache."""
    storage = DiskStorage(tmp_path, budget=BUDGET, write_descriptors=1000)
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        for number in range(20):
            stream_log = await storage.create(new_meta(f"gone{number}"), [])
            stream_log.on_publish = lambda: None
            assert await stream_log.submit(plain(stream_log, b"x" * 4000)).wait() == 4000
            await storage.delete(f"gone{number}")
            assert stream_log._cache is None
        assert storage.descriptors.held == 0 and segment_fds(tmp_path) == 0
        nursery.cancel_scope.cancel()


async def test_an_append_queued_behind_a_failed_give_back_sync_is_committed(tmp_path: Path) -> None:
    """The committer passes over a stream whose I/O lock is held. A give-back sync that failed
    (EIO) left the lock without waking it, so under fsync=never (no interval sync to come) an append
    queued meanwhile waited for the stream's next append, and a delete's drain hung (review)."""
    fs = FaultyFS()
    failed: list[int] = []

    def eio_once_on_s0(real: Callable[[int], None], fd: int) -> None:
        if "/s0/" in os.readlink(f"/proc/self/fd/{fd}") and not failed:
            failed.append(fd)
            time.sleep(0.3)  # the append below queues meanwhile
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    fs.script("fdatasync", eio_once_on_s0)
    storage = DiskStorage(tmp_path, budget=BUDGET, fsync="never", write_descriptors=2, fs=fs)
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        logs = [await storage.create(new_meta(f"s{i}"), []) for i in range(3)]
        for stream_log in logs:
            stream_log.on_publish = lambda: None
        for number, stream_log in enumerate(logs):  # s2's write: the trim lists s0 and s1 for a sync
            assert await stream_log.submit(plain(stream_log, b"x%d;" % number)).wait() == 3
        first = logs[0]
        with trio.fail_after(5):
            while not first.io_lock.locked():  # s0's give-back sync holds it, fdatasync in a thread
                await trio.sleep(0.001)
        queued = first.submit(plain(first, b"queued;"))
        with trio.fail_after(5):
            assert await queued.wait() == 10
        assert failed, "the give-back sync never ran"
        with trio.fail_after(5):
            await storage.delete("s0")
        nursery.cancel_scope.cancel()


async def test_one_give_back_sync_that_fails_otherwise_leaves_the_others_synced(tmp_path: Path) -> None:
    """A give-back sync that raises something other than OSError (ReadOnly: a stream whose records
    no longer verify) cancelled the other streams' syncs, and a sync cancelled before it ran had
    already marked its stream clean: its descriptor could be given back unsynced and a clean stop
    skip it (review). Each stream's failure is its own now, and what was not synced stays owed."""
    fs = FaultyFS()
    synced: list[str] = []

    def count(real: Callable[[int], None], fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}").split("/")[-2])
        real(fd)

    fs.script("fdatasync", count)
    real_sync = SegmentWriter.sync

    def read_only_for_s0(writer: SegmentWriter, active: Segment) -> None:
        time.sleep(0.02)  # a real disk's fdatasync: the others wait for the one I/O thread
        if os.fspath(writer.directory).endswith("/s0"):
            raise ReadOnly("records no longer verify")
        real_sync(writer, active)

    storage = DiskStorage(tmp_path, budget=BUDGET, fsync="never", io_threads=1, write_descriptors=16, fs=fs)
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        logs = [await storage.create(new_meta(f"s{i}"), []) for i in range(18)]
        for stream_log in logs:
            stream_log.on_publish = lambda: None
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(SegmentWriter, "sync", read_only_for_s0)
            for number, stream_log in enumerate(logs):  # the trims list the oldest for a sync
                assert await stream_log.submit(plain(stream_log, b"x%02d;" % number)).wait() == 4
            with trio.fail_after(5):  # the trim at s16's write listed s0, s1 and s2
                while not {"s1", "s2"} <= set(synced):
                    await trio.sleep(0.01)
            await trio.sleep(0.2)
        assert logs[0].dirty, "a sync that failed must leave its stream owing one"
        for stream_log in logs:
            assert stream_log.dirty or stream_log.meta.name in synced, (
                f"{stream_log.meta.name} clean, never synced"
            )
        assert "descriptor give-back sync" in storage.health.failures
        nursery.cancel_scope.cancel()


async def test_making_a_read_only_stream_durable_is_a_503_not_a_bare_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork makes its source durable first (fsync=interval or never); a source whose records no
    longer verify raised a bare ReadOnly there, which the service answers 500 (review)."""
    storage = DiskStorage(tmp_path, budget=BUDGET, fsync="interval", fsync_interval=600)
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        stream_log = await storage.create(new_meta("source"), [])
        assert await stream_log.submit(plain(stream_log, b"one;")).wait() == 4
        assert stream_log.dirty

        def read_only(writer: SegmentWriter, active: Segment) -> None:
            raise ReadOnly("records no longer verify")

        monkeypatch.setattr(SegmentWriter, "sync", read_only)
        with pytest.raises(StorageUnavailable) as refused:
            await stream_log.make_durable()
        assert refused.value.status == 503 and refused.value.code == "read_only"
        assert stream_log.dirty, "nothing was synced: still owed"
        nursery.cancel_scope.cancel()
