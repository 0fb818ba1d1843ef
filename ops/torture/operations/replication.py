"""What a replicated cluster run (ops/torture/replicated.py) observes of the replicas themselves,
besides the clients' answers, and how it is judged.

- `replica_roles`: a sample, every half second, of each replica's `/stats` `replication` section
  (only an owner listens for HTTP, so a replica that answers is one that serves) and of etcd's
  member records (`/streamkeep/members/<member>`). The body is
  {"replicas": {replica: {"member", "role", "epoch", "follower_in_sync"} | null},
   "records": {member: {"epoch", "owner", ...}}}. Judged: for each member and epoch, one owner
  only, over the whole run, whether seen serving or written in etcd ("two-owners"); a member's
  epoch in etcd never goes back ("epoch-back"). This is what can be observed from outside of "no
  two owners acknowledge for one stream in one epoch": a replica cannot be asked which appends it
  acknowledged. Its consequence is judged by the model on every read: two histories would show as
  different bytes at one offset of an incarnation (a conflict in `ByteMap`: offsets are stable for
  the whole run) or as an acknowledged append missing at the end.
- `replicas_in_sync`: at the end, after every fault is healed, whether each member's owner says
  its follower is in sync (body {member: bool}) within the wait; a member that never gets its
  second copy back is a finding.
- `replicas_identical`: then, once quiet, each member's two data directories compared byte for
  byte (the marker `replica.json` excepted: it says what each is a copy of). Body {member:
  {"owner", "follower", "differ": [paths, at most 20], "files": n}}.
"""

from __future__ import annotations

import json
from typing import Any

from ops.torture.history import OpEnded, OpStarted
from ops.torture.model import Model
from ops.torture.operations.base import Operation, register

ROLES = "replica_roles"
IN_SYNC = "replicas_in_sync"
IDENTICAL = "replicas_identical"


def _body(ended: OpEnded) -> dict[str, Any] | None:
    try:
        found = json.loads(ended.outcome.body)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


@register
class ReplicaRoles(Operation):
    kind = ROLES
    from_server = False  # gathered by the driver from every replica and etcd

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        body = _body(ended)
        if body is None:
            return
        # (member, epoch) -> (replica, event, where it was seen)
        owners: dict[tuple[str, int], tuple[str, int, str]] = model.extra.setdefault("owners", {})  # type: ignore[assignment]
        epochs: dict[str, tuple[int, int]] = model.extra.setdefault("record_epochs", {})  # type: ignore[assignment]
        seen: list[tuple[str, int, str, str]] = []
        for replica, stats in (body.get("replicas") or {}).items():
            if stats and stats.get("role") == "owner":
                seen.append((str(stats["member"]), int(stats["epoch"]), replica, "serving"))
        for member, record in (body.get("records") or {}).items():
            if not record or not record.get("owner"):
                continue
            epoch = int(record.get("epoch", 0))
            seen.append((member, epoch, str(record["owner"]), "etcd"))
            previous = epochs.get(member)
            model.check(
                "epoch-forward",
                previous is None or epoch >= previous[0],
                "epoch-back",
                f"member {member}: etcd's record went from epoch {previous and previous[0]} back to {epoch}",
                [started.id, *([previous[1]] if previous else [])],
            )
            epochs[member] = (epoch, started.id)
        for member, epoch, replica, where in seen:
            first = owners.setdefault((member, epoch), (replica, started.id, where))
            model.check(
                "one-owner-per-epoch",
                first[0] == replica,
                "two-owners",
                f"member {member}: epoch {epoch} has two owners: {first[0]} ({first[2]}) and {replica} ({where})",
                [first[1], started.id],
            )


@register
class ReplicasInSync(Operation):
    kind = IN_SYNC
    from_server = False

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        body = _body(ended) or {}
        for member in model.config.members:
            model.check(
                "in-sync-at-end",
                bool(body.get(member)),
                "not-in-sync",
                f"member {member}: no in-sync follower {started.params.get('waited', '?')} s after every "
                f"fault was healed: {ended.outcome.error or body.get(member)}",
                [started.id],
            )


@register
class ReplicasIdentical(Operation):
    kind = IDENTICAL
    from_server = False

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        body = _body(ended) or {}
        for member in model.config.members:
            found = body.get(member) or {}
            differ = found.get("differ")
            model.check(
                "replicas-identical",
                differ == [],
                "replicas-differ",
                f"member {member}: the data directories of {found.get('owner')} (owner) and "
                f"{found.get('follower')} differ once quiet: {differ if differ is not None else 'not compared'}",
                [started.id],
            )
