"""Where a stream's files live under a data directory (docs/segment-format.md, "Layout")."""

from __future__ import annotations

import hashlib
from urllib.parse import quote

FORMAT_FILE = "FORMAT"
FORMAT_LINE = "streamkeep-segments 1\n"
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


def segment_filename(start: int) -> str:
    """Named by the position of its first byte, as the 16 decimal digits that end an offset."""
    return f"{start:016d}{SEGMENT_SUFFIX}"


def segment_start(filename: str) -> int:
    return int(filename.removesuffix(SEGMENT_SUFFIX))
