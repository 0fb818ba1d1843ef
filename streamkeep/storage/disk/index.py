"""Where each published record of a stream lives, and a small cache of the newest payloads.

One entry per append record: its first stream position, its payload length, its segment, where
its payload starts in that segment's file, and its message lengths when it holds more than one
message (a JSON array append). Positions are contiguous, so a position's record is found by
bisecting the entries' starts. Pure bookkeeping: no I/O.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from streamkeep.segments import layout


@dataclass(slots=True, eq=False)
class Segment:
    """One segment file of a stream (docs/segment-format.md). Compared by identity.

    It keeps its stream's directory as the string every segment of the stream and its log share,
    not a `Path` of its own: a `Path` per segment and one per stream cost ~450 B per idle stream
    (issue 26), and its file name follows from `start`."""

    start: int
    directory: str
    size: int  # bytes written and published
    appends: int = 0  # append records in it
    cold_key: str | None = None  # its object in the bucket, once uploaded and verified
    local: bool = True  # False once the local copy is gone: reads go to the bucket
    first_ms: int | None = None  # append time of its first record: the segment's age
    last_ms: int | None = None  # append time of its last record: when retention by age may drop it
    retained_away: bool = False  # dropped by retention: a read that still holds it answers 410
    last_record_at: int | None = None  # where its last append record starts in the file

    @property
    def path(self) -> Path:
        return Path(self.directory, layout.segment_filename(self.start))

    @property
    def file(self) -> str:
        """`path` as a string, for the writer's opens: a tenth of the cost of a `Path` (0.2 against
        2.2 µs), paid in a commit round's worker thread, with the GIL, once per woken stream."""
        return self.directory + os.sep + layout.segment_filename(self.start)


@dataclass(slots=True, eq=False)
class Entry:
    start: int
    length: int
    segment: Segment
    payload_at: int
    messages: list[int] | None  # message lengths, when the record holds more than one

    @property
    def end(self) -> int:
        return self.start + self.length


_NO_STARTS: list[int] = []
_NO_ENTRIES: list[Entry] = []


class RecordIndex:
    """The published records in position order. Retention drops a prefix; `dropped` counts the
    entries gone before `entries[0]`, so `dropped + i` names a record for its whole life (the
    tail cache's keys) however many go before it."""

    __slots__ = ("_starts", "dropped", "entries")

    def __init__(self) -> None:
        # Until the first record, the lists every empty index shares (two empty lists cost an
        # idle stream that was only created 112 B); only `add` grows them, and it makes new ones.
        self._starts: list[int] = _NO_STARTS  # a plain list beside the entries, for bisect
        self.entries: list[Entry] = _NO_ENTRIES
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.entries)

    def drop_before(self, position: int) -> int:
        """Forgets the records that end at or before `position`; returns how many went."""
        count = bisect_right(self._starts, position)
        while count and self.entries[count - 1].end > position:
            count -= 1
        if count:
            del self._starts[:count]
            del self.entries[:count]
            self.dropped += count
        return count

    def add(self, entry: Entry) -> None:
        if not self.entries:
            self._starts, self.entries = [entry.start], [entry]
            return
        self._starts.append(entry.start)
        self.entries.append(entry)

    def find(self, position: int) -> int:
        """The index of the record holding `position`, or -1 before the first."""
        return bisect_right(self._starts, position) - 1

    def record_end(self, position: int, tail: int) -> int | None:
        """Where the record holding `position` ends, or None at or past `tail`."""
        index = self.find(position)
        if index < 0 or position >= tail:
            return None
        return self.entries[index].end

    def is_boundary(self, position: int, base: int, tail: int) -> bool:
        """Whether a message starts at `position` (the base and the tail always count)."""
        if position in (base, tail):
            return True
        index = self.find(position)
        if index < 0 or position > tail:
            return False
        entry = self.entries[index]
        at = entry.start
        if at == position:
            return True
        for length in entry.messages or ():
            at += length
            if at == position:
                return True
        return False


class TailCache:
    """The payloads of the newest records, by record index, bounded in bytes: live readers and
    catch-ups near the tail are served without touching the disk."""

    __slots__ = ("_bytes", "_items", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: OrderedDict[int, bytes] = OrderedDict()
        self._bytes = 0

    def get(self, index: int) -> bytes | None:
        return self._items.get(index)

    def put(self, index: int, payload: bytes) -> None:
        if len(payload) > self.limit:
            return
        self._items[index] = payload
        self._bytes += len(payload)
        while self._bytes > self.limit:
            _, dropped = self._items.popitem(last=False)
            self._bytes -= len(dropped)
