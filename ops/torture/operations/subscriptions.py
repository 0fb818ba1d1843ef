"""Subscriptions: create/confirm, claim, ack, release, GET, and webhook deliveries."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ops.torture.history import AMBIGUOUS, Call, OpEnded, OpStarted, Outcome, to_text
from ops.torture.model import Model, parse_token
from ops.torture.operations.base import (
    SUB_HOOK,
    SUB_PULL,
    SUBS,
    WAKE_STREAM,
    ClientView,
    GenContext,
    Operation,
    Planned,
    register,
)

# ---- subscriptions ------------------------------------------------------------------------------


@dataclass
class SubState:
    confirmed_at: float | None = None  # end of the first 200/201
    generations: list[tuple[float, int, str, int]] = field(default_factory=list)  # (end, gen, wake, event)
    floors: dict[tuple[str, int], list[tuple[float, int, int]]] = field(default_factory=dict)


def before_replacement(model: Model, started: OpStarted) -> bool:
    """Subscription answers from before the data directory was replaced belong to another world."""
    return started.time < model.replaced_at


def subs(model: Model) -> dict[str, SubState]:
    return model.extra.setdefault("subs", {})  # type: ignore[return-value]


def sub_config(sub_id: str, view: ClientView) -> dict[str, Any]:
    if sub_id == SUB_PULL:
        return {"type": "pull-wake", "pattern": "json/*", "wake_stream": WAKE_STREAM, "lease_ttl_ms": 3000}
    return {"type": "webhook", "pattern": "txt/*", "webhook": {"url": view.webhook_url}, "lease_ttl_ms": 5000}


def judge_generation(
    model: Model, started: OpStarted, ended: OpEnded, sub_id: str, generation: int, wake_id: str
) -> None:
    if before_replacement(model, started):
        return
    state = subs(model).setdefault(sub_id, SubState())
    before = [g for g in state.generations if g[0] < started.time]
    if before:
        last = max(before, key=lambda g: g[1])
        model.check(
            "generation-increases",
            generation > last[1] or (generation == last[1] and wake_id == last[2]),
            "generation",
            f"{sub_id}: wake generation {generation} ({wake_id}) after generation {last[1]} ({last[2]})",
            [started.id, last[3]],
        )
    same = [g for g in state.generations if g[1] == generation and g[2] != wake_id]
    model.check(
        "wake-id-unique",
        not same,
        "generation",
        f"{sub_id}: generation {generation} issued twice, as {wake_id} and {same[0][2] if same else ''}",
        [started.id] + [g[3] for g in same],
    )
    state.generations.append((ended.time, generation, wake_id, started.id))


def judge_cursors(model: Model, started: OpStarted, sub_id: str, streams: list[dict[str, Any]]) -> None:
    """A subscription's cursors never go back below an ack answered before this began."""
    if before_replacement(model, started):
        return
    state = subs(model).setdefault(sub_id, SubState())
    for link in streams:
        acked = parse_token(link.get("acked_offset"))
        tail = parse_token(link.get("tail_offset"))
        if acked is None:
            continue
        if tail is not None and tail[0] == acked[0]:
            model.check(
                "cursor-below-tail",
                acked[1] <= tail[1],
                "cursor",
                f"{sub_id}: {link.get('path')} acked {acked[1]} past its tail {tail[1]}",
                [started.id],
            )
        floors = [f for f in state.floors.get((link.get("path", ""), acked[0]), []) if f[0] < started.time]
        if floors:
            best = max(floors, key=lambda f: f[1])
            model.check(
                "cursor-durable",
                acked[1] >= best[1],
                "cursor-went-back",
                f"{sub_id}: {link.get('path')} cursor at {acked[1]}, below the ack to {best[1]} answered before",
                [started.id, best[2]],
            )


@register
class SubPut(Operation):
    kind = "sub_put"
    weight = 0.3

    def generate(self, ctx: GenContext) -> Planned | None:
        sub_id = ctx.rng.choice((SUB_PULL, SUB_HOOK))
        if sub_id == SUB_HOOK and ctx.view.webhook_url is None:
            return None
        body = json.dumps(sub_config(sub_id, ctx.view)).encode()
        call = Call("PUT", SUBS + sub_id, headers={"Content-Type": "application/json"}, body=to_text(body))
        return Planned(self.kind, None, {"sub": sub_id}, call)

    def after(self, ctx: GenContext, planned: Planned, outcome: Outcome) -> None:
        if outcome.status in (200, 201):
            ctx.view.sub_confirmed.add(planned.params["sub"])

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        if before_replacement(model, started):
            return
        sub_id, status = started.params["sub"], ended.outcome.status
        state = subs(model).setdefault(sub_id, SubState())
        if status == 201 and state.confirmed_at is not None and state.confirmed_at < started.time:
            model.finding(
                "subscription-lost",
                f"{sub_id}: created again (201) after it had been confirmed: the server forgot it",
                [started.id],
            )
        model.check(
            "sub-config-stable",
            status != 409,
            "wrong-status",
            f"{sub_id}: 409 for the configuration it was created with: {ended.outcome.body[:160]}",
            [started.id],
        )
        if status in (200, 201) and state.confirmed_at is None:
            state.confirmed_at = ended.time


