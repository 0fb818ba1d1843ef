"""`SimFileSystem`: an in-memory POSIX file system that fails on purpose and loses power on purpose.

It implements `streamkeep.storage.files.FileSystem` with Linux's errors (checked against the real one
by tests/test_simfs.py), so storage code runs on it unchanged, and it keeps two states:

- what reads see (the page cache): every write, rename and unlink at once;
- what survives a power cut: for a file, what its last successful fsync/fdatasync wrote; for a
  directory, the entries as of its last fsync. `syncfs` makes everything durable.

`power_cut(rng)` returns the file system as it would be after a reboot: the durable state plus an
adversarial, seeded choice of the unsynced rest. Per directory, a prefix of its unsynced entry
changes (creates, renames, unlinks), in order; a rename between two directories is one journal
transaction, so it is kept in both or in neither. Per file, a prefix of its unsynced writes and
truncations, the last write possibly torn at any byte. Files no directory reaches are gone. So: a
file created without a directory fsync may vanish, a rename may revert, an unsynced append keeps
any prefix, and `rename(tmp, name)` before `fsync(tmp)` may leave `name` empty or torn.

`crash()` is the process dying instead: every fd is closed, the page cache survives.

Failed fsync is Linux's ("fsyncgate"): when fsync/fdatasync fails (EIO, or ENOSPC from delayed
allocation) the file's unsynced writes are dropped from what can ever become durable (the kernel
marked the pages clean) while reads still see them; a later fsync that succeeds does not bring
them back, so code that retries fsync and then acknowledges loses data at the next power cut. Its
unsynced truncations stay pending (metadata in the journal, not pages): the next sync keeps them. Like
Linux's errseq, an fd opened before the failure reports EIO once at its next fsync.

Space: `capacity` bytes of file content (sizes, not blocks). A file unlinked while open keeps its
bytes until its last fd closes. A write that does not fit is short, or ENOSPC if nothing fits.

Faults come from a `FaultPlan` (seeded rates per kind, or `force` for the next matching call).
Every call is appended to `trace` (op, arguments with sizes and CRCs, result or errno, faults), and
`digest()` hashes it: the same seed must give the same digest. When a seed fails, print the trace.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import random
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from streamkeep.storage.files import PathLike

UNLIMITED = 1 << 50
FIRST_FD = 3  # 0, 1 and 2 are stdio in a real process

# Which calls each fault kind can hit. "open" means an open that creates the file.
KINDS: dict[str, tuple[str, ...]] = {
    "enospc": ("open", "write", "pwrite", "mkdir", "rename"),
    "edquot": ("open", "write", "pwrite", "mkdir", "rename"),
    "short": ("write", "pwrite"),  # writes a random prefix; the next write then fails or not
    "eio": ("fsync", "fdatasync", "syncfs", "pread"),
    "fsync_enospc": ("fsync", "fdatasync"),  # ENOSPC reported at writeback (delayed allocation)
}


def _error(code: int, path: PathLike | None = None) -> OSError:
    # OSError(code, ...) builds the subclass Python maps the errno to (FileNotFoundError, ...).
    if path is None:
        return OSError(code, os.strerror(code))
    return OSError(code, os.strerror(code), os.fspath(path))


@dataclass
class FaultPlan:
    """Which calls fail. Random faults draw from `rng` at every call they could hit, so a plan
    replays exactly given the same calls; `force` fails the next matching call even if disabled."""

    rng: random.Random
    rates: dict[str, float] = field(default_factory=dict)
    enabled: bool = True
    forced: list[tuple[str, str | None]] = field(default_factory=list)
    after_short: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.rates) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {sorted(KINDS)}")

    def force(self, kind: str, op: str | None = None) -> None:
        """The next call of `op` (any call `kind` can hit, if None) fails with `kind`."""
        if kind not in KINDS or (op is not None and op not in KINDS[kind]):
            raise ValueError(f"fault {kind!r} cannot hit {op!r}")
        self.forced.append((kind, op))

    def pick(self, op: str) -> str | None:
        for index, (kind, wanted) in enumerate(self.forced):
            if op in KINDS[kind] and wanted in (None, op):
                del self.forced[index]
                return self._chosen(kind)
        if not self.enabled:
            return None
        if self.after_short and op in ("write", "pwrite"):
            # The write after a short one: the disk really was full, or the shortage was passing.
            self.after_short = False
            if self.rng.random() < 0.5:
                return "enospc"
        for kind in KINDS:  # a fixed order, so the draws replay
            rate = self.rates.get(kind, 0.0)
            if rate and op in KINDS[kind] and self.rng.random() < rate:
                return self._chosen(kind)
        return None

    def _chosen(self, kind: str) -> str:
        self.after_short = kind == "short"
        return kind


class File:
    def __init__(self, data: bytes = b"") -> None:
        self.data = bytearray(data)  # what reads see
        self.durable = bytes(data)  # what a power cut keeps for sure
        self.pending: list[tuple[int, bytes] | int] = []  # unsynced (offset, bytes) writes, int truncations
        self.links = 0
        self.opens = 0
        self.errors = 0  # writeback failures so far (Linux errseq); each fd reports new ones once


class Dir:
    def __init__(self, parent: Dir | None = None) -> None:
        self.parent = parent or self  # the root is its own parent
        self.entries: dict[str, Node] = {}
        self.durable: dict[str, Node] = {}
        self.pending: list[Change] = []
        self.links = 0
        self.opens = 0


Node = File | Dir


@dataclass(eq=False)
class Change:
    """One unsynced change to a directory's entries (None removes the name). A rename between two
    directories is two changes that are partners: durable together or not at all."""

    directory: Dir
    sets: list[tuple[str, Node | None]]
    partner: Change | None = None
    done: bool = False

    def apply(self, entries: dict[str, Node]) -> None:
        for name, node in self.sets:
            if node is None:
                entries.pop(name, None)
            else:
                entries[name] = node


@dataclass(eq=False)
class Fd:
    node: Node
    path: str
    readable: bool
    writable: bool
    seen_errors: int
    position: int = 0


def _apply(content: bytes, ops: list[tuple[int, bytes] | int]) -> bytes:
    data = bytearray(content)
    for op in ops:
        if isinstance(op, int):
            del data[op:]
            data.extend(bytes(op - len(data)))
        else:
            _write_into(data, *op)
    return bytes(data)


def _write_into(data: bytearray, offset: int, chunk: bytes) -> None:
    if offset > len(data):
        data.extend(bytes(offset - len(data)))
    data[offset : offset + len(chunk)] = chunk


def _show(value: Any) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        value = bytes(value)
        return f"<{len(value)}B {zlib.crc32(value):08x}>"
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def _flag_names(flags: int) -> str:
    names = [("O_RDONLY", "O_WRONLY", "O_RDWR")[flags & os.O_ACCMODE]]
    names += [name for name in ("O_CREAT", "O_EXCL", "O_TRUNC", "O_DIRECTORY") if flags & getattr(os, name)]
    return "|".join(names)


F = TypeVar("F", bound=Callable[..., Any])


def _call(method: F) -> F:
    """Runs a public call under the lock, on a powered file system, and traces it."""

    @functools.wraps(method)
    def call(self: SimFileSystem, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            shown = [
                _flag_names(arg) if method.__name__ == "open" and i == 1 else _show(arg)
                for i, arg in enumerate(args)
            ]
            shown += [f"{key}={_show(value)}" for key, value in kwargs.items()]
            line = " ".join([method.__name__, *shown])
            self._note = ""
            try:
                if self._off:
                    raise _error(errno.EIO)  # the machine is off: a stale task of the old process
                result = method(self, *args, **kwargs)
            except OSError as error:
                self.trace.append(
                    f"{line} -> {errno.errorcode.get(error.errno or 0, error.errno)}{self._note}"
                )
                raise
            self.trace.append(f"{line} -> {_show(result)}{self._note}")
            return result

    return call  # type: ignore[return-value]


class SimFileSystem:
    """See the module docstring. Paths are absolute; the root "/" always exists."""

    def __init__(
        self,
        capacity: int = UNLIMITED,
        faults: FaultPlan | None = None,
        trace: list[str] | None = None,
        hash_seed: int = 0,
    ) -> None:
        self.capacity = capacity
        self.faults = faults or FaultPlan(random.Random(0))
        self.trace: list[str] = [] if trace is None else trace
        self.hash_seed = hash_seed  # orders listdir like a hashed directory (ext4's htree)
        self.root = Dir()
        self.root.links = 1
        self._nodes: dict[Node, None] = {self.root: None}  # alive (linked or open), in creation order
        self._fds: dict[int, Fd] = {}
        self._lock = threading.RLock()
        self._off = False
        self._note = ""

    # ---- the FileSystem protocol ----------------------------------------------------------

    @_call
    def open(self, path: PathLike, flags: int, mode: int = 0o644) -> int:
        parent, name, slash = self._parent(path)
        node = parent if name is None else parent.entries.get(name)
        access = flags & os.O_ACCMODE
        if flags & os.O_CREAT and slash and name is not None:  # Linux refuses "name/" before looking
            raise _error(errno.EISDIR, path)
        if node is None:
            if not flags & os.O_CREAT:
                raise _error(errno.ENOENT, path)
            self._fault("open")
            if self._free() <= 0:
                raise _error(errno.ENOSPC, path)
            node = File()
            self._link(parent, name, node)  # type: ignore[arg-type]  # name is None only for "/", "." or ".."
        elif flags & os.O_CREAT and flags & os.O_EXCL:
            raise _error(errno.EEXIST, path)
        elif isinstance(node, Dir):
            if access != os.O_RDONLY or flags & os.O_CREAT:
                raise _error(errno.EISDIR, path)
        elif slash or flags & os.O_DIRECTORY:
            raise _error(errno.ENOTDIR, path)
        elif flags & os.O_TRUNC:
            self._truncate(node, 0)
        fd = next(n for n in range(FIRST_FD, FIRST_FD + len(self._fds) + 1) if n not in self._fds)
        errors = node.errors if isinstance(node, File) else 0
        self._fds[fd] = Fd(node, os.fspath(path), access != os.O_WRONLY, access != os.O_RDONLY, errors)
        node.opens += 1
        self._nodes[node] = None
        return fd

    @_call
    def close(self, fd: int) -> None:
        self._close(fd)

    @_call
    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        return self._write(self._writable(fd), bytes(data), offset, "pwrite")

    @_call
    def write(self, fd: int, data: bytes | memoryview) -> int:
        handle = self._writable(fd)
        written = self._write(handle, bytes(data), handle.position, "write")
        handle.position += written
        return written

    @_call
    def pread(self, fd: int, length: int, offset: int) -> bytes:
        handle = self._fd(fd)
        if not handle.readable:
            raise _error(errno.EBADF)
        if isinstance(handle.node, Dir):
            raise _error(errno.EISDIR)
        if length < 0 or offset < 0:
            raise _error(errno.EINVAL)
        if self._fault("pread"):
            raise _error(errno.EIO)
        return bytes(handle.node.data[offset : offset + length])

    @_call
    def fsync(self, fd: int) -> None:
        self._fsync(fd, "fsync")

    @_call
    def fdatasync(self, fd: int) -> None:
        self._fsync(fd, "fdatasync")

    @_call
    def ftruncate(self, fd: int, length: int) -> None:
        handle = self._fd(fd)
        if not handle.writable or isinstance(handle.node, Dir) or length < 0:
            raise _error(errno.EINVAL)
        self._truncate(handle.node, length)

    @_call
    def fsize(self, fd: int) -> int:
        node = self._fd(fd).node
        return len(node.data) if isinstance(node, File) else 0

    @_call
    def syncfs(self, fd: int) -> None:
        self._fd(fd)
        if self._fault("syncfs"):
            # Writeback failed somewhere: some dirty files lose their unsynced writes as in a
            # failed fsync, the others are written. Which ones is the seed's choice.
            for node in list(self._nodes):
                if isinstance(node, File) and node.pending and self.faults.rng.random() < 0.5:
                    self._lose_unsynced(node)
            self._sync_everything()
            raise _error(errno.EIO)
        self._sync_everything()

    @_call
    def rename(self, source: PathLike, target: PathLike) -> None:
        source_dir, source_name, source_slash = self._parent(source)
        target_dir, target_name, target_slash = self._parent(target)
        if source_name is None or target_name is None:  # "/", "." or ".."
            raise _error(errno.EBUSY, source)
        node = source_dir.entries.get(source_name)
        if node is None:
            raise _error(errno.ENOENT, source)
        if isinstance(node, File) and (source_slash or target_slash):
            raise _error(errno.ENOTDIR, source)
        old = target_dir.entries.get(target_name)
        # Linux's order: a directory moved into itself, a target that holds the source, the same
        # file (nothing to do), then file against directory.
        if self._within(target_dir, node):
            raise _error(errno.EINVAL, source)
        if old is not None and self._within(source_dir, old):
            raise _error(errno.ENOTEMPTY, target)
        if old is node:
            return
        if isinstance(node, Dir) and isinstance(old, File):
            raise _error(errno.ENOTDIR, target)
        if isinstance(node, File) and isinstance(old, Dir):
            raise _error(errno.EISDIR, target)
        if isinstance(old, Dir) and old.entries:
            raise _error(errno.ENOTEMPTY, target)
        self._fault("rename")
        del source_dir.entries[source_name]
        target_dir.entries[target_name] = node
        if isinstance(node, Dir):
            node.parent = target_dir
        if old is not None:
            old.links -= 1
            self._forget_if_dead(old)
        if source_dir is target_dir:
            source_dir.pending.append(Change(source_dir, [(source_name, None), (target_name, node)]))
        else:
            leave = Change(source_dir, [(source_name, None)])
            arrive = Change(target_dir, [(target_name, node)], partner=leave)
            leave.partner = arrive
            source_dir.pending.append(leave)
            target_dir.pending.append(arrive)

    @_call
    def unlink(self, path: PathLike) -> None:
        parent, name, slash = self._parent(path)
        if name is None:  # "/", "d/." or "d/.."
            raise _error(errno.EISDIR, path)
        node = parent.entries.get(name)
        if node is None:
            raise _error(errno.ENOENT, path)
        if isinstance(node, Dir):
            raise _error(errno.EISDIR, path)
        if slash:
            raise _error(errno.ENOTDIR, path)
        self._unlink(parent, name)

    @_call
    def mkdir(self, path: PathLike) -> None:
        parent, name, _ = self._parent(path)
        if name is None or name in parent.entries:
            raise _error(errno.EEXIST, path)
        self._fault("mkdir")
        if self._free() <= 0:
            raise _error(errno.ENOSPC, path)
        self._link(parent, name, Dir(parent))

    @_call
    def rmdir(self, path: PathLike) -> None:
        parent, name, _ = self._parent(path)
        if name is None:  # "/", "d/." or "d/..", as Linux answers them
            last = os.fspath(path).rstrip("/").rsplit("/", 1)[-1]
            raise _error({".": errno.EINVAL, "..": errno.ENOTEMPTY}.get(last, errno.EBUSY), path)
        node = parent.entries.get(name)
        if node is None:
            raise _error(errno.ENOENT, path)
        if isinstance(node, File):
            raise _error(errno.ENOTDIR, path)
        if node.entries:
            raise _error(errno.ENOTEMPTY, path)
        self._unlink(parent, name)

    @_call
    def listdir(self, path: PathLike) -> list[str]:
        node = self._lookup(path)
        if isinstance(node, File):
            raise _error(errno.ENOTDIR, path)
        return sorted(node.entries, key=lambda name: zlib.crc32(f"{self.hash_seed}/{name}".encode()))

    @_call
    def exists(self, path: PathLike) -> bool:
        try:
            self._lookup(path)
        except OSError:
            return False
        return True

    @_call
    def is_dir(self, path: PathLike) -> bool:
        try:
            return isinstance(self._lookup(path), Dir)
        except OSError:
            return False

    @_call
    def free_bytes(self, path: PathLike) -> int:
        self._lookup(path)
        return max(0, self._free())

    # ---- simulation controls --------------------------------------------------------------

    def crash(self) -> None:
        """The process dies: its fds close; written data stays in the page cache."""
        with self._lock:
            for fd in sorted(self._fds):
                self._close(fd)
            self.trace.append("crash")

    def power_cut(self, rng: random.Random) -> SimFileSystem:
        """The machine loses power; returns the file system after reboot (see the module docstring).
        This one is off from now on: calls on it fail with EIO."""
        with self._lock:
            self._off = True
            dirs = self._every_dir_that_may_survive()
            kept = {directory: rng.randint(0, len(directory.pending)) for directory in dirs}
            changed = True
            while changed:  # a cross-directory rename survives in both directories or in neither
                changed = False
                for directory in dirs:
                    for change in directory.pending[: kept[directory]]:
                        partner = change.partner
                        if partner is not None and not partner.done:
                            needed = partner.directory.pending.index(partner) + 1
                            if kept[partner.directory] < needed:
                                kept[partner.directory] = needed
                                changed = True
            after = SimFileSystem(self.capacity, self.faults, self.trace, self.hash_seed)
            files = {"kept": 0, "of": 0, "torn": 0}
            copies: dict[Node, Node] = {self.root: after.root}
            self._rebuild(self.root, after, kept, copies, rng, files)
            self.trace.append(
                f"power_cut entry changes kept {sum(kept.values())}/{sum(len(d.pending) for d in dirs)}, "
                f"file writes kept {files['kept']}/{files['of']}, torn {files['torn']}"
            )
            return after

    def sync(self) -> None:
        """Makes everything durable, without faults or trace (a test's setup)."""
        with self._lock:
            self._sync_everything()

    def digest(self) -> str:
        return hashlib.sha256("\n".join(self.trace).encode()).hexdigest()

    def snapshot(self) -> dict[str, bytes | None]:
        """Every path and its content as reads see it (None for a directory), for assertions."""
        with self._lock:
            return dict(self._walk(self.root, ""))

    def open_fds(self) -> dict[int, str]:
        """fd -> the path it was opened with (a leak shows up here)."""
        return {fd: handle.path for fd, handle in self._fds.items()}

    # ---- internals --------------------------------------------------------------------------

    def _parent(self, path: PathLike) -> tuple[Dir, str | None, bool]:
        """The directory holding `path`'s last component, that name (None for the root or a
        trailing ".."), and whether the path ended with a slash."""
        text = os.fspath(path)
        if not text:
            raise _error(errno.ENOENT, path)
        parts = [part for part in text.split("/") if part]
        node: Node = self.root
        for part in parts[:-1]:
            node = self._step(node, part, path)
        if not isinstance(node, Dir):
            raise _error(errno.ENOTDIR, path)
        if not parts or parts[-1] in (".", ".."):
            return (node.parent if parts and parts[-1] == ".." else node), None, True
        return node, parts[-1], text.endswith("/")

    def _step(self, node: Node, part: str, path: PathLike) -> Node:
        if not isinstance(node, Dir):
            raise _error(errno.ENOTDIR, path)
        if part in (".", ".."):
            return node if part == "." else node.parent
        child = node.entries.get(part)
        if child is None:
            raise _error(errno.ENOENT, path)
        return child

    def _lookup(self, path: PathLike) -> Node:
        parent, name, slash = self._parent(path)
        if name is None:
            return parent
        node = self._step(parent, name, path)
        if slash and isinstance(node, File):
            raise _error(errno.ENOTDIR, path)
        return node

    def _within(self, directory: Dir, ancestor: Node) -> bool:
        while True:
            if directory is ancestor:
                return True
            if directory is self.root:
                return False
            directory = directory.parent

    def _fd(self, fd: int) -> Fd:
        handle = self._fds.get(fd)
        if handle is None:
            raise _error(errno.EBADF)
        return handle

    def _writable(self, fd: int) -> Fd:
        handle = self._fd(fd)
        if not handle.writable:
            raise _error(errno.EBADF)
        return handle

    def _fault(self, op: str) -> str | None:
        kind = self.faults.pick(op)
        if kind is None:
            return None
        self._note = f" [fault {kind}]"
        if kind in ("enospc", "edquot"):
            raise _error(errno.ENOSPC if kind == "enospc" else errno.EDQUOT)
        return kind

    def _free(self) -> int:
        used = sum(len(node.data) for node in self._nodes if isinstance(node, File))
        return self.capacity - used

    def _write(self, handle: Fd, data: bytes, offset: int, op: str) -> int:
        node = handle.node
        assert isinstance(node, File)  # directories are never opened for writing
        if offset < 0:
            raise _error(errno.EINVAL)
        if not data:
            return 0
        kind = self._fault(op)
        room = len(node.data) + self._free() - offset  # bytes that fit from `offset` on
        if offset + len(data) > len(node.data) and room < len(data):
            if room <= 0:
                raise _error(errno.ENOSPC)
            data = data[:room]
        if kind == "short" and len(data) > 1:
            data = data[: self.faults.rng.randint(1, len(data) - 1)]
        elif kind == "short":  # one byte cannot be cut short: no fault after all
            self._note, self.faults.after_short = "", False
        _write_into(node.data, offset, data)
        node.pending.append((offset, data))
        return len(data)

    def _truncate(self, node: File, length: int) -> None:
        del node.data[length:]
        node.data.extend(bytes(length - len(node.data)))
        node.pending.append(length)

    def _fsync(self, fd: int, op: str) -> None:
        handle = self._fd(fd)
        node = handle.node
        kind = self._fault(op)
        if isinstance(node, Dir):
            if kind:  # the journal write failed: nothing more became durable
                raise _error(errno.EIO if kind == "eio" else errno.ENOSPC)
            self._commit_dir(node)
            return
        if kind:
            self._lose_unsynced(node)
            handle.seen_errors = node.errors
            raise _error(errno.EIO if kind == "eio" else errno.ENOSPC)
        self._commit_file(node)
        if handle.seen_errors < node.errors:  # a failure this fd has not reported yet
            handle.seen_errors = node.errors
            raise _error(errno.EIO)

    def _lose_unsynced(self, node: File) -> None:
        # The kernel marks the failed pages clean: reads still see them, no fsync will write them.
        # Only the writes go. A truncation is no dirty page but a change of the inode's size, in the
        # file system's journal: a failed data writeback does not take it out of the journal, and
        # the next journal commit (any later fsync or syncfs that succeeds) makes it durable. (A
        # failed journal write shuts the file system down instead: no later fsync succeeds.) So a
        # truncation that cuts off what a failed write left stays pending, to become durable.
        node.pending[:] = [change for change in node.pending if isinstance(change, int)]
        node.errors += 1

    def _commit_file(self, node: File) -> None:
        node.durable = _apply(node.durable, node.pending)
        node.pending.clear()

    def _commit_dir(self, directory: Dir, through: Change | None = None) -> None:
        while directory.pending:
            change = directory.pending.pop(0)
            change.apply(directory.durable)
            change.done = True
            if change.partner is not None and not change.partner.done:
                self._commit_dir(change.partner.directory, change.partner)
            if change is through:
                return

    def _sync_everything(self) -> None:
        for node in list(self._nodes):
            if isinstance(node, File):
                self._commit_file(node)
            else:
                self._commit_dir(node)

    def _link(self, parent: Dir, name: str, node: Node) -> None:
        parent.entries[name] = node
        parent.pending.append(Change(parent, [(name, node)]))
        node.links += 1
        self._nodes[node] = None

    def _unlink(self, parent: Dir, name: str) -> None:
        node = parent.entries.pop(name)
        parent.pending.append(Change(parent, [(name, None)]))
        node.links -= 1
        self._forget_if_dead(node)

    def _close(self, fd: int) -> None:
        handle = self._fds.pop(fd, None)
        if handle is None:
            raise _error(errno.EBADF)
        handle.node.opens -= 1
        self._forget_if_dead(handle.node)

    def _forget_if_dead(self, node: Node) -> None:
        # Unlinked and closed: its bytes are free. (A power cut may still bring it back, from the
        # durable entries of a directory whose unlink was not synced.)
        if node.links <= 0 and node.opens <= 0:
            self._nodes.pop(node, None)

    def _every_dir_that_may_survive(self) -> list[Dir]:
        found: dict[Dir, None] = {}

        def visit(directory: Dir) -> None:
            if directory in found:
                return
            found[directory] = None
            children = list(directory.durable.values())
            for change in directory.pending:
                children += [node for _, node in change.sets if node is not None]
                if change.partner is not None:
                    children.append(change.partner.directory)
            for child in children:
                if isinstance(child, Dir):
                    visit(child)

        visit(self.root)
        return list(found)

    def _rebuild(
        self,
        old: Dir,
        after: SimFileSystem,
        kept: dict[Dir, int],
        copies: dict[Node, Node],
        rng: random.Random,
        files: dict[str, int],
    ) -> None:
        entries = dict(old.durable)
        for change in old.pending[: kept[old]]:
            change.apply(entries)
        new = copies[old]
        assert isinstance(new, Dir)
        for name, child in entries.items():
            copy = copies.get(child)
            if copy is None:
                if isinstance(child, Dir):
                    copy = copies[child] = Dir(new)
                    self._rebuild(child, after, kept, copies, rng, files)
                else:
                    copy = copies[child] = File(self._surviving_content(child, rng, files))
            new.entries[name] = new.durable[name] = copy
            copy.links += 1
            after._nodes[copy] = None

    @staticmethod
    def _surviving_content(node: File, rng: random.Random, files: dict[str, int]) -> bytes:
        count = rng.randint(0, len(node.pending))
        files["kept"] += count
        files["of"] += len(node.pending)
        data = bytearray(_apply(node.durable, node.pending[:count]))
        if count < len(node.pending):
            torn = node.pending[count]
            if isinstance(torn, tuple) and len(torn[1]) > 1 and rng.random() < 0.5:
                _write_into(data, torn[0], torn[1][: rng.randrange(1, len(torn[1]))])
                files["torn"] += 1
        return bytes(data)

    def _walk(self, directory: Dir, prefix: str) -> Iterator[tuple[str, bytes | None]]:
        for name in sorted(directory.entries):
            node = directory.entries[name]
            path = f"{prefix}/{name}"
            if isinstance(node, Dir):
                yield path, None
                yield from self._walk(node, path)
            else:
                yield path, bytes(node.data)
