"""Who owns and who follows each member, decided in etcd (never by a consensus of our own).

Keys under the cluster's prefix (values are JSON):
- `replicas/<replica>`: `{member, http, replication, copy}`, put with the replica's lease. It exists
  exactly while the process renews the lease: etcd's lease expiry is the failure detector. `copy`
  is the session of the complete copy its directory holds (its marker's), "" for none.
- `members/<member>`: `{epoch, owner, follower, in_sync, session}`. Every change is one
  compare-and-set on the key's revision, so of two replicas racing to promote, one wins.

The rules, each one transaction:
- create: the first replica to start writes epoch 1 with replica `a` as the owner.
- in sync: the owner, once the follower's copy (session `session`) is complete and durable.
- alone: the owner, when its follower's channel breaks: `in_sync` false, so that copy can never be
  promoted; the owner then acknowledges on its own disk (an alert, `/stats`, a metric).
- promote: the follower, when the owner's `replicas/` key is gone (its lease expired) and the record
  says the follower's session is in sync: epoch + 1, owner and follower swapped, not in sync.
- hand over: a new process of the owner (it crashed and restarted, perhaps on an empty directory),
  while the follower is in sync and running with that copy (its key's `copy` is the record's
  session: a follower that lost its disk too runs, but holds nothing): the same swap, so the warm
  copy is served at once and the restarted one becomes the follower.

A replica's directory holds a marker (`replica.json`, never replicated) saying what it is a
complete copy of; a replica promotes or serves only a directory whose marker matches the record.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, overload

import trio

from streamkeep.coordination.etcd import Etcd, EtcdError, EtcdOutcomeUnknown
from streamkeep.replication.mirror import MARKER
from streamkeep.storage import files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Record:
    epoch: int
    owner: str
    follower: str
    in_sync: bool = False
    session: str = ""  # the follower's copy that is in sync (its connection's random id)
    served: bool = False  # an owner has served the member: an empty directory is a lost one
    revision: int = 0  # etcd's mod_revision of the key (0: not there)

    def encode(self) -> bytes:
        fields = asdict(self)
        del fields["revision"]
        return json.dumps(fields, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, revision: int) -> Record:
        fields = json.loads(data)
        return cls(
            epoch=int(fields["epoch"]),
            owner=str(fields["owner"]),
            follower=str(fields["follower"]),
            in_sync=bool(fields.get("in_sync", False)),
            session=str(fields.get("session", "")),
            # Written before `served` existed: any sign of a follower or a failover means served.
            served=bool(fields.get("served", int(fields["epoch"]) > 1 or bool(fields.get("session")))),
            revision=revision,
        )


def replica_ids(member: str) -> tuple[str, str]:
    """A member's two replicas: `<member>a` starts as the owner, `<member>b` as its follower."""
    return f"{member}a", f"{member}b"


