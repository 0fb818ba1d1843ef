"""What storage can fail with, and the one place those failures become protocol errors.

Storage raises three things: `StorageFull` (a configured byte cap), `StorageUnavailable` (the disk
or the cold tier could not do it: full, I/O error, S3 down; nothing of the operation happened) and
`StreamDeleted` (the stream went away while the operation was on its way). Actors and the service
turn them into answers with `as_protocol_error`, so every path gives the same status, code and
`Retry-After` for the same cause.
"""

from __future__ import annotations

import errno

from streamkeep.protocol import offsets
from streamkeep.protocol.errors import ProtocolError, not_found
from streamkeep.storage.files import NotDurable

RETRY_AFTER = [("Retry-After", "1")]
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class StorageFull(Exception):
    """An append would pass a byte cap; `per_stream` tells which one."""

    def __init__(self, message: str, *, per_stream: bool) -> None:
        super().__init__(message)
        self.per_stream = per_stream


class StorageUnavailable(Exception):
    """The write or read failed and nothing of it happened. `status` is 503 (retry shortly) or 507
    (the disk is full: appends resume once space is freed).

    With `happened`, the change was made but could not be made durable (a directory fsync kept
    failing after a create or delete was renamed into place): the server goes on as if it was
    done, and says so, since a power cut may still take it back."""

    def __init__(self, message: str, *, status: int, happened: bool = False, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.happened = happened
        # A stable name for the cause, for clients and the torture checker (messages may change):
        # storage_full, storage_unavailable, not_durable, read_only, cold_tier_unavailable,
        # cold_backlog.
        self.code = code or ("storage_full" if status == 507 else "storage_unavailable")


class StreamDeleted(Exception):
    """The stream was deleted while this operation was on its way (it is answered 404)."""


class RetainedAway(Exception):
    """The data asked for was dropped by retention (before or while the read ran): 410 with the
    earliest offset a reader can resume from."""

    def __init__(self, floor: int, incarnation: int) -> None:
        super().__init__(f"retained away below position {floor}")
        self.floor = floor
        self.incarnation = incarnation


EARLIEST_OFFSET_HEADER = "Stream-Earliest-Offset"


def below_floor(floor: int, incarnation: int) -> ProtocolError:
    """410 for an offset before what the stream keeps, naming where a reader can resume."""
    earliest = offsets.encode(floor, incarnation)
    return ProtocolError(
        410,
        "offset_before_floor",
        f"the data at that offset was dropped by the stream's retention; the earliest offset kept is "
        f"{earliest} (also in {EARLIEST_OFFSET_HEADER}): read from there or from offset=-1, after "
        "clearing any state built from what came before",
        [(EARLIEST_OFFSET_HEADER, earliest)],
    )


def is_disk_full(error: OSError) -> bool:
    return error.errno in _FULL_ERRNOS


def not_durable(what: str, error: OSError) -> StorageUnavailable:
    return StorageUnavailable(
        f"{what} was done, but could not be made durable ({error.strerror or error}): a power loss "
        "may still undo it; check with HEAD before repeating it",
        status=503,
        happened=True,
        code="not_durable",
    )


def from_os_error(error: OSError, what: str) -> StorageUnavailable:
    if isinstance(error, NotDurable):
        return not_durable(what, error)
    if is_disk_full(error):
        return StorageUnavailable(
            f"{what}: the disk is full; appends resume by themselves once space is freed "
            "(delete streams, let the cold tier move segments out, or add capacity)",
            status=507,
        )
    return StorageUnavailable(f"{what}: {error.strerror or error}; retry shortly", status=503)


def below_reserve(what: str, free: int, reserve: int) -> StorageUnavailable:
    return StorageUnavailable(
        f"{what}: the disk has {free} bytes free, less than the {reserve} bytes kept in reserve "
        "(--min-free-bytes) for metadata; appends resume by themselves once space is freed",
        status=507,
    )


def as_protocol_error(
    error: StorageFull | StorageUnavailable | StreamDeleted | RetainedAway, name: str
) -> ProtocolError:
    if isinstance(error, StreamDeleted):
        return not_found(name)
    if isinstance(error, RetainedAway):
        return below_floor(error.floor, error.incarnation)
    if isinstance(error, StorageFull):
        if error.per_stream:
            return ProtocolError(413, "stream_too_large", str(error))
        return ProtocolError(507, "storage_full", f"{error}; delete streams or raise the cap", RETRY_AFTER)
    return ProtocolError(error.status, error.code, str(error), RETRY_AFTER)


STORAGE_ERRORS = (StorageFull, StorageUnavailable, StreamDeleted, RetainedAway)
