"""Offsets: one token per byte position, fixed width so string order is stream order.

A position is the count of stored bytes before it. The token is `0000000000000000_` followed by
that count as 16 decimal digits: the shape the Node reference server uses, which clients and the
conformance suite have come to write by hand for "the beginning". The first half is reserved and
must be all zeros, so `-1`/`now` can never be minted and no position has a second valid token.
"""

from __future__ import annotations

import re

from streamkeep.protocol.errors import bad_request

WIDTH = 16
RESERVED = "0" * WIDTH
MAX_POSITION = 10**WIDTH - 1
BEGINNING = "-1"
NOW = "now"
_TOKEN = re.compile(r"0{16}_[0-9]{16}")


def encode(position: int) -> str:
    return f"{RESERVED}_{position:016d}"


def decode(token: str) -> int:
    """The position of a server-minted token; 400 for anything else."""
    if not _TOKEN.fullmatch(token):
        raise bad_request(
            "invalid_offset",
            f"offset {token[:80]!r} is not an offset this server issued; use -1, now, "
            "or a Stream-Next-Offset value",
        )
    return int(token[WIDTH + 1 :])


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
