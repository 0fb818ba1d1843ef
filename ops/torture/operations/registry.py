"""The stream registry (`__registry__`, issue 14): read in full at the end of a run, folded as
the State Protocol says, and compared with what the model says exists then.

Every name the run used must be listed if it surely holds a stream clients can use (not deleted,
not soft-deleted, not possibly expired) and unlisted if it surely does not; a name whose state a
lost answer left open may be either. A listed stream's content type is the one it was created
with. The black box restarts the server with a kill -9 just before, so this also checks that the
registry is reconciled with the data directory at start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ops.torture.history import OpEnded, OpStarted, to_bytes
from ops.torture.model import Model
from ops.torture.operations.base import Operation, describe, register

REGISTRY_STREAM = "__registry__"


@dataclass
class RegistryReads:
    """The final read's pieces, in order (a read from -1 starts them again)."""

    messages: list[Any] = field(default_factory=list)
    time: float = 0.0
    event: int = 0
    complete: bool = False


def reads(model: Model) -> RegistryReads:
    found = model.extra.get("registry")
    if not isinstance(found, RegistryReads):
        found = model.extra["registry"] = RegistryReads()
    return found


@register
class RegistryRead(Operation):
    kind = "registry_read"
    status_kind = "read"

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        outcome = ended.outcome
        if outcome.status != 200 or not started.params.get("final"):
            return
        state = reads(model)
        if started.params.get("offset") == "-1":
            state.messages, state.time, state.event = [], started.time, started.id
        try:
            messages = json.loads(to_bytes(outcome.body).decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            messages = None
        if not isinstance(messages, list):
            model.finding(
                "registry",
                f"{REGISTRY_STREAM}: a read is not a JSON array: {outcome.body[:80]!r}",
                [started.id],
            )
            return
        state.messages.extend(messages)
        state.complete = outcome.headers.get("stream-up-to-date", "").lower() == "true"
        model.finishers["registry"] = judge_registry


def fold(messages: list[Any]) -> dict[str, dict[str, Any]]:
    """What the registry lists: `stream` entries by key, as a State Protocol reader folds them."""
    listed: dict[str, dict[str, Any]] = {}
    for message in messages:
        headers = message.get("headers") if isinstance(message, dict) else None
        if not isinstance(headers, dict):
            continue
        if headers.get("control") == "reset":
            listed.clear()
        if message.get("type") != "stream" or not isinstance(message.get("key"), str):
            continue
        if headers.get("operation") == "delete":
            listed.pop(message["key"], None)
        elif headers.get("operation") in ("insert", "update", "upsert"):
            listed[message["key"]] = message.get("value") or {}
    return listed


def judge_registry(model: Model) -> None:
    state = reads(model)
    if not state.complete:
        return  # the final read did not reach the registry's tail: nothing to compare
    listed = fold(state.messages)
    at = state.time
    for name in sorted(model.names):
        states = model.states(name, at, at)
        usable = {s.inc for s in states if s.inc is not None and not s.soft}
        may_be_gone = any(s.inc is None or s.soft for s in states)
        model.checks["registry-entry"] += 1
        if name in listed and not usable:
            model.finding(
                "registry",
                f"{REGISTRY_STREAM}: lists {name!r}, which held {describe(states)} at the end",
                [state.event],
            )
        elif name not in listed and not may_be_gone:
            model.finding(
                "registry",
                f"{REGISTRY_STREAM}: does not list {name!r}, which held {describe(states)} at the end",
                [state.event],
            )
        elif name in listed and len(usable) == 1 and not may_be_gone:
            inc = next(iter(usable))
            assert inc is not None
            shown = str(listed[name].get("contentType", "")).split(";")[0]
            model.check(
                "registry-content-type",
                shown == inc.content_type.split(";")[0],
                "registry",
                f"{REGISTRY_STREAM}: lists {name!r} as {shown!r}, created as {inc.content_type!r}",
                [state.event, inc.created_by],
            )