def read_marker(data_dir: Path) -> dict[str, Any] | None:
    try:
        value = json.loads((data_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_marker(data_dir: Path, fields: dict[str, Any]) -> None:
    files.makedirs(files.OS, data_dir)
    files.replace(files.OS, data_dir, MARKER, json.dumps(fields, sort_keys=True).encode())


class Deposed(Exception):
    """Another replica owns the member now: this process must stop acknowledging at once."""


class Coordinator:
    """One replica's view of etcd: its lease, its member's record, the transactions above."""

    def __init__(
        self,
        etcd: Etcd,
        *,
        prefix: str,
        member: str,
        replica: str,
        http_address: str,
        replication_address: str,
        lease_ttl: int,
    ) -> None:
        first, second = replica_ids(member)
        if replica not in (first, second):
            raise ValueError(f"replica {replica!r} is not one of member {member}'s ({first}, {second})")
        self.etcd = etcd
        self.prefix = prefix.rstrip("/")
        self.member = member
        self.replica = replica
        self.other = second if replica == first else first
        self.first = first
        self.http_address = http_address
        self.replication_address = replication_address
        self.lease_ttl = lease_ttl
        self.lease = 0
        self.valid_until = 0.0  # trio.current_time() before which etcd cannot expire the lease
        self.promotions = 0
        self.transactions_lost = 0

    @property
    def member_key(self) -> str:
        return f"{self.prefix}/members/{self.member}"

    def replica_key(self, replica: str) -> str:
        return f"{self.prefix}/replicas/{replica}"

    # ---- the lease -----------------------------------------------------------------------------

    async def register(self, copy: str = "") -> None:
        """A fresh lease and this replica's key on it (replacing a dead process's); `copy`: the
        session of the complete copy the replica's directory holds ("" for none)."""
        sent = trio.current_time()
        self.lease = await self.etcd.grant_lease(self.lease_ttl)
        await self.announce(copy)
        self.valid_until = sent + self.lease_ttl

    async def announce(self, copy: str) -> None:
        """(Re)writes this replica's key, on its lease, saying which copy it holds now."""
        fields = {
            "member": self.member,
            "http": self.http_address,
            "replication": self.replication_address,
            "copy": copy,
        }
        await self.etcd.put(self.replica_key(self.replica), json.dumps(fields).encode(), lease=self.lease)

    async def keep_lease(self) -> None:
        """Renews the lease every sixth of its TTL until etcd says it is gone (then returns: another
        replica may be promoted). `valid_until` is when etcd may let it expire at the earliest: the
        send time of the last renewal that succeeded, plus the TTL."""
        said = False
        while True:
            await trio.sleep(self.lease_ttl / 6)
            sent = trio.current_time()
            try:
                remaining = await self.etcd.keepalive(self.lease)
            except EtcdError as error:
                if not said:
                    log.error("etcd: cannot renew this replica's lease: %s", error)
                    said = True
                continue
            if remaining <= 0:
                log.error("this replica's lease %x expired in etcd", self.lease)
                return
            said = False
            self.valid_until = sent + self.lease_ttl

    # ---- the member's record -------------------------------------------------------------------

    @overload
    async def record(self) -> Record: ...

    @overload
    async def record(self, *, create: bool) -> Record | None: ...

    async def record(self, *, create: bool = True) -> Record | None:
        """The member's record; if there is none yet, created (epoch 1, replica a owning), or None
        without `create`."""
        while True:
            found = await self.etcd.get(self.member_key)
            if found is not None:
                return Record.decode(found.value, found.mod_revision)
            if not create:
                return None
            initial = Record(epoch=1, owner=self.first, follower=replica_ids(self.member)[1])
            try:
                await self.etcd.compare_and_put(self.member_key, initial.encode(), mod_revision=0)
            except EtcdOutcomeUnknown:
                pass  # read it again either way

    async def renewing(self, replica: str, wait: float = 1.5) -> bool:
        """Whether the replica's process renews its lease now. Its key outlives a dead process
        until the lease runs out (up to the TTL): the lease's remaining time, read twice `wait`
        apart (etcd counts whole seconds), must not have gone down. A busy process may look dead
        (a caller then does the safe, slower thing), a dead one never looks alive."""
        found = await self.etcd.get(self.replica_key(replica))
        if found is None or not found.lease:
            return False
        first = await self.etcd.time_to_live(found.lease)
        await trio.sleep(wait)
        second = await self.etcd.time_to_live(found.lease)
        return second > 0 and second >= first

    async def alive(self, replica: str) -> dict[str, Any] | None:
        found = await self.etcd.get(self.replica_key(replica))
        return None if found is None else json.loads(found.value)

    async def _swap(self, record: Record, new: Record) -> Record | None:
        """One compare-and-set from `record` to `new`; the new record, or None if another won."""
        try:
            if await self.etcd.compare_and_put(self.member_key, new.encode(), mod_revision=record.revision):
                return await self.record()
        except EtcdOutcomeUnknown:
            again = await self.record()
            if replace(again, revision=0) == replace(new, revision=0):
                return again
        self.transactions_lost += 1
        return None

    async def promote(self, record: Record) -> Record | None:
        """The follower takes over at the next epoch (the owner's lease is gone)."""
        new = Record(epoch=record.epoch + 1, owner=self.replica, follower=record.owner, served=True)
        won = await self._swap(record, new)
        if won is not None:
            self.promotions += 1
            log.warning(
                "promoted: replica %s owns member %s at epoch %d (%s's lease expired)",
                self.replica,
                self.member,
                won.epoch,
                record.owner,
            )
        return won

    async def hand_over(self, record: Record) -> Record | None:
        """A new process of the owner (its directory lost, or it crashed and restarted): its
        in-sync follower takes over."""
        new = Record(epoch=record.epoch + 1, owner=record.follower, follower=self.replica, served=True)
        won = await self._swap(record, new)
        if won is not None:
            log.warning(
                "handed member %s to its in-sync follower %s at epoch %d (this process starts anew)",
                self.member,
                record.follower,
                won.epoch,
            )
        return won

    async def mark_served(self, epoch: int) -> Record:
        """The owner starts serving: from now on an empty directory of this member means data lost."""
        while True:
            record = await self.record()
            if record.owner != self.replica or record.epoch != epoch:
                raise Deposed(f"member {self.member} is owned by {record.owner} at epoch {record.epoch}")
            if record.served:
                return record
            won = await self._swap(record, replace(record, served=True))
            if won is not None:
                return won

    async def mark(self, epoch: int, *, in_sync: bool, session: str = "") -> Record:
        """The owner records its follower's state. Raises Deposed if it no longer owns at `epoch`."""
        while True:
            record = await self.record()
            if record.owner != self.replica or record.epoch != epoch:
                raise Deposed(f"member {self.member} is owned by {record.owner} at epoch {record.epoch}")
            if record.in_sync == in_sync and (not in_sync or record.session == session):
                return record
            won = await self._swap(
                record, replace(record, in_sync=in_sync, session=session if in_sync else "")
            )
            if won is not None:
                return won


def marker_for(member: str, epoch: int, session: str = "") -> dict[str, Any]:
    return {"member": member, "epoch": epoch, "session": session, "pid": os.getpid()}
