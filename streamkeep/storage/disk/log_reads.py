"""Reads of a stream on disk: published records found in the index, their payloads from the
tail cache, the segment files or the bucket. They take no lock (log_state.py says why that is
safe) and never serve bytes of a stream deleted or retained away while they ran."""

from __future__ import annotations

from streamkeep.storage import files
from streamkeep.storage.base import ReadResult
from streamkeep.storage.disk.index import Entry, Segment
from streamkeep.storage.disk.log_state import LogState
from streamkeep.storage.errors import RetainedAway, StorageUnavailable, StreamDeleted, from_os_error


class LogReads(LogState):
    """`read` of the `StreamLog` interface (storage/base.py), for a stream on disk."""

    __slots__ = ()

    async def read(self, start: int, max_bytes: int, *, whole_messages: bool) -> ReadResult:
        tail = self._pub_tail
        if start >= tail:
            return ReadResult([], tail)
        index = self.index
        entries = index.entries
        first = index.find(start)
        if first < 0 or start < self.held_from:
            raise RetainedAway(self.floor, self.meta.incarnation)
        last = first + 1
        size = entries[first].length
        while last < len(entries) and size + entries[last].length <= max_bytes:
            size += entries[last].length
            last += 1
        # Taken before any await: retention may drop a prefix of the index meanwhile.
        chosen = entries[first:last]
        payloads = await self._payloads(chosen, index.dropped + first)
        messages: list[bytes] = []
        end = chosen[-1].end
        if whole_messages:
            for entry, payload in zip(chosen, payloads, strict=True):
                at, cut = entry.start, 0
                # A close-only append holds no message (a JSON value is never empty).
                for length in entry.messages or ([len(payload)] if payload else []):
                    if at >= start:
                        messages.append(payload[cut : cut + length])
                    at += length
                    cut += length
            return ReadResult(messages, end)
        head = payloads[0][start - chosen[0].start :]
        if len(head) > max_bytes:
            return ReadResult([head[:max_bytes]], start + max_bytes)
        return ReadResult([head, *payloads[1:]], end)

    async def _payloads(self, entries: list[Entry], first_key: int) -> list[bytes]:
        """The payloads of `entries`, whose first has tail-cache key `first_key`."""
        found: dict[int, bytes] = {}
        missing: dict[int, list[int]] = {}
        cache = self._cache
        for number, entry in enumerate(entries):
            cached = cache.get(first_key + number) if cache is not None else None
            if cached is not None:
                found[number] = cached
            else:
                missing.setdefault(id(entry.segment), []).append(number)
        for numbers in missing.values():
            head, tail = entries[numbers[0]], entries[numbers[-1]]
            begin = head.payload_at
            data = await self._read_segment(head.segment, begin, tail.payload_at + tail.length - begin)
            for number in numbers:
                at = entries[number].payload_at - begin
                found[number] = data[at : at + entries[number].length]
        return [found[number] for number in range(len(entries))]

    async def _read_segment(self, segment: Segment, begin: int, length: int) -> bytes:
        storage = self.host
        what = f"read of {self.meta.name!r}"
        if segment.local:
            try:
                data = await storage.run_io(files.pread_exact, storage.fs, segment.path, begin, length)
            except FileNotFoundError:
                # A delete may have moved the files away and not yet said so (it sets `deleted`
                # when its file work returns): a stream deleted meanwhile is a 404, not a 503.
                if self.deleting is not None:
                    await self.deleting.wait()
                if self.deleted:
                    raise StreamDeleted() from None
                if segment.retained_away:
                    raise RetainedAway(self.floor, self.meta.incarnation) from None
                if segment.cold_key is None:
                    raise StorageUnavailable(
                        f"{what}: segment file {segment.path.name} is missing", status=503
                    ) from None
                # It moved to the bucket while this read was on its way: read it there.
            except OSError as error:
                if self.deleted:
                    raise StreamDeleted() from None
                raise from_os_error(error, what) from None
            else:
                if self.deleted:
                    # The path may already hold a new stream's file of the same name: never serve it.
                    raise StreamDeleted()
                return data
        if storage.cold is None or segment.cold_key is None:
            raise StorageUnavailable(
                f"{segment.path.name} of {self.meta.name!r} is in the cold tier, which is off",
                status=503,
                code="cold_tier_unavailable",
            )
        try:
            return await storage.cold.read(segment.cold_key, begin, length)
        except Exception as error:  # S3 down, timeouts, missing objects: never wrong or partial data
            if segment.retained_away:
                raise RetainedAway(self.floor, self.meta.incarnation) from None
            if self.deleted:
                # Deleted while this read was on its way: its objects go once the delete is
                # durable (DiskStorage.delete), so a missing object is the delete, not the bucket.
                raise StreamDeleted() from None
            raise StorageUnavailable(
                f"the cold tier could not serve {self.meta.name!r}: {error}; retry shortly",
                status=503,
                code="cold_tier_unavailable",
            ) from None
