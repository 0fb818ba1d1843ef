"""Memory storage: streams live in this process and end with it. For tests and ephemeral use."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import replace

from streamkeep.protocol.stream import ProducerState, StreamMeta
from streamkeep.storage.base import AppendRecord, ByteBudget, Commit, ReadResult, RemoteSources, resolved


class MemoryLog:
    """Accepted and published state are the same here: an append is published as it is accepted."""

    def __init__(self, budget: ByteBudget, meta: StreamMeta) -> None:
        self._budget = budget
        self.meta = meta
        self.producers: dict[str, ProducerState] = {}
        self.on_publish: Callable[[], None] | None = None
        self._messages: list[bytes] = []
        # _ends[i] is the position just past message i; positions are cumulative stored bytes,
        # starting at the fork base (0 for streams that are not forks).
        self._ends: list[int] = []
        self._append_ends: list[int] = []
        self._base = meta.fork_base
        self.floor = 0  # retention runs on disk storage only

    @property
    def tail(self) -> int:
        return self._ends[-1] if self._ends else self._base

    published_tail = tail

    @property
    def published_closed(self) -> bool:
        return self.meta.closed

    pending = 0

    @property
    def record_count(self) -> int:
        """Appends that added messages (the admin API's `appends`)."""
        return len(self._append_ends)

    def tier_bytes(self) -> dict[str, int]:
        return {"hot": self.tail - self._base, "cold": 0}

    def next_append_end(self, position: int) -> int | None:
        index = bisect_right(self._append_ends, position)
        return self._append_ends[index] if index < len(self._append_ends) else None

    def is_boundary(self, position: int) -> bool:
        if position == self._base or position == self.tail:
            return True
        index = bisect_right(self._ends, position) - 1
        return index >= 0 and self._ends[index] == position

    async def read(self, start: int, max_bytes: int, *, whole_messages: bool) -> ReadResult:
        index = bisect_right(self._ends, start)
        if index >= len(self._messages):
            return ReadResult([], self.tail)
        begin = self._ends[index - 1] if index else self._base
        first = self._messages[index]
        if start > begin:  # inside a byte-stream message: serve its remainder
            first = first[start - begin :]
        if not whole_messages and len(first) > max_bytes:
            # Byte streams have no boundaries to keep, so a huge append is paged like any bytes.
            return ReadResult([first[:max_bytes]], start + max_bytes)
        out = [first]
        size = len(first)
        position = self._ends[index]
        index += 1
        while index < len(self._messages) and size + len(self._messages[index]) <= max_bytes:
            out.append(self._messages[index])
            size += len(self._messages[index])
            position = self._ends[index]
            index += 1
        return ReadResult(out, position)

    def add(self, messages: list[bytes]) -> int:
        self._budget.reserve(self.tail - self._base, sum(len(m) for m in messages))
        position = self.tail
        for message in messages:
            position += len(message)
            self._messages.append(message)
            self._ends.append(position)
        if messages:
            self._append_ends.append(position)
        return position

    def submit(self, record: AppendRecord) -> Commit:
        tail = self.add(record.messages)
        self.meta = record.meta  # a fresh copy made for this append
        if record.producer is not None:
            self.producers[record.producer[0]] = record.producer[1]
        if self.on_publish is not None:
            self.on_publish()
        return resolved(tail)

    def latest_commit(self) -> Commit:
        return resolved(self.tail)

    async def make_durable(self) -> None:
        """Nothing outlives the process here."""


class MemoryStorage:
    def __init__(self, *, max_stream_bytes: int, max_total_bytes: int) -> None:
        self.budget = ByteBudget(max_stream_bytes=max_stream_bytes, max_total_bytes=max_total_bytes)
        self._logs: dict[str, MemoryLog] = {}
        self.remote: RemoteSources | None = None

    def open(self, name: str) -> MemoryLog | None:
        return self._logs.get(name)

    async def recovered(self) -> None:
        """Nothing to read at start: memory storage begins empty."""

    def still_reading(self) -> Exception:  # never asked for: `recovered` returns at once
        return RuntimeError("memory storage has nothing to read at start")

    async def create(self, meta: StreamMeta, messages: list[bytes]) -> MemoryLog:
        log = MemoryLog(self.budget, replace(meta))
        log.add(messages)
        self._logs[meta.name] = log
        return log

    async def delete(self, name: str) -> None:
        log = self._logs.pop(name, None)
        if log is not None:
            self.budget.release(log.tail - log.meta.fork_base)

    async def save_meta(self, name: str, meta: StreamMeta) -> None:
        """Nothing to persist: the log holds the same meta object."""

    def names(self) -> list[str]:
        return list(self._logs)

    def logs(self) -> list[MemoryLog]:
        return list(self._logs.values())

    def unread(self) -> int:
        return 0

    def idle(self, name: str) -> None:
        stream_log = self._logs.get(name)
        if stream_log is not None:
            stream_log.on_publish = None
