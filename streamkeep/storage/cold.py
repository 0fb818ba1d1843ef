"""The cold tier: sealed segments move to an S3-compatible bucket; reads fetch ranges back.

boto3, in trio worker threads under a CapacityLimiter of `transfers`, because it does multipart
uploads, retries with backoff and timeouts by itself and works against MinIO and moto unchanged
(the `minio` SDK worked here too; boto3 is the one most users already configure through the
standard AWS_* variables).

Rotation has one source of truth, the per-stream manifest (`cold.cbor`): a sealed segment is
uploaded, verified with HEAD (size and the SHA-256 we store as object metadata), recorded in the
manifest, given a local index sidecar (`<segment>.idx`, the record headers), and only then is the
local copy deleted. A crash before the manifest write re-uploads the same key; after it, recovery
finds the manifest entry and finishes the deletion.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import cbor2
import trio

from streamkeep.segments import format as fmt
from streamkeep.segments import layout
from streamkeep.storage import files

if TYPE_CHECKING:
    from streamkeep.storage.disk import DiskLog, DiskStorage, Segment

log = logging.getLogger(__name__)

MANIFEST = "cold.cbor"
INDEX_SUFFIX = ".idx"


@dataclass(frozen=True)
class ColdConfig:
    bucket: str
    prefix: str
    endpoint: str | None
    region: str | None
    create_bucket: bool = False
    keep_local: bool = False
    high_water_bytes: int = 8 << 30
    cache_bytes: int = 64 << 20
    transfers: int = 4

    @classmethod
    def from_url(cls, url: str, **options: Any) -> ColdConfig:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError("expected s3://BUCKET or s3://BUCKET/PREFIX")
        return cls(parts.netloc, parts.path.strip("/"), **options)

    def key(self, stream_dirname: str, segment_file: str) -> str:
        """PREFIX/streams/<stream dir>/<segment file> (docs/segment-format.md, "Cold tier")."""
        parts = [self.prefix] if self.prefix else []
        return "/".join([*parts, layout.STREAMS, stream_dirname, segment_file])


class ColdStore:
    """Blocking S3 calls; `DiskStorage.cold_io` runs them in worker threads."""

    def __init__(self, config: ColdConfig) -> None:
        import boto3
        from botocore.config import Config

        self.config = config
        self.client = boto3.client(
            "s3",
            endpoint_url=config.endpoint or os.environ.get("AWS_ENDPOINT_URL") or None,
            region_name=config.region or os.environ.get("AWS_REGION") or "us-east-1",
            config=Config(
                retries={"max_attempts": 3, "mode": "standard"},
                connect_timeout=5,
                read_timeout=30,
                max_pool_connections=max(10, config.transfers * 2),
            ),
        )

    def ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.config.bucket)
        except ClientError as error:
            if not self.config.create_bucket:
                raise RuntimeError(
                    f"bucket {self.config.bucket!r} is not reachable ({error}); create it or pass --cold-create-bucket"
                ) from None
            self.client.create_bucket(Bucket=self.config.bucket)

    def upload(self, path: Path, key: str) -> tuple[int, str]:
        """Uploads (multipart when large) and verifies with HEAD; returns (size, sha256)."""
        from boto3.s3.transfer import TransferConfig

        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        sha256 = digest.hexdigest()
        size = path.stat().st_size
        from boto3.exceptions import S3UploadFailedError

        def put() -> None:
            self.client.upload_file(
                str(path),
                self.config.bucket,
                key,
                ExtraArgs={"Metadata": {"sha256": sha256}},
                Config=TransferConfig(
                    multipart_threshold=16 << 20, multipart_chunksize=8 << 20, max_concurrency=2
                ),
            )

        try:
            put()
        except S3UploadFailedError as error:
            if "NoSuchBucket" not in str(error) or not self.config.create_bucket:
                raise
            self.ensure_bucket()  # the bucket vanished (a fresh MinIO, a wiped stand-in): recreate it once
            put()
        self.verify(key, size, sha256)
        return size, sha256

    def verify(self, key: str, size: int, sha256: str) -> None:
        head = self.client.head_object(Bucket=self.config.bucket, Key=key)
        if head["ContentLength"] != size or head.get("Metadata", {}).get("sha256") != sha256:
            raise OSError(f"object {key} does not match what was uploaded (size or sha256)")

    def get_range(self, key: str, start: int, length: int) -> bytes:
        response = self.client.get_object(
            Bucket=self.config.bucket, Key=key, Range=f"bytes={start}-{start + length - 1}"
        )
        data = response["Body"].read()
        if len(data) != length:
            raise OSError(f"short read from {key}: {len(data)} of {length} bytes")
        return data

    def delete(self, keys: list[str]) -> None:
        for begin in range(0, len(keys), 1000):
            chunk = [{"Key": key} for key in keys[begin : begin + 1000]]
            self.client.delete_objects(Bucket=self.config.bucket, Delete={"Objects": chunk, "Quiet": True})

    def list_keys(self, prefix: str) -> list[str]:
        keys: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.config.bucket, Prefix=prefix
        ):
            keys.extend(item["Key"] for item in page.get("Contents", []))
        return keys


def load_manifest(directory: Path) -> list[dict]:
    path = directory / MANIFEST
    if not path.exists():
        return []
    return list(cbor2.loads(path.read_bytes())["segments"])


def save_manifest(directory: Path, entries: list[dict]) -> None:
    files.replace(files.OS, directory, MANIFEST, cbor2.dumps({"v": 1, "segments": entries}))


def write_index(path: Path) -> list[dict]:
    """The record headers of a segment file, saved beside it so recovery never needs the object."""
    records, _valid, reason = fmt.scan(path.read_bytes(), keep_payload=False)
    if reason is not None:
        raise OSError(f"sealed segment {path.name} is damaged: {reason}")
    index = [{"h": r.header, "at": r.payload_offset, "n": r.payload_len} for r in records[1:]]
    files.replace(files.OS, path.parent, path.name + INDEX_SUFFIX, cbor2.dumps({"v": 1, "records": index}))
    return index


def read_index(path: Path) -> list[fmt.Record]:
    raw = cbor2.loads((path.parent / (path.name + INDEX_SUFFIX)).read_bytes())
    return [fmt.Record(fmt.KIND_APPEND, item["h"], 0, item["at"], item["n"], None) for item in raw["records"]]


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
    """Moves sealed segments to the bucket, retrying with backoff while S3 fails."""

    def __init__(self, storage: DiskStorage, store: ColdStore) -> None:
        self.storage = storage
        self.store = store
        self.config = store.config
        self.cache = RangeCache(self.config.cache_bytes)
        self.backlog_bytes = 0
        self._limiter = trio.CapacityLimiter(self.config.transfers)
        self._doomed: list[str] = []  # objects of deleted streams, still to delete
        self._retry_at: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self._wake = trio.Event()

    async def io(self, fn: Any, *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    def kick(self) -> None:
        self._wake.set()

    def forget(self, keys: list[str]) -> None:
        self._doomed.extend(keys)
        self.kick()

    async def read(self, key: str, start: int, length: int) -> bytes:
        cache_key = (key, start, length)
        data = self.cache.get(cache_key)
        if data is None:
            data = await self.io(self.store.get_range, key, start, length)
            self.cache.put(cache_key, data)
        return data

    async def run(self) -> None:
        try:
            await self.io(self.store.ensure_bucket)
        except Exception as error:
            log.error("cold tier: %s; segments stay local and uploads will be retried", error)
        while True:
            await self.pass_once()
            self._wake = trio.Event()
            with trio.move_on_after(1.0):
                await self._wake.wait()

    async def pass_once(self) -> None:
        max_age = self.storage.segment_max_age
        if max_age:
            now_ms = time.time() * 1000
            for stream_log in list(self.storage.logs()):
                active = stream_log.segments[-1]
                if active.first_ms is not None and now_ms - active.first_ms >= max_age * 1000:
                    await stream_log.seal_idle()
        backlog = 0
        for stream_log in list(self.storage.logs()):
            for segment in stream_log.segments[:-1]:
                if segment.cold_key is None and segment.local:
                    backlog += segment.size
        self.backlog_bytes = backlog
        for stream_log in list(self.storage.logs()):
            name = stream_log.meta.name
            if stream_log.deleted or trio.current_time() < self._retry_at.get(name, 0):
                continue
            for segment in list(stream_log.segments[:-1]):
                if stream_log.deleted:
                    break
                try:
                    if segment.cold_key is None:
                        await self.archive(stream_log, segment)
                    elif segment.local and not self.config.keep_local:
                        await self.drop_local(stream_log, segment)
                except Exception as error:  # S3 or disk trouble: keep the hot copy, retry later
                    failures = self._failures.get(name, 0) + 1
                    self._failures[name] = failures
                    delay = min(60.0, 2 ** (failures - 1)) * random.uniform(0.8, 1.2)
                    self._retry_at[name] = trio.current_time() + delay
                    log.warning(
                        "cold tier: %s/%s: %s; retrying in %.1f s", name, segment.path.name, error, delay
                    )
                    break
            else:
                self._failures.pop(name, None)
        if self._doomed:
            doomed, self._doomed = self._doomed, []
            try:
                await self.io(self.store.delete, doomed)
            except Exception as error:
                self._doomed.extend(doomed)
                log.warning("cold tier: deleting %d objects failed (%s); will retry", len(doomed), error)

    async def archive(self, stream_log: DiskLog, segment: Segment) -> None:
        key = self.config.key(stream_log.directory.name, segment.path.name)
        size, sha256 = await self.io(self.store.upload, segment.path, key)
        await self.io(write_index, segment.path)
        entry = {
            "file": segment.path.name,
            "start": segment.start,
            "size": size,
            "sha256": sha256,
            "key": key,
        }
        entries = [*stream_log.cold_entries, entry]
        await self.io(save_manifest, stream_log.directory, entries)
        stream_log.cold_entries = entries
        segment.cold_key = key
        self.backlog_bytes = max(0, self.backlog_bytes - size)  # appends may resume at once
        log.info("cold tier: %s/%s uploaded (%d bytes)", stream_log.meta.name, segment.path.name, size)
        if not self.config.keep_local:
            await self.drop_local(stream_log, segment)

    async def drop_local(self, stream_log: DiskLog, segment: Segment) -> None:
        segment.local = False  # reads go to the bucket from now on
        await self.io(_unlink_quietly, segment.path)


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
