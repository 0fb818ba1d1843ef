"""Operator probes: GET /healthz between steps, open descriptors at quiet moments."""

from __future__ import annotations

import json

from ops.torture.history import OpEnded, OpStarted
from ops.torture.model import Model
from ops.torture.operations.base import (
    Operation,
    register,
)

# ---- operator probes ----------------------------------------------------------------------------


@register
class Healthz(Operation):
    kind = "healthz"

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        outcome = ended.outcome
        member = started.params.get("member")  # a cluster run probes each member directly
        if outcome.status is None:
            # Counted until a "crash" event explains it (the probe notices an exit first).
            explained = model.server_down(started.time, ended.time, member)
            model.recent_down = 0 if explained else model.recent_down + 1
            model.check(
                "server-up",
                explained,
                "server-down",
                f"GET /healthz{f' of member {member}' if member else ''} got no answer ({outcome.error}) "
                "while no fault had stopped it",
                [started.id],
            )
            return
        model.recent_down = 0
        model.check(
            "healthz-ok",
            outcome.status == 200 and outcome.body == "ok",
            "server-unhealthy",
            f"GET /healthz answered {outcome.status} {outcome.body[:80]!r}",
            [started.id],
        )


@register
class FdProbe(Operation):
    """The server's open descriptors (from /proc), probed every few seconds and once at a quiet
    moment at the end. A descriptor may point at a deleted file for a moment (a read in flight
    while its stream is deleted), never for long: one still open `HELD` seconds later in the same
    process, or any at the quiet moment, is a leak. The outcome body is
    {"pid": n, "total": n, "deleted": ["<fd> <path>", ...]}; params {"quiet": bool}."""

    kind = "fd_probe"
    from_server = False
    HELD = 8.0

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        try:
            found = json.loads(ended.outcome.body)
        except ValueError:
            return
        deleted = list(found.get("deleted", []))
        seen: dict[tuple[int, str], tuple[float, int]] = model.extra.setdefault("deleted_fds", {})  # type: ignore[assignment]
        pid = int(found.get("pid", 0))
        held = []
        for entry in deleted:
            first = seen.setdefault((pid, entry), (started.time, started.id))
            if started.time - first[0] >= self.HELD:
                held.append((entry, first[1]))
        for key in [k for k in seen if k[0] == pid and k[1] not in deleted]:
            del seen[key]
        quiet = bool(started.params.get("quiet"))
        leaked = deleted if quiet else [entry for entry, _ in held]
        model.check(
            "fd-leak",
            not leaked,
            "fd-leak",
            f"server {pid}: {len(leaked)} of its {found.get('total')} open descriptors point at deleted "
            f"files {'at a quiet moment' if quiet else f'for {self.HELD:g} s or more'}, e.g. {leaked[:3]}",
            [started.id] + [event for _, event in held[:3]],
        )
