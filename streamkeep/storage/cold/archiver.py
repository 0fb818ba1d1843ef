"""The archiver: moves sealed segments to the bucket, serves cold reads, deletes dead objects.

Rotation has one source of truth, each stream's manifest (`cold.cbor`): a sealed segment is read
whole from a descriptor opened under the stream's I/O lock (so a delete or re-create cannot swap
the file underneath) and closed before the upload (no descriptor waits on the bucket), uploaded,
verified with HEAD (size and the SHA-256 stored as object metadata), recorded in the manifest
after its index sidecar, and only then is the local copy deleted. A crash
before the manifest write re-uploads the same key; after it, recovery finds the manifest entry.
The sidecar goes to the bucket too, and each stream's description (describe.py) whenever it
changes, so the bucket alone can rebuild the data directory (`streamkeep restore --from-bucket`).
Object keys carry the stream's incarnation, so nothing done for a deleted stream can touch the
objects of a stream created later under the same name.

It is a background task that never ends the server: a failing bucket or disk is retried with
backoff per stream, logged once per cause, and counted for /stats. Sealed bytes waiting past
`high_water_bytes` make appends answer 503 instead of filling the disk.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from streamkeep.background import Backoff
from streamkeep.health import Health
from streamkeep.segments.floor import FLOOR_FILE
from streamkeep.segments.manifest import encode_index
from streamkeep.storage import files
from streamkeep.storage.cold import describe
from streamkeep.storage.cold.bookkeeping import drop_local, read_sealed, record_upload
from streamkeep.storage.cold.store import ColdConfig, ObjectStore, UploadBody, put_bytes
from streamkeep.storage.disk.index import Segment
from streamkeep.storage.disk.log import DiskLog
from streamkeep.storage.disk.meta import encode_meta
from streamkeep.storage.disk.storage import DiskStorage
from streamkeep.storage.files import FileSystem

log = logging.getLogger(__name__)

PASS_INTERVAL = 1.0
MAX_BACKOFF = 60.0
# A failed step backs its stream off (the count is per stream), as failed deletes back off all deletes.
STEP_RETRY = Backoff(1.0, MAX_BACKOFF)
# Descriptions written per pass at most: after a start every stream's is written once, and that must
# not hold back the next pass's uploads for long.
DESCRIBE_BATCH = 256


class RangeCache:
    """Recently fetched cold ranges, bounded in bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._items: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()

    def get(self, key: tuple[str, int, int]) -> bytes | None:
        data = self._items.get(key)
        if data is not None:
            self._items.move_to_end(key)
        return data

    def put(self, key: tuple[str, int, int], data: bytes) -> None:
        if len(data) > self.limit:
            return
        self._items[key] = data
        self.size += len(data)
        while self.size > self.limit:
            _, dropped = self._items.popitem(last=False)
            self.size -= len(dropped)


