"""The bucket: blocking calls to an S3-compatible object store, and the cold tier's settings.

boto3, run in worker threads by its callers, because it does multipart uploads, retries with
backoff and timeouts by itself and works against MinIO and moto unchanged (the `minio` SDK worked
here too; boto3 is the one most users already configure through the standard AWS_* variables).
`ObjectStore` is what the archiver and the migration need; the deterministic simulation
(ops/torture) supplies an in-memory one with faults.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol
from urllib.parse import urlsplit

from streamkeep.segments import layout
from streamkeep.storage.files import FileSystem


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

    @classmethod
    def from_settings(cls, settings: Any) -> ColdConfig | None:
        """From loaded settings (streamkeep.config); None when no cold tier is configured."""
        options = settings.cold
        if not options.url:
            return None
        return cls.from_url(
            options.url,
            endpoint=options.endpoint or None,
            region=options.region or None,
            create_bucket=options.create_bucket,
            keep_local=options.keep_local,
            high_water_bytes=options.high_water_bytes,
            cache_bytes=options.cache_bytes,
            transfers=options.transfers,
        )

    @property
    def root(self) -> str:
        return layout.cold_root(self.prefix)

    def key(self, stream_dir: str, stream_id: str, segment_file: str) -> str:
        return layout.cold_key(self.prefix, stream_dir, stream_id, segment_file)


class ObjectStore(Protocol):
    config: ColdConfig

    def ensure_bucket(self) -> None: ...

    def upload(self, reader: BinaryIO, key: str, size: int, sha256: str) -> None:
        """Stores `size` bytes from `reader` under `key` with the `sha256` metadata, then verifies
        size and digest with a HEAD; raises if anything does not match."""
        ...

    def head(self, key: str) -> tuple[int, str | None] | None:
        """(size, sha256 metadata) of an object, or None if there is none."""
        ...

    def get_range(self, key: str, start: int, length: int) -> bytes: ...

    def delete(self, keys: list[str]) -> list[str]:
        """Deletes objects (absent ones count as deleted); returns the keys that failed."""
        ...

    def list_objects(self, prefix: str) -> list[tuple[str, float]]:
        """(key, last-modified as seconds since the epoch) of every object under `prefix`."""
        ...

    def copy(self, source: str, target: str) -> None:
        """Copies an object with its metadata."""
        ...


class S3Store:
    """The real bucket, through boto3."""

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

    def upload(self, reader: BinaryIO, key: str, size: int, sha256: str) -> None:
        from boto3.s3.transfer import TransferConfig

        def put() -> None:
            reader.seek(0)
            self.client.upload_fileobj(
                reader,
                self.config.bucket,
                key,
                ExtraArgs={"Metadata": {"sha256": sha256}},
                Config=TransferConfig(
                    multipart_threshold=16 << 20, multipart_chunksize=8 << 20, max_concurrency=2
                ),
            )

        try:
            put()
        except Exception as error:  # S3UploadFailedError or ClientError, depending on the path taken
            if "NoSuchBucket" not in str(error) or not self.config.create_bucket:
                raise
            self.ensure_bucket()  # the bucket vanished (a fresh MinIO, a wiped stand-in): recreate it once
            put()
        found = self.head(key)
        if found is None or found != (size, sha256):
            raise OSError(f"object {key} does not match what was uploaded (size or sha256): {found}")

    def head(self, key: str) -> tuple[int, str | None] | None:
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.config.bucket, Key=key)
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return head["ContentLength"], head.get("Metadata", {}).get("sha256")

    def get_range(self, key: str, start: int, length: int) -> bytes:
        response = self.client.get_object(
            Bucket=self.config.bucket, Key=key, Range=f"bytes={start}-{start + length - 1}"
        )
        data = response["Body"].read()
        if len(data) != length:
            raise OSError(f"short read from {key}: {len(data)} of {length} bytes")
        return data

    def delete(self, keys: list[str]) -> list[str]:
        failed: list[str] = []
        for begin in range(0, len(keys), 1000):
            chunk = keys[begin : begin + 1000]
            response = self.client.delete_objects(
                Bucket=self.config.bucket, Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True}
            )
            # DeleteObjects answers 200 even when some keys fail; those are listed in Errors.
            failed.extend(
                error["Key"] for error in response.get("Errors", []) if error.get("Code") != "NoSuchKey"
            )
        return failed

    def list_objects(self, prefix: str) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.config.bucket, Prefix=prefix
        ):
            out.extend((item["Key"], item["LastModified"].timestamp()) for item in page.get("Contents", []))
        return out

    def copy(self, source: str, target: str) -> None:
        self.client.copy({"Bucket": self.config.bucket, "Key": source}, self.config.bucket, target)


class UploadAbandoned(Exception):
    """An upload stopped because nobody wants the object any more (its stream was deleted)."""


class UploadBody(io.RawIOBase):
    """A sealed segment's bytes as the seekable reader boto3 uploads from. The archiver reads the
    segment whole and closes its file before the upload, so nothing here holds a descriptor."""

    def __init__(self, data: bytes, wanted: Callable[[], bool] = lambda: True) -> None:
        self._data, self._at = memoryview(data), 0
        # Asked before every read: an upload whose stream was deleted stops at its next read (boto3
        # reads the body at the start of each attempt) instead of sending bytes nobody wants.
        self._wanted = wanted

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._data)}[whence]
        self._at = max(0, base + offset)
        return self._at

    def readinto(self, buffer: Any) -> int:
        if not self._wanted():
            raise UploadAbandoned("the stream was deleted during its upload")
        chunk = self._data[self._at : self._at + len(buffer)]
        buffer[: len(chunk)] = chunk
        self._at += len(chunk)
        return len(chunk)


def read_whole(fs: FileSystem, fd: int, size: int) -> bytes:
    """The first `size` bytes of a file, read through its descriptor."""
    parts = []
    at = 0
    while at < size:
        block = fs.pread(fd, min(8 << 20, size - at), at)
        if not block:
            raise OSError(f"file shrank while reading it ({at} of {size} bytes)")
        parts.append(block)
        at += len(block)
    return b"".join(parts)


def put_bytes(store: ObjectStore, key: str, data: bytes) -> None:
    """A small object from memory (a description or an index sidecar), verified like any upload."""
    store.upload(io.BytesIO(data), key, len(data), hashlib.sha256(data).hexdigest())


def get_whole(store: ObjectStore, key: str) -> bytes | None:
    """A small object's bytes, or None if there is none."""
    found = store.head(key)
    if found is None:
        return None
    size, sha256 = found
    data = store.get_range(key, 0, size) if size else b""
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise OSError(f"object {key} does not match its sha256 metadata")
    return data
