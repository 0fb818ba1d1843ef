"""Where a stream's files live under a data directory and in the bucket (docs/segment-format.md)."""

from __future__ import annotations

import hashlib
from urllib.parse import quote, unquote

FORMAT_FILE = "FORMAT"
FORMAT_VERSION = 2
FORMAT_PREFIX = "streamkeep-segments "
FORMAT_LINE = f"{FORMAT_PREFIX}{FORMAT_VERSION}\n"
STREAMS = "streams"
TRASH = "trash"
META = "meta.cbor"
SEGMENT_SUFFIX = ".seg"
_MAX_DIRNAME = 200


def stream_dirname(name: str) -> str:
    """A file name for a stream: percent-encoded (so '/' and '.' segments cannot nest or climb), or
    '~' plus a SHA-256 when that would be too long for a file system. meta.cbor holds the name."""
    encoded = quote(name, safe="-_").replace(".", "%2E")
    if len(encoded) <= _MAX_DIRNAME:
        return encoded
    return "~" + hashlib.sha256(name.encode()).hexdigest()


def stream_name(dirname: str) -> str | None:
    """The stream a directory of `stream_dirname` holds, when its name says (None: a hashed long
    name, which only its meta.cbor tells). Recovery checks it against the meta it reads."""
    if dirname.startswith("~"):
        return None
    return unquote(dirname)


def segment_filename(start: int) -> str:
    """Named by the position of its first byte, as the 16 decimal digits that end an offset."""
    return f"{start:016d}{SEGMENT_SUFFIX}"


def segment_start(filename: str) -> int:
    return int(filename.removesuffix(SEGMENT_SUFFIX))


def cold_root(prefix: str) -> str:
    """`PREFIX/streams/` (or `streams/` without a prefix): every segment object lives below it."""
    return f"{prefix}/{STREAMS}/" if prefix else f"{STREAMS}/"


def cold_key(prefix: str, stream_dir: str, stream_id: str, segment_file: str) -> str:
    """Format 2: `PREFIX/streams/<stream dir>/<stream id>/<segment file>`. The stream id names the
    incarnation, so a stream deleted and created again never shares an object with its predecessor."""
    return f"{cold_root(prefix)}{stream_dir}/{stream_id}/{segment_file}"


def v1_cold_key(key: str) -> str:
    """The format-1 key of the same segment (`.../<stream dir>/<segment file>`, no incarnation)."""
    head, _, file = key.rpartition("/")
    return f"{head.rpartition('/')[0]}/{file}"


def parse_cold_key(root: str, key: str) -> tuple[str, str | None, str] | None:
    """(stream dir, stream id or None for format 1, segment file) of a key under `root`."""
    if not key.startswith(root) or not key.endswith(SEGMENT_SUFFIX):
        return None
    parts = key[len(root) :].split("/")
    if len(parts) == 2:
        return parts[0], None, parts[1]
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    return None
