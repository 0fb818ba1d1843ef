"""Where a joining follower's copy stands: what is still to visit and what is still to send.

The copier walks the data directory breadth first. An entry it has named but not yet looked at is
a *visit* (a directory is listed then, a file starts to be sent); a file being sent has the offset
it has reached. Renames and unlinks on the owner move or drop exactly the entries at and below
their path. Kept as a tree of path components, so each of those costs the depth of the path and
the entries it moves, not the size of the copy: while a follower copies 100,000 streams, every
rename (a meta file replaced, a stream deleted) runs under the mirror's lock that appends need.

Not thread-safe: the mirror calls it under its lock.
"""

from __future__ import annotations

import collections
import os


class Entry:
    """A path the copier still has work at, or a directory above one."""

    __slots__ = ("children", "name", "offset", "parent", "visit")

    def __init__(self, name: str, parent: Entry | None) -> None:
        self.name = name
        self.parent = parent
        self.children: dict[str, Entry] = {}
        self.visit = False  # named by a listing, not looked at yet
        self.offset: int | None = None  # a file being sent: the next offset


class CopyPlace:
    def __init__(self) -> None:
        self._root = Entry("", None)
        self._root.visit = True
        self._visits: collections.deque[Entry] = collections.deque([self._root])
        self._sends: collections.deque[Entry] = collections.deque()

    # ---- the copier --------------------------------------------------------------------------

    def next_visit(self) -> Entry | None:
        """The next entry to look at (the root first), taken off the queue; None: none left."""
        while self._visits:
            entry = self._visits.popleft()
            if entry.visit and self._attached(entry):
                entry.visit = False
                return entry
        return None

    def add_visits(self, directory: Entry, names: list[str]) -> None:
        """`directory` was listed: its entries are to be looked at, in this order."""
        for name in names:
            child = directory.children.get(name)
            if child is None:
                child = directory.children[name] = Entry(name, directory)
            if not child.visit:
                child.visit = True
                self._visits.append(child)

    def send_from_start(self, entry: Entry) -> None:
        """`entry` is a file: send it whole (again, if a rename had put a half-sent file there)."""
        if entry.offset is None:
            self._sends.append(entry)
        entry.offset = 0

    def next_send(self) -> Entry | None:
        """The file being sent (it stays first until `sent` says it is done); None: none left."""
        while self._sends:
            entry = self._sends[0]
            if entry.offset is not None and self._attached(entry):
                return entry
            self._sends.popleft()
        return None

    def sent(self, entry: Entry, offset: int | None) -> None:
        """`entry` is sent up to `offset`; None: all of it, or it is gone."""
        entry.offset = offset
        if offset is None:
            if self._sends and self._sends[0] is entry:
                self._sends.popleft()
            self.done(entry)

    def done(self, entry: Entry) -> None:
        """Nothing is left to do at `entry` itself: it and the directories above it that hold
        nothing else leave the tree."""
        while entry is not self._root and not entry.children and not entry.visit and entry.offset is None:
            parent = entry.parent
            self._detach(entry)
            if parent is None:
                return
            entry = parent

    def path(self, entry: Entry) -> str:
        """`entry`'s path relative to the data directory ("." for the root)."""
        parts = []
        while entry.parent is not None:
            parts.append(entry.name)
            entry = entry.parent
        return os.sep.join(reversed(parts)) if parts else "."

    # ---- changes the owner made --------------------------------------------------------------

    def forget(self, path: str) -> None:
        """`path` (a file, or a directory and everything below it) is gone or replaced."""
        entry = self._find(path)
        if entry is not None:
            parent = entry.parent
            self._detach(entry)
            if parent is not None:
                self.done(parent)

    def move(self, old: str, new: str) -> None:
        """`old` was renamed to `new`: what was left to do at and below it is done there."""
        self.forget(new)  # whatever the target replaced
        entry = self._find(old)
        if entry is None:
            return
        parent = entry.parent
        self._detach(entry)
        if parent is not None:
            self.done(parent)
        directory, name = os.path.split(new)
        target = self._make(directory)
        entry.name, entry.parent = name, target
        target.children[name] = entry

    # ---- the tree ----------------------------------------------------------------------------

    def _attached(self, entry: Entry) -> bool:
        while entry.parent is not None:
            if entry.parent.children.get(entry.name) is not entry:
                return False
            entry = entry.parent
        return entry is self._root

    def _detach(self, entry: Entry) -> None:
        parent = entry.parent
        if parent is not None and parent.children.get(entry.name) is entry:
            del parent.children[entry.name]
        entry.parent = None

    def _find(self, path: str) -> Entry | None:
        entry: Entry | None = self._root
        for part in path.split(os.sep):
            assert entry is not None
            entry = entry.children.get(part)
            if entry is None:
                return None
        return entry

    def _make(self, directory: str) -> Entry:
        entry = self._root
        if directory:
            for part in directory.split(os.sep):
                child = entry.children.get(part)
                if child is None:
                    child = entry.children[part] = Entry(part, entry)
                entry = child
        return entry


__all__ = ["CopyPlace", "Entry"]
