"""The end-of-run pin count of a cluster run (ops/torture/cluster.py).

A source's member keeps one pin per fork another member owns (streamkeep/cluster/forks.py); a
pin whose fork is gone is dropped by the next reconcile, and every member ran one at its start-up
just before this count, with the others up. So the count is exact, not a bound:

- each member's `/stats` `cluster_forks.pins` equals the streams on the other members whose
  `forked_from` it owns (more: a leaked pin, which keeps a source soft-deleted and its data
  held; fewer: a fork whose source may free its data under it);
- each stream's `fork_count` equals the streams, on any member, whose `forked_from` names it.

The outcome body is {member: {"cluster_forks": <its /stats section>, "streams": [{"name",
"forked_from", "fork_count", "deleted", "expired"}, ...]}}, taken directly from each member.
"""

from __future__ import annotations

import json
from collections import Counter

from ops.torture.history import OpEnded, OpStarted
from ops.torture.model import Model
from ops.torture.operations.base import Operation, register

PINS = "cluster_pins"


@register
class ClusterPins(Operation):
    kind = PINS
    from_server = False  # gathered by the driver from several members' answers

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        if model.cluster is None:
            return
        try:
            taken = json.loads(ended.outcome.body)
        except ValueError:
            model.finding(
                "pin-count", "the members' /stats and stream lists could not be read at the end", [started.id]
            )
            return
        rows = [(member, row) for member, part in taken.items() for row in part["streams"]]
        forks_of = Counter(row["forked_from"] for _, row in rows if row["forked_from"])
        for member, part in taken.items():
            expected = sorted(
                f"{row['name']} (of {row['forked_from']})"
                for other, row in rows
                if other != member
                and row["forked_from"]
                and model.cluster.owner(row["forked_from"]) == member
            )
            pins = part["cluster_forks"].get("pins")
            model.check(
                "pins-exact",
                pins == len(expected),
                "pin-leak" if (pins or 0) > len(expected) else "pin-missing",
                f"member {member}: {pins} fork pins after a reconcile, but {len(expected)} forks on other "
                f"members read its streams: {expected[:8]}",
                [started.id],
            )
            for _, row in [(m, r) for m, r in rows if m == member]:
                model.check(
                    "fork-count-exact",
                    row["fork_count"] == forks_of[row["name"]],
                    "fork-count",
                    f"{row['name']} (member {member}, {'soft-deleted' if row['deleted'] else 'live'}): "
                    f"fork_count {row['fork_count']}, but {forks_of[row['name']]} streams are its forks",
                    [started.id],
                )
