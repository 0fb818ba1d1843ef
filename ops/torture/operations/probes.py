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
        if outcome.status is None:
            model.check(
                "server-up",
                model.server_down(started.time, ended.time),
                "server-down",
                f"GET /healthz got no answer ({outcome.error}) while no fault had stopped the server",
                [started.id],
            )
            return
        model.check(
            "healthz-ok",
            outcome.status == 200 and outcome.body == "ok",
            "server-unhealthy",
            f"GET /healthz answered {outcome.status} {outcome.body[:80]!r}",
            [started.id],
        )


@register
class FdProbe(Operation):
    """The server's open descriptors at a quiet moment (no request in flight): none may point at a
    deleted file. The outcome body is {"total": n, "deleted": [paths]}."""

    kind = "fd_probe"
    from_server = False

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        try:
            found = json.loads(ended.outcome.body)
        except ValueError:
            return
        deleted = found.get("deleted", [])
        model.check(
            "fd-leak",
            not deleted,
            "fd-leak",
            f"{len(deleted)} of the server's {found.get('total')} open descriptors point at deleted files "
            f"at a quiet moment, e.g. {deleted[:3]}",
            [started.id],
        )
