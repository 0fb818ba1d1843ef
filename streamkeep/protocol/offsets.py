"""Offsets: one token per byte position, fixed width so string order is stream order.

A position is the count of stored bytes before it. The token is that count as 16 lower-case hex
digits, so `-1`/`now` can never be minted and two tokens never name the same position.
"""

from __future__ import annotations

import re

from streamkeep.protocol.errors import bad_request

WIDTH = 16
MAX_POSITION = (1 << 64) - 1
BEGINNING = "-1"
NOW = "now"
_TOKEN = re.compile(r"[0-9a-f]{16}")


def encode(position: int) -> str:
    return f"{position:016x}"


def decode(token: str) -> int:
    """The position of a server-minted token; 400 for anything else."""
    if not _TOKEN.fullmatch(token):
        raise bad_request(
            "invalid_offset",
            f"offset {token[:80]!r} is not an offset this server issued; use -1, now, "
            "or a Stream-Next-Offset value",
        )
    return int(token, 16)


def parse_query_offset(values: list[str]) -> str | int | None:
    """The `offset` query parameter: None when absent, BEGINNING/NOW sentinels, or a position."""
    if not values:
        return None
    if len(values) > 1:
        raise bad_request("invalid_offset", "give the offset parameter once")
    token = values[0]
    if token == "":
        raise bad_request("invalid_offset", "the offset parameter is empty; use -1 for the beginning")
    if token in (BEGINNING, NOW):
        return token
    return decode(token)
