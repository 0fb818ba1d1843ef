"""The simulation's parts (ops/torture): the file system against the real one, its durability and
fault models, replay from a seed, deterministic threads, and the simulated S3."""

from __future__ import annotations

import errno
import os
import random
import secrets
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from ops.torture import simthreads
from ops.torture.simfs import FaultPlan, SimFileSystem
from ops.torture.sims3 import SimS3, SimS3Error
from ops.torture.simthreads import SimThreads, deterministic, mock_clock
from streamkeep.storage import files
from streamkeep.storage.files import OS

W = os.O_WRONLY | os.O_CREAT
RW = os.O_RDWR | os.O_CREAT


# ---- the simulated file system behaves like Linux's -------------------------------------------

PATHS = ["a", "b", "d", "e", "d/a", "d/b", "d/e", "d/e/a", "d/e/x", "e/a", "a/x", "d/", "a/", ".", "d/.."]
OPEN_FLAGS = [
    os.O_RDONLY,
    W,
    RW,
    RW | os.O_TRUNC,
    W | os.O_EXCL,
    os.O_RDWR,
    os.O_RDONLY | os.O_DIRECTORY,
]


FD_OPS = ("close", "pwrite", "write", "pread", "ftruncate", "fsync", "fdatasync", "fsize")
PATH_OPS = (
    "open",
    "open",
    "open",
    "open",
    "rename",
    "rename",
    "unlink",
    "mkdir",
    "mkdir",
    "rmdir",
    "listdir",
)
PATH_OPS += ("exists", "is_dir")