@register
class SubClaim(Operation):
    kind = "sub_claim"
    weight = 2

    def generate(self, ctx: GenContext) -> Planned | None:
        if SUB_PULL not in ctx.view.sub_confirmed or ctx.worker in ctx.view.claims:
            return None
        body = json.dumps({"worker": ctx.worker}).encode()
        call = Call(
            "POST",
            SUBS + SUB_PULL + "/claim",
            headers={"Content-Type": "application/json"},
            body=to_text(body),
        )
        return Planned(self.kind, None, {"sub": SUB_PULL}, call)

    def after(self, ctx: GenContext, planned: Planned, outcome: Outcome) -> None:
        if outcome.status == 200:
            try:
                ctx.view.claims[ctx.worker] = json.loads(outcome.body)
            except ValueError:
                pass

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        if before_replacement(model, started):
            return
        if ended.outcome.status != 200:
            return
        try:
            body = json.loads(ended.outcome.body)
            generation, wake_id, streams = (
                int(body["generation"]),
                str(body["wake_id"]),
                list(body["streams"]),
            )
        except (ValueError, KeyError, TypeError):
            model.finding("bad-body", f"claim: not a claim: {ended.outcome.body[:160]}", [started.id])
            return
        judge_generation(model, started, ended, SUB_PULL, generation, wake_id)
        judge_cursors(model, started, SUB_PULL, streams)


@register
class SubAck(Operation):
    kind = "sub_ack"
    weight = 6  # only runs while the worker holds a claim

    def generate(self, ctx: GenContext) -> Planned | None:
        claim = ctx.view.claims.get(ctx.worker)
        if claim is None:
            return None
        acks = [
            {"stream": s["path"], "offset": s["tail_offset"]}
            for s in claim.get("streams", [])
            if s.get("has_pending") and s.get("tail_offset")
        ]
        roll = ctx.rng.random()
        done = roll < 0.85
        path = "/ack"
        payload: dict[str, Any] = {"wake_id": claim["wake_id"], "generation": claim["generation"]}
        if roll > 0.93:
            path = "/release"
        else:
            payload.update(acks=acks, done=done)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {claim['token']}"}
        call = Call("POST", SUBS + SUB_PULL + path, headers=headers, body=json.dumps(payload))
        kind = "sub_release" if path == "/release" else self.kind
        return Planned(kind, None, {"sub": SUB_PULL, "acks": acks, "done": done and path == "/ack"}, call)

    def after(self, ctx: GenContext, planned: Planned, outcome: Outcome) -> None:
        if outcome.verdict == AMBIGUOUS:
            return  # retried: after a restart it gets 409 FENCED and the claim is dropped then
        if planned.op == "sub_ack" and not planned.params["done"] and outcome.status == 200:
            return  # a heartbeat: the claim goes on
        ctx.view.claims.pop(ctx.worker, None)

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        if before_replacement(model, started):
            return
        if ended.outcome.status != 200:
            return
        state = subs(model).setdefault(started.params["sub"], SubState())
        for ack in started.params["acks"]:
            token = parse_token(ack["offset"])
            if token is not None:
                state.floors.setdefault((ack["stream"], token[0]), []).append(
                    (ended.time, token[1], started.id)
                )


@register
class SubRelease(SubAck):
    kind = "sub_release"
    weight = 0  # generated by SubAck


@register
class SubGet(Operation):
    kind = "sub_get"
    weight = 1

    def generate(self, ctx: GenContext) -> Planned | None:
        sub_id = ctx.rng.choice(sorted(ctx.view.sub_confirmed) or [SUB_PULL])
        return Planned(self.kind, None, {"sub": sub_id}, Call("GET", SUBS + sub_id))

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        if before_replacement(model, started):
            return
        sub_id = started.params["sub"]
        state = subs(model).setdefault(sub_id, SubState())
        if (
            ended.outcome.status == 404
            and state.confirmed_at is not None
            and state.confirmed_at < started.time
        ):
            model.finding("subscription-lost", f"{sub_id}: 404 after it had been confirmed", [started.id])
        if ended.outcome.status != 200:
            return
        try:
            streams = list(json.loads(ended.outcome.body)["streams"])
        except (ValueError, KeyError, TypeError):
            model.finding(
                "bad-body", f"{sub_id}: GET is not a subscription: {ended.outcome.body[:160]}", [started.id]
            )
            return
        judge_cursors(model, started, sub_id, streams)


@register
class Webhook(Operation):
    """A delivery our receiver got (recorded by the receiver, not generated)."""

    kind = "webhook"
    from_server = False

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        p = started.params
        model.check(
            "webhook-signature",
            bool(p.get("signature_ok")),
            "webhook-signature",
            f"webhook: signature did not verify ({p.get('signature_error')})",
            [started.id],
        )
        body = p.get("body") or {}
        try:
            generation, wake_id = int(body["generation"]), str(body["wake_id"])
        except (KeyError, TypeError, ValueError):
            model.finding("bad-body", f"webhook: not a wake: {str(body)[:160]}", [started.id])
            return
        judge_generation(model, started, ended, str(body.get("subscription_id")), generation, wake_id)
        judge_cursors(model, started, str(body.get("subscription_id")), list(body.get("streams", [])))
