"""`SimS3`: an in-memory, S3-like object store for the cold tier, with the failures a real one has.

Its calls are blocking, like boto3's: the cold tier runs them through `trio.to_thread.run_sync`,
which the simulation replaces with `SimThreads.run_sync` (ops/torture/simthreads.py).

Faults, all seeded and replayable:
- `down = True`: every call raises `SimS3Error("EndpointConnectionError")`, as botocore does when
  nothing answers;
- `delay = seconds`: every call takes that much mock time (`simthreads.charge`); it must then run
  inside `SimThreads.run_sync`;
- `wipe()`: every object and the bucket are gone (a fresh MinIO); calls raise `NoSuchBucket`
  until `create_bucket()`;
- `fail_rate` / `force_failure(op)`: a call fails with `InternalError`. A failed `put` may still
  have stored the object, and a failed `delete` may still have deleted some keys, as with a
  request whose response was lost;
- `delete_fail_rate`: `delete` succeeds but reports some keys as failed (the `Errors` of S3's
  DeleteObjects), and those keys stay.

Calls are appended to `trace` (share the file system's list to get one trace for a whole run).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

from ops.torture import simthreads

T = TypeVar("T")

OPS = ("head_bucket", "create_bucket", "put", "head", "get_range", "delete", "list")


class SimS3Error(Exception):
    """What boto3 would raise; `code` is S3's error code or botocore's exception name."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code


class SimS3:
    def __init__(self, rng: random.Random, trace: list[str] | None = None) -> None:
        self.rng = rng
        self.trace: list[str] = [] if trace is None else trace
        self.objects: dict[str, tuple[bytes, dict[str, str]]] = {}
        self.bucket = True
        self.down = False
        self.delay = 0.0
        self.fail_rate = 0.0
        self.delete_fail_rate = 0.0
        self.forced: list[str | None] = []

    # ---- faults -------------------------------------------------------------------------------

    def wipe(self) -> None:
        self.objects.clear()
        self.bucket = False
        self.trace.append("s3 wipe")

    def force_failure(self, op: str | None = None) -> None:
        """The next call of `op` (of any operation, if None) fails with InternalError."""
        if op is not None and op not in OPS:
            raise ValueError(f"unknown operation {op!r}")
        self.forced.append(op)

    # ---- the store --------------------------------------------------------------------------------

    def head_bucket(self) -> None:
        self._call("head_bucket", "", lambda: None)

    def create_bucket(self) -> None:
        def create() -> None:
            self.bucket = True

        self._call("create_bucket", "", create, needs_bucket=False)

    def put(self, key: str, data: bytes, metadata: dict[str, str] | None = None) -> None:
        def store() -> None:
            self.objects[key] = (bytes(data), dict(metadata or {}))

        self._call("put", f"{key} <{len(data)}B {zlib.crc32(data):08x}>", store, ambiguous=store)

    def head(self, key: str) -> tuple[int, dict[str, str]]:
        def head() -> tuple[int, dict[str, str]]:
            data, metadata = self._object(key)
            return len(data), dict(metadata)

        return self._call("head", key, head)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Like a GET with `Range: bytes=start-(start+length-1)`: clipped at the object's end."""

        def get() -> bytes:
            data, _ = self._object(key)
            if start >= len(data) or length <= 0:
                raise SimS3Error("InvalidRange", f"{key} has {len(data)} bytes")
            return data[start : start + length]

        return self._call("get_range", f"{key} {start}+{length}", get)

    def delete(self, keys: list[str]) -> list[str]:
        """Deletes `keys` (missing ones count as deleted); returns the keys that failed."""

        def delete() -> list[str]:
            failed = [
                key for key in keys if self.delete_fail_rate and self.rng.random() < self.delete_fail_rate
            ]
            for key in keys:
                if key not in failed:
                    self.objects.pop(key, None)
            return failed

        def some() -> None:
            for key in keys:
                if self.rng.random() < 0.5:
                    self.objects.pop(key, None)

        return self._call("delete", f"{len(keys)} keys", delete, ambiguous=some)

    def list(self, prefix: str = "") -> list[str]:
        return self._call(
            "list", prefix, lambda: sorted(key for key in self.objects if key.startswith(prefix))
        )

    # ---- internals ------------------------------------------------------------------------------

    def _object(self, key: str) -> tuple[bytes, dict[str, str]]:
        found = self.objects.get(key)
        if found is None:
            raise SimS3Error("NoSuchKey", key)
        return found

    def _call(
        self,
        op: str,
        shown: str,
        work: Callable[[], T],
        needs_bucket: bool = True,
        ambiguous: Callable[[], Any] | None = None,
    ) -> T:
        line = f"s3 {op} {shown}".rstrip()
        try:
            if self.delay:
                simthreads.charge(self.delay)
            if self.down:
                raise SimS3Error("EndpointConnectionError", "could not connect to the endpoint URL")
            if needs_bucket and not self.bucket:
                raise SimS3Error("NoSuchBucket", "the bucket does not exist")
            if self._fails(op):
                # The request failed, but maybe after the store acted on it (a lost response).
                if ambiguous is not None and self.rng.random() < 0.5:
                    ambiguous()
                    line += " [acted]"
                raise SimS3Error("InternalError", "we encountered an internal error, please try again")
            result = work()
        except SimS3Error as error:
            self.trace.append(f"{line} -> {error.code}")
            raise
        self.trace.append(f"{line} -> {_show(result)}")
        return result

    def _fails(self, op: str) -> bool:
        for index, wanted in enumerate(self.forced):
            if wanted in (None, op):
                del self.forced[index]
                return True
        return bool(self.fail_rate) and self.rng.random() < self.fail_rate


def _show(result: Any) -> str:
    if isinstance(result, bytes):
        return f"<{len(result)}B {zlib.crc32(result):08x}>"
    return repr(result)