def outcome(call: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    try:
        return "ok", call(*args)
    except OSError as error:
        return "error", errno.errorcode[error.errno]


def fd_arguments(op: str, rng: random.Random) -> tuple[Any, ...]:
    if op in ("pwrite", "write"):
        data = rng.randbytes(rng.randint(0, 12))
        return (data, rng.choice([0, 0, 3, 9, 30])) if op == "pwrite" else (data,)
    if op == "pread":
        return rng.randint(0, 20), rng.randint(0, 25)
    if op == "ftruncate":
        return (rng.randint(0, 25),)
    return ()


def real_tree(root: Path) -> dict[str, bytes | None]:
    tree: dict[str, bytes | None] = {}
    for directory, dirnames, filenames in os.walk(root):
        relative = "/" + os.path.relpath(directory, root) if directory != str(root) else ""
        for name in dirnames:
            tree[f"{relative}/{name}"] = None
        for name in filenames:
            tree[f"{relative}/{name}"] = Path(directory, name).read_bytes()
    return dict(sorted(tree.items()))


def differential_run(seed: int, real_root: Path, steps: int = 150) -> list[str]:
    """Random calls on both file systems, demanding the same results and errnos; returns the log."""
    rng = random.Random(seed)
    sim = SimFileSystem()
    sim.mkdir("/sim")
    fds: list[tuple[int, int, bool]] = []  # (simulated fd, real fd, is a directory)
    log: list[str] = []
    try:
        for step in range(steps):
            op = rng.choice(FD_OPS + PATH_OPS)
            if op in FD_OPS and not fds:
                op = "open"
            if op in FD_OPS:
                index = rng.randrange(len(fds))
                sim_fd, real_fd, is_dir = fds[index]
                if op == "fsize" and is_dir:
                    continue  # a directory's st_size is the file system's business
                unlinked = sim._fds[sim_fd].node.links == 0
                args = fd_arguments(op, rng)
                simulated = outcome(getattr(sim, op), sim_fd, *args)
                real = outcome(getattr(OS, op), real_fd, *args)
                if op == "close":
                    del fds[index]
                shown = f"{[_brief(arg) for arg in args]}{' (unlinked)' if unlinked else ''}"
            else:
                names = [rng.choice(PATHS) for _ in range(2 if op == "rename" else 1)]
                args = (rng.choice(OPEN_FLAGS),) if op == "open" else ()
                is_dir = sim.is_dir(f"/sim/{names[0]}")
                simulated = outcome(getattr(sim, op), *(f"/sim/{name}" for name in names), *args)
                real = outcome(getattr(OS, op), *(f"{real_root}/{name}" for name in names), *args)
                if op == "open" and simulated[0] == real[0] == "ok":
                    fds.append((simulated[1], real[1], is_dir))
                    simulated = real = ("ok", "fd")  # the numbers differ: the real process has more open
                if op == "listdir":
                    simulated, real = (
                        (kind, sorted(v) if kind == "ok" else v) for kind, v in (simulated, real)
                    )
                shown = f"{names} {args}"
            log.append(f"{step} {op} {shown}: sim {simulated} real {real}")
            assert simulated == real, f"seed {seed}, step {step}\n" + "\n".join(log[-30:])
        assert sim.snapshot() == {"/sim": None, **{f"/sim{k}": v for k, v in real_tree(real_root).items()}}, (
            f"seed {seed}\n" + "\n".join(log[-30:])
        )
    finally:
        for sim_fd, real_fd, _ in fds:
            sim.close(sim_fd)
            OS.close(real_fd)
    assert sim.open_fds() == {}
    return log


def _brief(arg: Any) -> Any:
    return f"<{len(arg)}B>" if isinstance(arg, bytes) else arg


def test_same_results_and_errors_as_the_real_file_system(tmp_path: Path) -> None:
    log = []
    for seed in range(80):
        root = tmp_path / str(seed)
        root.mkdir()
        log += differential_run(seed, root)
    on_unlinked = [line for line in log if "(unlinked): sim ('ok'" in line]
    assert {line.split()[1] for line in on_unlinked} >= {"pwrite", "pread", "fsync", "close"}


def test_fds_are_the_lowest_free_and_closed_ones_are_bad() -> None:
    fs = SimFileSystem()
    fds = [fs.open(f"/{name}", W) for name in "abc"]
    assert fds == [3, 4, 5]
    fs.close(4)
    assert fs.open("/d", W) == 4
    with pytest.raises(OSError) as raised:
        fs.pwrite(5 + 1, b"x", 0)
    assert raised.value.errno == errno.EBADF
    fs.close(5)
    with pytest.raises(OSError) as raised:
        fs.close(5)
    assert raised.value.errno == errno.EBADF


def test_an_unlinked_open_file_stays_usable_and_keeps_its_space_until_closed() -> None:
    fs = SimFileSystem(capacity=100)
    fd = fs.open("/a", RW)
    files.pwrite_all(fs, fd, b"x" * 60, 0)
    fs.unlink("/a")
    assert not fs.exists("/a")
    assert fs.free_bytes("/") == 40  # deleted, still held open: the leak the server once had
    files.pwrite_all(fs, fd, b"y" * 10, 60)
    assert fs.pread(fd, 100, 0) == b"x" * 60 + b"y" * 10
    assert fs.free_bytes("/") == 30
    fs.close(fd)
    assert fs.free_bytes("/") == 100


def test_rmtree_under_an_open_file_frees_its_space_only_at_close() -> None:
    fs = SimFileSystem(capacity=1000)
    files.makedirs(fs, "/data/streams/s/segments")
    files.write_new(fs, "/data/streams/s/meta", b"m" * 100)
    fd = fs.open("/data/streams/s/segments/1", W)
    files.pwrite_all(fs, fd, b"x" * 500, 0)
    files.rmtree(fs, "/data/streams/s")
    assert fs.listdir("/data/streams") == [] and fs.free_bytes("/data") == 500
    assert fs.open_fds() == {fd: "/data/streams/s/segments/1"}  # the leak, visible
    fs.close(fd)
    assert fs.free_bytes("/data") == 1000


def test_a_full_disk_gives_a_short_write_then_enospc() -> None:
    fs = SimFileSystem(capacity=100)
    fd = fs.open("/a", W)
    assert fs.pwrite(fd, b"x" * 60, 0) == 60
    assert fs.pwrite(fd, b"y" * 60, 60) == 40
    with pytest.raises(OSError) as raised:
        files.pwrite_all(fs, fd, b"z", 100)
    assert raised.value.errno == errno.ENOSPC
    assert fs.pwrite(fd, b"w" * 10, 0) == 10  # overwriting needs no space
    with pytest.raises(OSError) as raised:
        fs.open("/b", W)
    assert raised.value.errno == errno.ENOSPC


# ---- durability: what a power cut keeps --------------------------------------------------------


def fresh() -> SimFileSystem:
    fs = SimFileSystem()
    files.makedirs(fs, "/data")
    fs.sync()
    return fs


def read_or_none(fs: SimFileSystem, path: str) -> bytes | None:
    return files.read_file(fs, path) if fs.exists(path) else None


def test_a_power_cut_keeps_a_prefix_of_unsynced_writes_possibly_torn() -> None:
    whole = b"".join(bytes([65 + i]) * 10 for i in range(4))
    lengths = set()
    for seed in range(200):
        fs = fresh()
        fd = fs.open("/data/log", W)
        fs.fsync(fd)
        files.fsync_dir(fs, "/data")
        for i in range(4):
            files.pwrite_all(fs, fd, whole[10 * i : 10 * i + 10], 10 * i)
        after = fs.power_cut(random.Random(seed))
        kept = files.read_file(after, "/data/log")
        assert kept == whole[: len(kept)]
        lengths.add(len(kept))
    assert {0, 10, 40} <= lengths and any(n % 10 for n in lengths)  # nothing, whole writes, all, torn


def test_a_power_cut_keeps_everything_fsynced() -> None:
    for seed in range(50):
        fs = fresh()
        fd = fs.open("/data/log", W)
        files.pwrite_all(fs, fd, b"a" * 30, 0)
        fs.ftruncate(fd, 20)
        files.pwrite_all(fs, fd, b"b" * 5, 25)
        fs.fdatasync(fd)
        files.fsync_dir(fs, "/data")
        files.pwrite_all(fs, fd, b"c" * 5, 30)  # after the sync: may go
        kept = files.read_file(fs.power_cut(random.Random(seed)), "/data/log")
        assert kept[:30] == b"a" * 20 + bytes(5) + b"b" * 5
        assert kept[30:] in (b"", b"c", b"cc", b"ccc", b"cccc", b"ccccc")


def test_a_file_created_without_a_directory_fsync_may_vanish() -> None:
    seen = set()
    for seed in range(60):
        fs = fresh()
        files.write_new(fs, "/data/f", b"content")  # the file is synced, its directory entry not
        seen.add(read_or_none(fs.power_cut(random.Random(seed)), "/data/f"))
    assert seen == {None, b"content"}
    for seed in range(30):
        fs = fresh()
        files.write_new(fs, "/data/f", b"content")
        files.fsync_dir(fs, "/data")
        assert read_or_none(fs.power_cut(random.Random(seed)), "/data/f") == b"content"


def test_a_rename_without_a_directory_fsync_may_revert() -> None:
    seen = set()
    for seed in range(60):
        fs = fresh()
        files.replace(fs, "/data", "state", b"old")
        files.write_new(fs, "/data/.state.tmp", b"new")
        fs.rename("/data/.state.tmp", "/data/state")
        after = fs.power_cut(random.Random(seed))
        seen.add((read_or_none(after, "/data/state"), read_or_none(after, "/data/.state.tmp")))
    assert seen <= {(b"old", None), (b"new", None), (b"old", b"new")} and len(seen) >= 2
    for seed in range(30):
        fs = fresh()
        files.replace(fs, "/data", "state", b"old")
        files.replace(fs, "/data", "state", b"new")
        after = fs.power_cut(random.Random(seed))
        assert after.listdir("/data") == ["state"] and files.read_file(after, "/data/state") == b"new"


def test_renaming_a_file_before_syncing_it_can_leave_it_empty_or_torn() -> None:
    seen = set()
    for seed in range(60):
        fs = fresh()
        files.replace(fs, "/data", "state", b"old")
        fd = fs.open("/data/.state.tmp", W | os.O_TRUNC)
        files.write_all(fs, fd, b"new state")
        fs.close(fd)  # no fsync: the classic mistake
        fs.rename("/data/.state.tmp", "/data/state")
        files.fsync_dir(fs, "/data")
        seen.add(files.read_file(fs.power_cut(random.Random(seed)), "/data/state"))
    assert b"" in seen and b"new state" in seen and b"old" not in seen


def test_a_rename_between_directories_survives_in_one_of_them() -> None:
    places = set()
    for seed in range(80):
        fs = fresh()
        for name in ("a", "b"):
            files.makedirs(fs, f"/data/{name}")
        files.write_new(fs, "/data/a/x", b"x")
        fs.sync()
        fs.rename("/data/a/x", "/data/b/x")
        files.write_new(fs, "/data/a/y", b"y")  # later changes in both directories
        fs.rename("/data/a/y", "/data/b/y")
        after = fs.power_cut(random.Random(seed))
        found = (after.exists("/data/a/x"), after.exists("/data/b/x"))
        assert found in ((True, False), (False, True))
        places.add(found)
    assert len(places) == 2
    for seed in range(30):  # syncing the target directory commits the whole rename
        fs = fresh()
        files.makedirs(fs, "/data/a")
        files.makedirs(fs, "/data/b")
        files.write_new(fs, "/data/a/x", b"x")
        fs.sync()
        fs.rename("/data/a/x", "/data/b/x")
        files.fsync_dir(fs, "/data/b")
        after = fs.power_cut(random.Random(seed))
        assert after.listdir("/data/a") == [] and after.listdir("/data/b") == ["x"]


def test_a_failed_fsync_loses_the_data_even_if_a_retry_succeeds() -> None:
    for seed in range(40):
        faults = FaultPlan(random.Random(seed))
        fs = SimFileSystem(faults=faults)
        files.makedirs(fs, "/data")
        fd = fs.open("/data/log", W)
        other = fs.open("/data/log", os.O_RDONLY)  # opened before the failure
        fs.fsync(fd)
        fs.sync()
        files.pwrite_all(fs, fd, b"acknowledged?", 0)
        faults.force("eio", "fsync")
        with pytest.raises(OSError) as raised:
            fs.fsync(fd)
        assert raised.value.errno == errno.EIO
        fs.fsync(fd)  # the retry "succeeds": the pages were marked clean
        assert fs.pread(other, 100, 0) == b"acknowledged?"  # reads still see them
        with pytest.raises(OSError):  # another fd reports the failure once
            fs.fsync(other)
        fs.fsync(other)
        assert files.read_file(fs.power_cut(random.Random(seed)), "/data/log") == b""


def test_a_failed_fsync_keeps_a_truncation_for_the_next_sync() -> None:
    """A truncation is a size change in the journal, not a dirty page: a failed fsync does not
    drop it, and the next sync that succeeds makes it durable. (Dropping it, as this file system
    once did, brought back at the next power cut what a failed write's undo had cut off.)"""
    for seed in range(20):
        faults = FaultPlan(random.Random(seed))
        fs = SimFileSystem(faults=faults)
        files.makedirs(fs, "/data")
        fd = fs.open("/data/log", W)
        files.pwrite_all(fs, fd, b"kept" + b"failed", 0)
        fs.sync()  # the failed write reached the disk (another file's writeback failed)
        fs.ftruncate(fd, 4)  # the undo
        files.pwrite_all(fs, fd, b"lost", 10)  # pages dirtied after the cut: these do go
        faults.force("eio", "fdatasync")
        with pytest.raises(OSError):
            fs.fdatasync(fd)
        fs.fdatasync(fd)
        assert files.read_file(fs.power_cut(random.Random(seed)), "/data/log") == b"kept"


def test_enospc_at_fsync_also_loses_the_unsynced_writes() -> None:
    faults = FaultPlan(random.Random(1))
    fs = SimFileSystem(faults=faults)
    fd = fs.open("/f", W)
    fs.sync()
    files.pwrite_all(fs, fd, b"durable", 0)
    fs.fdatasync(fd)
    files.pwrite_all(fs, fd, b" and lost", 7)
    faults.force("fsync_enospc")
    with pytest.raises(OSError) as raised:
        fs.fdatasync(fd)
    assert raised.value.errno == errno.ENOSPC
    files.pwrite_all(fs, fd, b"!", 16)
    fs.fdatasync(fd)
    # the later write is durable, the lost bytes before it are a hole: what a real disk shows
    assert files.read_file(fs.power_cut(random.Random(2)), "/f") == b"durable" + bytes(9) + b"!"


def test_a_process_crash_closes_fds_and_keeps_the_page_cache() -> None:
    fs = fresh()
    fd = fs.open("/data/f", W)
    files.pwrite_all(fs, fd, b"unsynced", 0)
    fs.crash()
    assert fs.open_fds() == {}
    assert files.read_file(fs, "/data/f") == b"unsynced"
    with pytest.raises(OSError) as raised:
        fs.pwrite(fd, b"x", 0)
    assert raised.value.errno == errno.EBADF


def test_the_old_file_system_is_off_after_a_power_cut() -> None:
    fs = fresh()
    fs.power_cut(random.Random(0))
    with pytest.raises(OSError) as raised:
        fs.listdir("/data")
    assert raised.value.errno == errno.EIO


# ---- faults --------------------------------------------------------------------------------------


def test_a_short_write_is_continued_or_the_disk_is_full() -> None:
    endings = set()
    for seed in range(40):
        faults = FaultPlan(random.Random(seed))
        fs = SimFileSystem(faults=faults)
        fd = fs.open("/f", W)
        faults.force("short", "pwrite")
        written = fs.pwrite(fd, b"x" * 100, 0)
        assert 0 < written < 100
        try:
            files.pwrite_all(fs, fd, b"x" * (100 - written), written)
            endings.add("completed")
            assert files.read_file(fs, "/f") == b"x" * 100
        except OSError as error:
            assert error.errno == errno.ENOSPC
            endings.add("enospc")
    assert endings == {"completed", "enospc"}
    assert any(line.startswith("pwrite") and line.endswith("[fault short]") for line in fs.trace)


def test_a_forced_fault_hits_the_next_matching_call_only() -> None:
    faults = FaultPlan(random.Random(0), enabled=False)
    fs = SimFileSystem(faults=faults)
    fd = fs.open("/f", RW)
    files.pwrite_all(fs, fd, b"data", 0)
    faults.force("eio", "pread")
    fs.fsync(fd)  # not a pread: unaffected
    with pytest.raises(OSError) as raised:
        fs.pread(fd, 4, 0)
    assert raised.value.errno == errno.EIO
    assert fs.pread(fd, 4, 0) == b"data"
    for op, call in [
        ("rename", lambda: fs.rename("/f", "/g")),
        ("mkdir", lambda: fs.mkdir("/d")),
        ("open", lambda: fs.open("/new", W)),
    ]:
        faults.force("edquot", op)
        with pytest.raises(OSError) as raised:
            call()
        assert raised.value.errno == errno.EDQUOT
    assert fs.listdir("/") == ["f"]  # the failed calls changed nothing
    with pytest.raises(ValueError):
        faults.force("eio", "rename")


def test_fault_rates_hit_their_calls() -> None:
    fs = SimFileSystem(faults=FaultPlan(random.Random(0), rates={"eio": 1.0}))
    fd = fs.open("/f", W)
    assert fs.pwrite(fd, b"x", 0) == 1
    for call in (fs.fsync, fs.fdatasync, fs.syncfs):
        with pytest.raises(OSError) as raised:
            call(fd)
        assert raised.value.errno == errno.EIO
    with pytest.raises(ValueError):
        FaultPlan(random.Random(0), rates={"bitrot": 0.1})


def workload(seed: int) -> SimFileSystem:
    """A small storage-like workload under random faults and a power cut, for replay."""
    rng = random.Random(seed)
    fs = SimFileSystem(
        capacity=4000,
        faults=FaultPlan(random.Random(f"{seed}/faults"), {"enospc": 0.05, "short": 0.1, "eio": 0.1}),
    )
    files.makedirs(fs, "/data/streams")
    for round_ in range(3):
        for i in range(20):
            try:
                name = f"/data/streams/s{rng.randrange(4)}"
                fd = fs.open(name, W)
                try:
                    files.pwrite_all(fs, fd, rng.randbytes(rng.randint(1, 200)), fs.fsize(fd))
                    if rng.random() < 0.5:
                        fs.fdatasync(fd)
                finally:
                    fs.close(fd)
                if rng.random() < 0.2:
                    files.replace(fs, "/data", "manifest", f"{round_}.{i}".encode())
                if rng.random() < 0.1:
                    files.unlink_quietly(fs, name)
            except OSError:
                pass
        fs = fs.power_cut(random.Random(f"{seed}/power{round_}"))
    return fs


def test_a_seed_replays_to_the_same_trace() -> None:
    first, second = workload(7), workload(7)
    assert first.trace == second.trace and first.digest() == second.digest()
    assert any("[fault" in line for line in first.trace) and any("power_cut" in line for line in first.trace)
    assert workload(8).digest() != first.digest()


# ---- deterministic threads and a deterministic run ------------------------------------------------


def threaded_program(seed: int) -> list[str]:
    order: list[str] = []

    async def worker(name: str) -> None:
        for i in range(3):
            await trio.to_thread.run_sync(order.append, f"{name}{i}")
            order.append(f"{name}{i} back at {trio.current_time():.6f}")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for name in "abcd":
                nursery.start_soon(worker, name)

    with deterministic(seed):
        trio.run(main, clock=mock_clock())
    return order


def test_thread_interleavings_replay_per_seed_and_differ_across_seeds() -> None:
    assert threaded_program(1) == threaded_program(1)
    orders = {tuple(entry for entry in threaded_program(seed) if " back " not in entry) for seed in range(8)}
    assert len(orders) > 1


def test_deterministic_patches_the_world_and_restores_it() -> None:
    real_time, real_uuid4, real_run_sync = time.time, uuid.uuid4, trio.to_thread.run_sync

    def draw() -> tuple[Any, ...]:
        with deterministic("x"):
            return time.time(), uuid.uuid4(), random.random(), secrets.token_urlsafe(12), os.urandom(4)

    assert draw() == draw()
    assert draw()[0] == simthreads.EPOCH
    assert (time.time, uuid.uuid4, trio.to_thread.run_sync) == (real_time, real_uuid4, real_run_sync)
    assert time.time() > simthreads.EPOCH  # the real clock again (this machine is past 2023)


def test_wall_time_follows_the_mock_clock() -> None:
    async def main() -> tuple[float, float]:
        await trio.sleep(90)
        return time.time(), time.monotonic()

    with deterministic(3):
        assert trio.run(main, clock=mock_clock()) == (simthreads.EPOCH + 90, 90)


def test_thread_work_can_charge_mock_time_and_still_finishes_when_cancelled() -> None:
    threads = SimThreads(random.Random(0))
    done: list[float] = []

    def slow() -> str:
        simthreads.charge(5.0)
        done.append(trio.current_time())
        return "result"

    async def main() -> None:
        start = trio.current_time()
        assert await threads.run_sync(slow) == "result"
        assert trio.current_time() - start >= 5.0
        with trio.move_on_after(1.0):  # fires while the "thread" runs: it finishes anyway
            await trio.sleep(0.5)
            await threads.run_sync(slow)
        assert len(done) == 2 and trio.current_time() - start >= 10.5

    trio.run(main, clock=mock_clock())
    with pytest.raises(RuntimeError):
        simthreads.charge(1.0)


# ---- the simulated S3 -------------------------------------------------------------------------------


def test_s3_stores_reads_lists_and_deletes() -> None:
    s3 = SimS3(random.Random(0))
    s3.put("p/streams/a/1.seg", b"0123456789", {"sha256": "x"})
    s3.put("p/streams/b/1.seg", b"abc")
    assert s3.head("p/streams/a/1.seg") == (10, {"sha256": "x"})
    assert s3.get_range("p/streams/a/1.seg", 8, 5) == b"89"
    assert s3.list("p/streams/a/") == ["p/streams/a/1.seg"]
    assert s3.delete(["p/streams/a/1.seg", "missing"]) == []
    assert s3.list("p/") == ["p/streams/b/1.seg"]
    for call in (lambda: s3.head("p/streams/a/1.seg"), lambda: s3.get_range("p/streams/b/1.seg", 3, 1)):
        with pytest.raises(SimS3Error) as raised:
            call()
        assert raised.value.code in ("NoSuchKey", "InvalidRange")


def test_s3_down_wiped_and_partial_deletes() -> None:
    s3 = SimS3(random.Random(0))
    s3.put("k", b"v")
    s3.down = True
    with pytest.raises(SimS3Error) as raised:
        s3.head("k")
    assert raised.value.code == "EndpointConnectionError"
    s3.down = False
    s3.wipe()
    with pytest.raises(SimS3Error) as raised:
        s3.put("k", b"v")
    assert raised.value.code == "NoSuchBucket"
    s3.create_bucket()
    s3.head_bucket()
    assert s3.list() == []
    keys = [f"k{i}" for i in range(20)]
    for key in keys:
        s3.put(key, b"v")
    s3.delete_fail_rate = 0.5
    failed = s3.delete(keys)
    assert 0 < len(failed) < len(keys) and s3.list() == sorted(failed)


def test_s3_failed_puts_may_or_may_not_have_stored() -> None:
    stored = set()
    for seed in range(20):
        s3 = SimS3(random.Random(seed))
        s3.force_failure("put")
        with pytest.raises(SimS3Error) as raised:
            s3.put("k", b"v")
        assert raised.value.code == "InternalError"
        stored.add(s3.list() == ["k"])
        s3.put("k", b"v")  # the forced failure was used up
    assert stored == {True, False}


def test_a_slow_s3_takes_mock_time() -> None:
    s3 = SimS3(random.Random(0))
    s3.delay = 2.0
    threads = SimThreads(random.Random(0))

    async def main() -> float:
        await threads.run_sync(s3.put, "k", b"v")
        await threads.run_sync(s3.head, "k")
        return trio.current_time()

    assert trio.run(main, clock=mock_clock()) >= 4.0
    with pytest.raises(RuntimeError):  # a delay needs the simulated threads to spend it in
        s3.head("k")
