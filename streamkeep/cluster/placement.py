"""Which member of a cluster owns a stream: a pure function of its name and the member list.

A stream's path is hashed to one of 4,096 slots (`crc32(path) mod 4096`, the same arithmetic as
HAProxy's `path,crc32,mod(4096)`, so the load balancer and the processes agree without talking),
and each slot belongs to the member that wins a rendezvous hash for it. Adding a member moves only
the slots it wins (about 1/N of them); nothing moves implicitly when a member is down: its slots
answer 503 until it is back. The `epoch` names one version of the member list; members refuse
requests stamped with another (a stale map must never make two owners of one stream).

No I/O here: the load balancer's configuration (`haproxy.py`) and the request path both read it.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from urllib.parse import quote

from streamkeep.protocol.names import STREAM_PREFIX

SLOTS = 4096
# What `quote` leaves as is in a canonical path: unreserved characters, sub-delims, ':' '@' and the
# '/' between name segments (RFC 3986 pchar), the way clients and our own Location headers write them.
_PATH_SAFE = "/-._~!$&'()*+,;=:@"


@dataclass(frozen=True)
class Member:
    id: str
    address: str  # host:port the other members and the load balancer reach it at


@dataclass(frozen=True)
class Placement:
    members: tuple[Member, ...]
    epoch: int
    owners: tuple[int, ...]  # slot -> index into members

    @classmethod
    def of(cls, members: list[Member] | tuple[Member, ...], epoch: int) -> Placement:
        ids = [member.id for member in members]
        if not members:
            raise ValueError("a cluster needs at least one member")
        if len(set(ids)) != len(ids):
            raise ValueError(f"member ids must be unique: {ids}")
        if epoch < 1:
            raise ValueError("the placement epoch starts at 1")
        owners = tuple(max(range(len(members)), key=lambda i: _score(ids[i], slot)) for slot in range(SLOTS))
        return cls(tuple(members), epoch, owners)

    def member(self, member_id: str) -> Member:
        for member in self.members:
            if member.id == member_id:
                return member
        raise KeyError(member_id)

    def owner(self, name: str) -> Member:
        """The member that owns the stream named `name` (a decoded, canonical name)."""
        return self.members[self.owners[slot(canonical_path(name))]]

    def owner_of_slot(self, slot_number: int) -> Member:
        return self.members[self.owners[slot_number]]

    def slots_of(self, member_id: str) -> int:
        index = [member.id for member in self.members].index(member_id)
        return sum(1 for owner in self.owners if owner == index)


def canonical_path(name: str) -> str:
    """The path clients normally send for `name`; the load balancer hashes what it receives, and a
    request it hashed differently (another percent-encoding) reaches a member that hands it on."""
    return STREAM_PREFIX + quote(name, safe=_PATH_SAFE)


def slot(path: str) -> int:
    """The slot of a path as sent, query excluded (HAProxy's `path,crc32,mod(4096)`)."""
    return zlib.crc32(path.encode("utf-8", "surrogateescape")) % SLOTS


def _score(member_id: str, slot_number: int) -> int:
    digest = hashlib.blake2b(f"{member_id}\0{slot_number}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
