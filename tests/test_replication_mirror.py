"""The replication channel in one process: disk storage writing through the mirror while a follower
thread applies the channel to its copy over a real socket pair; the copy must be byte for byte what
the owner has (the follower's copy is what recovery rebuilds from), also when the follower joins
while appends go on, and a sync must not return before the follower has the bytes."""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

import pytest
import trio

from streamkeep.protocol.stream import StreamMeta
from streamkeep.replication import follower, wire
from streamkeep.replication import mirror as mirror_module
from streamkeep.replication.mirror import MARKER, Link, MirrorFileSystem
from streamkeep.storage import files
from streamkeep.storage.base import AppendRecord, ByteBudget
from streamkeep.storage.disk.storage import DiskStorage

BUDGET = ByteBudget(max_stream_bytes=1 << 24, max_total_bytes=1 << 28)


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every directory (None), relative to root; the marker left out."""
    found: dict[str, bytes | None] = {}
    for directory, dirs, names in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(directory, name), root)] = None
        for name in names:
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, root)
            if relative != MARKER:
                found[relative] = Path(path).read_bytes()
    return found


class Follower:
    def __init__(self, root: Path) -> None:
        self.copy = follower.Copy(root)
        self.copy.wipe()
        self.error: BaseException | None = None

    def join(self, mirror: MirrorFileSystem) -> tuple[Link, socket.socket]:
        ours, theirs = socket.socketpair()

        def run() -> None:
            try:
                follower.follow(theirs, self.copy)
            except BaseException as error:
                self.error = error

        threading.Thread(target=run, daemon=True).start()
        return mirror.attach(ours, "test-follower"), theirs


# Tests with no coordinator to release a broken link wait for a slow follower instead of taking it
# for gone: on a loaded 2-core CI machine a follower's sync took over the 2 s default once.
PATIENT = 60.0


def meta(name: str) -> StreamMeta:
    return StreamMeta(name=name, stream_id=name, content_type="text/plain", created_at=0.0, last_access=0.0)


async def wait_in_sync(link: Link) -> None:
    with trio.fail_after(10):
        while not link.in_sync:
            await trio.sleep(0.01)


async def test_the_copy_is_byte_for_byte_the_owners(tmp_path: Path) -> None:
    owner_dir, copy_dir = tmp_path / "owner", tmp_path / "copy"
    owner_dir.mkdir()
    synced: list[str] = []
    mirror = MirrorFileSystem(
        files.OS, owner_dir, on_in_sync=lambda link: synced.append(link.peer), ack_timeout=PATIENT
    )
    storage = DiskStorage(owner_dir, budget=BUDGET, fs=mirror, segment_max_messages=5)
    replica = Follower(copy_dir)
    async with trio.open_nursery() as nursery:
        await storage.start(nursery)
        early = await storage.create(meta("early"), [b"before the follower;"])
        link, _ = replica.join(mirror)  # joins with data already there: copied while appends go on
        async with trio.open_nursery() as writers:
            for n in range(8):

                async def write(n: int = n) -> None:
                    log = await storage.create(meta(f"s/{n}"), [b"0;"])
                    for i in range(1, 30):
                        await log.submit(AppendRecord([b"%d;" % i], log.meta, None, False, None)).wait()

                writers.start_soon(write)
            for i in range(20):
                await early.submit(AppendRecord([b"e%d;" % i], early.meta, None, False, None)).wait()
        await wait_in_sync(link)
        assert synced == ["test-follower"]
        await storage.delete("s/3")
        # After in sync, a sync returns only once the follower acknowledged it.
        log = storage.open("s/1")
        assert log is not None
        await log.submit(AppendRecord([b"last;"], log.meta, None, False, None)).wait()
        assert link.acked == link.barrier
        assert link.stats.waits > 0
        nursery.cancel_scope.cancel()
    await storage.stop()
    assert replica.error is None
    assert tree(copy_dir) == tree(owner_dir)
    # and recovery from the copy serves the same streams
    again = DiskStorage(copy_dir, budget=BUDGET)
    async with trio.open_nursery() as nursery:
        report = await again.start(nursery)
        assert report.streams == 8 and not report.skipped
        s1 = again.open("s/1")
        assert s1 is not None
        read = b"".join((await s1.read(0, 1 << 20, whole_messages=False)).messages)
        assert read == b"".join(b"%d;" % i for i in range(30)) + b"last;"
        assert again.open("s/3") is None
        nursery.cancel_scope.cancel()


async def test_a_sync_waits_for_the_follower_until_released(tmp_path: Path) -> None:
    owner_dir, copy_dir = tmp_path / "owner", tmp_path / "copy"
    owner_dir.mkdir()
    broken: list[Link] = []
    mirror = MirrorFileSystem(files.OS, owner_dir, on_broken=broken.append, ack_timeout=PATIENT)
    replica = Follower(copy_dir)
    link, theirs = replica.join(mirror)
    await wait_in_sync(link)
    fd = mirror.open(owner_dir / "f", os.O_WRONLY | os.O_CREAT)
    mirror.pwrite(fd, b"abc", 0)
    mirror.fdatasync(fd)
    assert (copy_dir / "f").read_bytes() == b"abc"
    # the follower goes away: a sync must wait, not return as if both had it
    theirs.shutdown(socket.SHUT_RDWR)
    mirror.pwrite(fd, b"def", 3)
    done = threading.Event()
    threading.Thread(target=lambda: (mirror.fdatasync(fd), done.set()), daemon=True).start()
    with trio.fail_after(5):
        while not broken:
            await trio.sleep(0.01)
    assert not done.wait(0.3)
    # a sync that starts after the break waits for the decision too: until etcd says the owner
    # runs alone, the follower there may still be promoted, and it lacks these bytes
    later = threading.Event()
    threading.Thread(target=lambda: (mirror.fsync(fd), later.set()), daemon=True).start()
    assert not later.wait(0.3)
    mirror.release(broken[0])  # the coordinator recorded in etcd that the owner runs alone
    assert done.wait(5) and later.wait(5)
    mirror.close(fd)
    assert mirror.link is None


async def test_a_silent_follower_is_taken_for_gone(tmp_path: Path) -> None:
    """A partition drops packets: no reset comes. A sync unacknowledged for the ack timeout breaks
    the link, so the coordinator can decide instead of every append hanging."""
    owner_dir, copy_dir = tmp_path / "owner", tmp_path / "copy"
    owner_dir.mkdir()
    broken: list[Link] = []
    mirror = MirrorFileSystem(files.OS, owner_dir, on_broken=broken.append, ack_timeout=0.5)
    copy = follower.Copy(copy_dir)
    copy.wipe()
    ours, relay_in = socket.socketpair()
    relay_out, theirs = socket.socketpair()
    paused = threading.Event()

    def relay() -> None:  # owner -> follower, until paused; acks flow back directly
        while True:
            data = relay_in.recv(65536)
            if not data or paused.is_set():
                return
            relay_out.sendall(data)

    def acks() -> None:
        while data := relay_out.recv(65536):
            relay_in.sendall(data)

    for target in (relay, acks, lambda: follower.follow(theirs, copy)):
        threading.Thread(target=target, daemon=True).start()
    link = mirror.attach(ours, "silent")
    await wait_in_sync(link)
    fd = mirror.open(owner_dir / "f", os.O_WRONLY | os.O_CREAT)
    mirror.pwrite(fd, b"abc", 0)
    mirror.fdatasync(fd)
    paused.set()
    mirror.pwrite(fd, b"def", 3)
    done = threading.Event()
    threading.Thread(target=lambda: (mirror.fdatasync(fd), done.set()), daemon=True).start()
    with trio.fail_after(5):
        while not broken:
            await trio.sleep(0.01)
    assert isinstance(broken[0].broken, TimeoutError)
    assert not done.is_set()
    mirror.release(broken[0])
    assert done.wait(5)
    mirror.close(fd)


def test_frames_round_trip_in_any_pieces() -> None:
    ops = [
        wire.Op(wire.MKDIR, "a"),
        wire.Op(wire.CREATE, "a/f", number=1),
        wire.Op(wire.WRITE, "a/f", number=7, data=b"x" * 1000),
        wire.Op(wire.TRUNCATE, "a/f", number=3),
        wire.Op(wire.RENAME, "a/f", "a/g"),
        wire.Op(wire.UNLINK, "a/g"),
        wire.Op(wire.RMDIR, "a"),
        wire.Op(wire.SYNC, number=42),
    ]
    data = b"".join(wire.encode(op) for op in ops)
    decoder = wire.Decoder()
    got: list[wire.Op] = []
    for at in range(0, len(data), 7):
        got += decoder.feed(data[at : at + 7])
    assert got == ops


def test_a_hostile_path_is_refused(tmp_path: Path) -> None:
    copy = follower.Copy(tmp_path)
    for bad in ("../x", "/etc/passwd", "a/../../x", ""):
        try:
            copy.apply(wire.Op(wire.CREATE, bad, number=1))
        except wire.ProtocolError:
            continue
        raise AssertionError(f"{bad!r} was applied")


async def test_a_large_copy_joins_under_writes_with_big_frames_and_modes(tmp_path: Path) -> None:
    """A follower joining a directory of tens of MiB while writes go on gets in sync (the copier
    keeps a window, the join waits for the copy to be acknowledged), a single write larger than a
    frame travels, and a 0600 key file stays 0600 on the copy."""
    owner_dir, copy_dir = tmp_path / "owner", tmp_path / "copy"
    owner_dir.mkdir()
    mirror = MirrorFileSystem(files.OS, owner_dir, ack_timeout=PATIENT)
    for n in range(40):
        (owner_dir / f"d{n % 4}").mkdir(exist_ok=True)
        (owner_dir / f"d{n % 4}" / f"f{n}").write_bytes(os.urandom(1 << 20))
    files.replace(mirror, owner_dir, "key", b"secret", mode=0o600)
    replica = Follower(copy_dir)
    link, _ = replica.join(mirror)
    fd = mirror.open(owner_dir / "live", os.O_WRONLY | os.O_CREAT)
    offset = 0
    with trio.fail_after(60):
        while not link.in_sync:
            await trio.to_thread.run_sync(mirror.pwrite, fd, b"x" * 4096, offset)
            await trio.to_thread.run_sync(mirror.fdatasync, fd)
            offset += 4096
    big = os.urandom(3 << 20)  # three frames' worth in one write
    await trio.to_thread.run_sync(lambda: files.pwrite_all(mirror, fd, big, offset))
    await trio.to_thread.run_sync(mirror.fdatasync, fd)
    mirror.close(fd)
    assert replica.error is None
    assert tree(copy_dir) == tree(owner_dir)
    assert (copy_dir / "key").stat().st_mode & 0o777 == 0o600
    assert link.stats.copied_bytes >= 40 << 20


def churn_once(mirror: MirrorFileSystem, root: Path, rng: random.Random) -> None:
    """One random change through the mirror: files written, made, renamed and unlinked, and whole
    directories made, renamed (with what is in them) and removed."""
    dirs = [root, *sorted(Path(d) / n for d, ds, _ in os.walk(root) for n in ds)]
    names = sorted(Path(d) / n for d, _, ns in os.walk(root) for n in ns if n != MARKER)
    where = rng.choice(dirs)
    kind = rng.randrange(7)
    if kind == 0 and names:
        target = rng.choice(names)
        fd = mirror.open(target, os.O_WRONLY)
        mirror.pwrite(fd, rng.randbytes(rng.randrange(1, 300)), rng.randrange(target.stat().st_size + 1))
        mirror.close(fd)
    elif kind == 1:
        fd = mirror.open(where / f"f{rng.randrange(1000)}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        mirror.write(fd, rng.randbytes(rng.randrange(500)))
        mirror.close(fd)
    elif kind == 2 and names:
        mirror.rename(rng.choice(names), where / f"f{rng.randrange(1000)}")  # may replace a file
    elif kind == 3 and names:
        mirror.unlink(rng.choice(names))
    elif kind == 4 and not (made := where / f"d{rng.randrange(1000)}").exists():
        mirror.mkdir(made)
    elif kind == 5 and len(dirs) > 1:
        moved = rng.choice(dirs[1:])
        into = rng.choice([d for d in dirs if d != moved and moved not in d.parents])
        target = into / f"d{rng.randrange(1000)}"
        if not target.exists():
            mirror.rename(moved, target)
    elif kind == 6 and len(dirs) > 1:
        doomed = rng.choice(dirs[1:])
        for directory, subdirs, files_there in os.walk(doomed, topdown=False):
            for name in files_there:
                mirror.unlink(Path(directory) / name)
            for name in subdirs:
                mirror.rmdir(Path(directory) / name)
        mirror.rmdir(doomed)


@pytest.mark.parametrize("seed", range(6))
async def test_a_copy_made_under_renames_and_deletes_of_whole_directories_is_exact(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copier's place follows every rename and removal made while it walks the tree (a stream
    created by renaming its staging directory, deleted by moving it to trash): when the follower is
    in sync its copy is the owner's tree exactly, seeded and replayable."""
    monkeypatch.setattr(mirror_module, "COPY_CHUNK", 64)  # files are sent in many steps
    rng = random.Random(seed)
    owner_dir, copy_dir = tmp_path / "owner", tmp_path / "copy"
    for n in range(60):
        directory = owner_dir / f"d{n % 12}" / f"d{n % 5}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"f{n}").write_bytes(rng.randbytes(rng.randrange(1, 700)))
    mirror = MirrorFileSystem(files.OS, owner_dir, ack_timeout=PATIENT)
    replica = Follower(copy_dir)
    link, _ = replica.join(mirror)
    changes = 0
    with trio.fail_after(60):
        while not link.in_sync or changes < 400:
            churn_once(mirror, owner_dir, rng)
            changes += 1
            await trio.lowlevel.checkpoint()
    fd = mirror.open(owner_dir / "last", os.O_WRONLY | os.O_CREAT)
    with trio.fail_after(20):  # a follower that broke applying never acknowledges it
        await trio.to_thread.run_sync(mirror.fdatasync, fd, abandon_on_cancel=True)
    mirror.close(fd)  # every change before that sync is on the copy
    assert replica.error is None
    assert tree(copy_dir) == tree(owner_dir)