class Archiver:
    """The cold tier (streamkeep.storage.disk.tiering.ColdTier) of one disk storage."""

    def __init__(
        self,
        storage: DiskStorage,
        store: ObjectStore,
        config: ColdConfig,
        *,
        run_sync: Callable[..., Awaitable[Any]] | None = None,
    ) -> None:
        self.storage = storage
        self.store = store
        self.config = config
        self.cache = RangeCache(config.cache_bytes)
        self.backlog_bytes = 0
        self.uploaded = 0
        self._run_sync = run_sync or trio.to_thread.run_sync
        self._limiter = trio.CapacityLimiter(config.transfers)
        self._doomed: list[tuple[Path | None, list[str]]] = []  # objects of deleted streams
        self._retry_at: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self._delete_failures = 0
        self._delete_retry_at = 0.0
        self._wake = trio.Event()
        # Each stream's description as last written (its key -> what it said), and the keys of the
        # streams gone since, to delete (describe.py).
        self._described: dict[str, tuple] = {}
        self.health = Health()

    async def io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._run_sync(fn, *args, limiter=self._limiter)

    # ---- ColdTier ---------------------------------------------------------------------

    def sealed(self) -> None:
        self._wake.set()

    def appends_blocked(self) -> str | None:
        if self.backlog_bytes <= self.config.high_water_bytes:
            return None
        return (
            f"{self.backlog_bytes} bytes of sealed segments are waiting for the cold tier "
            f"(more than --cold-high-water-bytes {self.config.high_water_bytes}; is S3 reachable?); retry shortly"
        )

    async def read(self, key: str, start: int, length: int) -> bytes:
        cache_key = (key, start, length)
        data = self.cache.get(cache_key)
        if data is None:
            data = await self.io(self.store.get_range, key, start, length)
            self.cache.put(cache_key, data)
        return data

    def forget(self, pending: Path | None, keys: list[str]) -> None:
        # `pending` is a deleted stream's list: its description goes too. Without one (retention
        # dropping segments, an upload that lost its stream), only the segments' sidecars.
        self._doomed.append((pending, self._with_companions(keys, stream_gone=pending is not None)))
        self._wake.set()

    def _with_companions(self, keys: list[str], *, stream_gone: bool) -> list[str]:
        return [*keys, *describe.companions(self.config.prefix, keys, stream_gone=stream_gone)]

    # ---- the loop ---------------------------------------------------------------------

    async def run(self) -> None:
        await self.storage.recovered()  # its passes go over every stream
        try:
            await self.io(self.store.ensure_bucket)
        except Exception as error:
            self.health.failed(
                "cold tier bucket", f"{error}; segments stay local and uploads will be retried"
            )
        try:
            pending = await self.storage.run_io(self.storage.pending_object_deletes)
            self._doomed.extend(
                (path, self._with_companions(keys, stream_gone=True)) for path, keys in pending
            )
        except OSError as error:
            self.health.failed("cold tier deletes", f"cannot read the objects left to delete: {error}")
        delay = PASS_INTERVAL
        crashing = Backoff(2 * PASS_INTERVAL, MAX_BACKOFF, jitter=0)  # passes that crash: ever slower
        while True:
            try:
                await self.pass_once()
            except Exception as error:  # a bug or an unforeseen failure: log it once, back off, go on
                self.health.failed("cold tier pass", f"{error!r}; retrying with backoff", traceback=error)
                delay = crashing.failed()
            else:
                self.health.ok("cold tier pass")
                crashing.reset()
                delay = PASS_INTERVAL
            self._wake = trio.Event()
            with trio.move_on_after(delay):
                await self._wake.wait()

    async def pass_once(self) -> None:
        storage = self.storage
        if storage.segment_max_age:
            now_ms = time.time() * 1000
            for stream_log in storage.logs():
                if stream_log.should_seal(now_ms, storage.segment_max_age):
                    await self._guarded(stream_log, "sealing", stream_log.seal_idle)
        self.backlog_bytes = sum(
            segment.size
            for stream_log in storage.logs()
            for segment in stream_log.segments[:-1]
            if segment.cold_key is None and segment.local
        )
        for stream_log in storage.logs():
            for segment in list(stream_log.segments[:-1]):
                if stream_log.deleted or self._backing_off(stream_log):
                    break
                if segment.cold_key is None:
                    await self._guarded(stream_log, "upload", self.archive, stream_log, segment)
                elif segment.local and not self.config.keep_local:
                    await self._guarded(stream_log, "local drop", drop_local, stream_log, segment)
        await self._describe()
        await self._delete_doomed()

    def _backing_off(self, stream_log: DiskLog) -> bool:
        return trio.current_time() < self._retry_at.get(stream_log.meta.name, 0.0)

    async def _guarded(
        self, stream_log: DiskLog, step: str, fn: Callable[..., Awaitable[Any]], *args: Any
    ) -> None:
        """One step for one stream; a failure backs that stream off (1-60 s, jittered) and keeps
        its hot copy. Logged once per kind of step until one succeeds again (an outage fails
        every stream: one line, not one per stream)."""
        name = stream_log.meta.name
        kind = f"cold tier {step}"
        try:
            await fn(*args)
        except Exception as error:  # S3 or disk trouble
            failures = self._failures.get(name, 0) + 1
            self._failures[name] = failures
            delay = STEP_RETRY.delay(failures)
            self._retry_at[name] = trio.current_time() + delay
            self.health.failed(kind, f"{name}: {error}; retrying with backoff")
        else:
            self.health.ok(kind)
            if self._failures.pop(name, None) is not None:
                self._retry_at.pop(name, None)

    async def archive(self, stream_log: DiskLog, segment: Segment) -> None:
        # Read whole and closed before anything goes to the bucket: a descriptor held through
        # boto3's waits (a frozen bucket: 30 s a try, then retries) would pin a deleted stream's blocks.
        data = await read_sealed(stream_log, segment)
        if data is None:
            return
        size = len(data)
        stream_dir, stream_id = stream_log.directory.name, stream_log.meta.stream_id
        key = self.config.key(stream_dir, stream_id, segment.path.name)
        index_key = describe.index_object_key(self.config.prefix, stream_dir, stream_id, segment.path.name)
        try:
            sha256, index = await self.io(_digest_and_index, data, segment.path.name)
            body = UploadBody(data, wanted=lambda: not stream_log.deleted)
            await self.io(self.store.upload, body, key, size, sha256)
            # Its sidecar, kept locally as well: the bucket alone then holds what recovery reads.
            await self.io(put_bytes, self.store, index_key, index)
        except Exception:
            if not stream_log.deleted:
                raise
            self.forget(None, [key])  # deleted meanwhile: whatever reached the bucket is an orphan
            return
        entry = {
            "file": segment.path.name,
            "start": segment.start,
            "size": size,
            "sha256": sha256,
            "key": key,
        }
        if not await record_upload(stream_log, segment, entry, index):
            self.forget(None, [key])  # the stream was deleted while its segment was uploading
            return
        self.uploaded += 1
        self.backlog_bytes = max(0, self.backlog_bytes - size)  # appends may resume at once
        log.info("cold tier: %s/%s uploaded (%d bytes)", stream_log.meta.name, segment.path.name, size)
        if not self.config.keep_local:
            await drop_local(stream_log, segment)

    # ---- descriptions (describe.py) -----------------------------------------------------------

    async def _describe(self) -> None:
        """Writes the description of every stream whose description changed (a few hundred per
        pass), and deletes those of streams gone since."""
        live: set[str] = set()
        stale: list[tuple[DiskLog, str, tuple]] = []
        for number, stream_log in enumerate(self.storage.logs(), 1):
            if number % 5000 == 0:
                await trio.lowlevel.checkpoint()  # a microsecond or two a stream: let requests in between
            if stream_log.deleted:
                continue
            key = describe.stream_object_key(
                self.config.prefix, stream_log.directory.name, stream_log.meta.stream_id
            )
            live.add(key)
            mark = _fingerprint(stream_log)
            if self._described.get(key) != mark and not self._backing_off(stream_log):
                stale.append((stream_log, key, mark))
        gone = [key for key in self._described if key not in live]
        for key in gone:
            del self._described[key]
        if gone:
            self._doomed.append((None, gone))
        if not stale:
            return

        async def one(stream_log: DiskLog, key: str, mark: tuple, nursery: trio.Nursery) -> None:
            await self._guarded(stream_log, "description", self._write_description, stream_log, key, mark)
            if stream_log.meta.name in self._failures:
                nursery.cancel_scope.cancel()  # the bucket is likely down: the rest waits for a later pass

        async with trio.open_nursery() as nursery:
            for stream_log, key, mark in stale[:DESCRIBE_BATCH]:
                nursery.start_soon(one, stream_log, key, mark, nursery)

    async def _write_description(self, stream_log: DiskLog, key: str, mark: tuple) -> None:
        fs = self.storage.fs
        async with stream_log.exclusive():  # floor.cbor and the manifest as one state
            if stream_log.deleted:
                return
            floor = await self.storage.run_io(_read_if_there, fs, stream_log.directory / FLOOR_FILE)
            description = describe.StreamObject(
                meta=encode_meta(stream_log.meta),
                floor=floor,
                segments=list(stream_log.cold_entries),
                close=mark[-1],
            )
        await self.io(put_bytes, self.store, key, description.encode())
        self._described[key] = mark  # deleted meanwhile: the next pass finds it gone and deletes it

    async def _delete_doomed(self) -> None:
        if not self._doomed or trio.current_time() < self._delete_retry_at:
            return
        doomed, self._doomed = self._doomed, []
        for pending, keys in doomed:
            try:
                failed = await self.io(self.store.delete, keys)
            except Exception as error:
                self._doomed.append((pending, keys))
                self._back_off_deletes()
                self.health.failed("cold tier deletes", f"deleting {len(keys)} objects: {error}; will retry")
                continue
            if failed:
                self._doomed.append((pending, failed))
                self._back_off_deletes()
                self.health.failed(
                    "cold tier deletes", f"{len(failed)} objects could not be deleted; will retry"
                )
                if pending is not None:
                    await self.storage.run_io(self.storage.directory.update_pending, pending, failed)
                continue
            self.health.ok("cold tier deletes")
            self._delete_failures = 0
            if pending is not None:
                await self.storage.run_io(self.storage.directory.objects_deleted, pending)

    def _back_off_deletes(self) -> None:
        self._delete_failures += 1
        delay = STEP_RETRY.delay(self._delete_failures)
        self._delete_retry_at = trio.current_time() + delay

    def stats(self) -> dict:
        return {
            "backlog_bytes": self.backlog_bytes,
            "uploaded_segments": self.uploaded,
            "objects_to_delete": sum(len(keys) for _, keys in self._doomed),
            "described_streams": len(self._described),
            "streams_backing_off": sorted(n for n, t in self._retry_at.items() if t > trio.current_time()),
            **self.health.stats(),
        }


