"""Offsets: one token per byte position of one incarnation of a stream, fixed width so string
order is stream order.

A position is the count of stored bytes before it. The token is two groups of 16 decimal digits:
`<incarnation>_<position>`. The incarnation is a number fixed when the stream is created (derived
from its stream id), so a stream deleted and created again under the same name mints different
tokens: a client resuming with a token of the deleted stream is told so (410) instead of reading
the new stream's bytes at a position that meant something else, and a catch-up response an HTTP
cache kept for the old stream is never the answer to a request the new one's tokens make.

An incarnation of all zeros means "whichever incarnation this is": the shape every token had before
incarnations (clients may have stored them) and the one clients and the conformance suite write by
hand for the beginning, `0000000000000000_0000000000000000`. `-1`/`now` can never be minted.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from streamkeep.protocol.errors import bad_request

WIDTH = 16
ANY_INCARNATION = 0
MAX_POSITION = 10**WIDTH - 1
BEGINNING = "-1"
NOW = "now"
_TOKEN = re.compile(r"[0-9]{16}_[0-9]{16}")


@dataclass(frozen=True, slots=True)
class Offset:
    incarnation: int  # ANY_INCARNATION (0) for hand-written and pre-incarnation tokens
    position: int


def incarnation_of(stream_id: str) -> int:
    """The incarnation number of a stream id: its hex value (ids are 12 hex digits), else a hash;
    never 0, which means "any". Computed each time (~0.2 us): a cache keyed by stream id grows with
    every stream ever created, which a soak under churn showed as RSS creeping up."""
    try:
        number = int(stream_id, 16) % 10**WIDTH
    except ValueError:
        number = int.from_bytes(hashlib.sha256(stream_id.encode()).digest()[:8], "big") % 10**WIDTH
    return number or 1


def encode(position: int, incarnation: int = ANY_INCARNATION) -> str:
    return f"{incarnation:016d}_{position:016d}"


def decode(token: str) -> Offset:
    """The incarnation and position of a token; 400 for anything that is not one."""
    if not _TOKEN.fullmatch(token):
        raise bad_request(
            "invalid_offset",
            f"offset {token[:80]!r} is not an offset this server issued; use -1, now, "
            "or a Stream-Next-Offset value",
        )
    return Offset(int(token[:WIDTH]), int(token[WIDTH + 1 :]))


def parse_query_offset(values: list[str]) -> str | Offset | None:
    """The `offset` query parameter: None when absent, BEGINNING/NOW sentinels, or an Offset."""
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
