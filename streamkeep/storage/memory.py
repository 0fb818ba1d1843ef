"""Memory storage: streams live in this process and end with it. For tests and ephemeral use."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import replace

from streamkeep.protocol.stream import ProducerState, StreamMeta
from streamkeep.storage.base import ReadResult, StorageFull


class MemoryLog:
    def __init__(self, store: MemoryStorage, meta: StreamMeta) -> None:
        self._store = store
        self.meta = meta
        self.producers: dict[str, ProducerState] = {}
        self._messages: list[bytes] = []
        # _ends[i] is the position just past message i; positions are cumulative stored bytes.
        self._ends: list[int] = []

    @property
    def tail(self) -> int:
        return self._ends[-1] if self._ends else 0

    def is_boundary(self, position: int) -> bool:
        if position == 0 or position == self.tail:
            return True
        index = bisect_right(self._ends, position) - 1
        return index >= 0 and self._ends[index] == position

    def read(self, start: int, max_bytes: int, *, whole_messages: bool) -> ReadResult:
        index = bisect_right(self._ends, start)
        if index >= len(self._messages):
            return ReadResult([], self.tail)
        begin = self._ends[index - 1] if index else 0
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

    async def append(
        self,
        messages: list[bytes],
        meta: StreamMeta,
        producer: tuple[str, ProducerState] | None,
    ) -> int:
        added = sum(len(m) for m in messages)
        self._store.reserve(self.tail, added)
        position = self.tail
        for message in messages:
            position += len(message)
            self._messages.append(message)
            self._ends.append(position)
        self.meta = replace(meta)
        if producer is not None:
            self.producers[producer[0]] = producer[1]
        return position

    async def save_meta(self, meta: StreamMeta) -> None:
        self.meta = replace(meta)


class MemoryStorage:
    def __init__(self, *, max_stream_bytes: int, max_total_bytes: int) -> None:
        self.max_stream_bytes = max_stream_bytes
        self.max_total_bytes = max_total_bytes
        self.total_bytes = 0
        self._logs: dict[str, MemoryLog] = {}

    def reserve(self, stream_bytes: int, added: int) -> None:
        if stream_bytes + added > self.max_stream_bytes:
            raise StorageFull(
                f"the stream would pass its cap of {self.max_stream_bytes} bytes", per_stream=True
            )
        if self.total_bytes + added > self.max_total_bytes:
            raise StorageFull(
                f"the server would pass its memory cap of {self.max_total_bytes} bytes",
                per_stream=False,
            )
        self.total_bytes += added

    def open(self, name: str) -> MemoryLog | None:
        return self._logs.get(name)

    async def create(self, meta: StreamMeta, messages: list[bytes]) -> MemoryLog:
        log = MemoryLog(self, replace(meta))
        await log.append(messages, meta, None)
        self._logs[meta.name] = log
        return log

    async def delete(self, name: str) -> None:
        log = self._logs.pop(name, None)
        if log is not None:
            self.total_bytes -= log.tail

    def names(self) -> list[str]:
        return list(self._logs)