def _digest_and_index(data: bytes, name: str) -> tuple[str, bytes]:
    """A sealed segment's SHA-256 (hex) and its index sidecar."""
    return hashlib.sha256(data).hexdigest(), encode_index(data, name)


def _read_if_there(fs: FileSystem, path: Path) -> bytes | None:
    return files.read_file(fs, path) if fs.exists(path) else None


def _fingerprint(stream_log: DiskLog) -> tuple:
    """What a stream's description says, in short: when it changes, the description is written."""
    meta = stream_log.meta
    entries = stream_log.cold_entries
    return (
        len(entries),
        entries[0]["key"] if entries else None,
        entries[-1]["key"] if entries else None,
        stream_log.floor,
        meta.soft_deleted,
        meta.remote_forks,
        meta.fork_low,
        meta.source_incarnations,
        _close_after_uploads(stream_log),  # last: _write_description takes it from here
    )


def _close_after_uploads(stream_log: DiskLog) -> describe.Close | None:
    """The stream's close, when nothing but it follows the last uploaded byte: it sits in a segment
    with no bytes, which is never sealed, so only the description can carry it to the bucket."""
    if not stream_log.published_closed or not stream_log.segments:
        return None
    segments = stream_log.segments
    uploaded = [i for i, segment in enumerate(segments) if segment.cold_key is not None]
    if not uploaded:
        end = segments[0].start
    elif uploaded[-1] + 1 < len(segments):
        end = segments[uploaded[-1] + 1].start
    else:
        return None
    if stream_log.published_tail != end:
        return None
    closed_by = stream_log.meta.closed_by
    return describe.Close(
        end,
        None if closed_by is None else (closed_by.producer_id, closed_by.epoch, closed_by.seq),
        stream_log.active_segment.last_ms or 0,
    )
