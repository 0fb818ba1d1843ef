"""Reads: catch-up, long-poll, SSE, slow readers, vanishing readers and writers."""

from __future__ import annotations

import random

from ops.torture import contract, payloads
from ops.torture.history import Call, Chunk, OpEnded, OpStarted, Outcome, to_bytes
from ops.torture.model import Incarnation, Model, parse_token
from ops.torture.operations.base import (
    PREFIX,
    GenContext,
    Operation,
    Planned,
    closed_flag,
    describe,
    expect_status,
    header_token,
    judge_closed_report,
    register,
    touch,
)

# ---- reads ------------------------------------------------------------------------------------


def pick_offset(ctx: GenContext, name: str) -> str:
    view, rng = ctx.view, ctx.rng
    roll = rng.random()
    cursor = view.cursors.get((ctx.worker, name))
    tokens = list(view.streams[name].tokens)
    if roll < 0.6 and cursor:
        return cursor
    if roll < 0.75 and tokens:
        return rng.choice(tokens)
    if roll < 0.8:
        return "now"
    return "-1"


class _Read(Operation):
    live = ""  # "", "long-poll" or "sse"
    mode = "plain"

    def generate(self, ctx: GenContext) -> Planned | None:
        rng = ctx.rng
        name = ctx.view.existing(rng) if rng.random() < 0.9 else rng.choice(list(ctx.view.streams))
        if name is None:
            return None
        offset = pick_offset(ctx, name)
        query = {"offset": offset}
        if self.live:
            query["live"] = self.live
        limit = self.limit(rng)
        call = Call("GET", PREFIX + name, query=query, mode=self.mode, limit=limit)
        return Planned(self.kind, name, {"offset": offset}, call)

    def limit(self, rng: random.Random) -> float:
        return 0.0

    def after(self, ctx: GenContext, planned: Planned, outcome: Outcome) -> None:
        name = planned.name or ""
        tokens = [c.next_offset for c in outcome.chunks if c.next_offset] or [
            outcome.headers.get("stream-next-offset")
        ]
        token = tokens[-1]
        if outcome.status in (200, 204) and token:
            ctx.view.cursors[(ctx.worker, name)] = token
            ctx.view.saw_token(name, token)
            if outcome.status == 200:
                ctx.view.saw_content_type(name, outcome.headers.get("content-type"))
        elif outcome.status in (404, 410):
            ctx.view.cursors.pop((ctx.worker, name), None)
            if outcome.status == 404:
                ctx.view.streams[name].exists = False

    def chunks(self, model: Model, started: OpStarted, ended: OpEnded) -> list:
        """The pieces of data the answer holds (catch-up and long-poll: one)."""
        outcome = ended.outcome
        if outcome.status != 200:
            return []

        return [
            Chunk(
                ended.time,
                outcome.body,
                outcome.headers.get("stream-next-offset"),
                outcome.headers.get("stream-up-to-date", "").lower() == "true",
                closed_flag(outcome),
            )
        ]

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        name, outcome = started.name or "", ended.outcome
        states = model.states(name, started.time, ended.time)
        offset = started.params["offset"]
        requested = parse_token(offset) if offset not in ("-1", "now") else None
        allowed: set[int] = set()
        for s in states:
            if s.inc is None:
                allowed.add(404)
            elif s.soft:
                allowed.add(410)
            else:
                allowed |= self.ok_statuses()
                if requested is not None and requested[0] not in {i.number for i in s.inc.chain()}:
                    allowed.update((400, 410))  # a token of an earlier incarnation
                elif requested is not None and model.config.retention:
                    allowed.add(410)  # below the floor (judged in judge_gone)
                if requested is not None and requested[1] > s.inc.last_tail:
                    allowed.add(400)
        if "If-None-Match" in started.call.headers:
            allowed.add(304)
        expect_status(model, started, ended, allowed, states)
        if outcome.status == 404:
            model.narrow(name, started.time, ended.time, lambda s: s.inc is None)
        if outcome.status == 410 and requested is None:
            model.narrow(name, started.time, ended.time, lambda s: s.soft)
        if outcome.status == 410 and requested is not None:
            judge_gone(model, started, ended, states, requested[1], started.op)
        chunks = self.chunks(model, started, ended)
        if outcome.status == 204:
            found = header_token(model, started, ended, states)
            if found is not None:
                inc, tail = found
                model.check(
                    "204-up-to-date",
                    outcome.headers.get("stream-up-to-date", "").lower() == "true",
                    "missing-header",
                    f"long-poll {name}: 204 without Stream-Up-To-Date",
                    [started.id],
                )
                if requested is not None:
                    model.check(
                        "204-at-request",
                        tail >= requested[1],
                        "tail-went-back",
                        f"long-poll {name}: 204 with tail {tail}, before the requested offset {requested[1]}",
                        [started.id],
                    )
                model.tail_floor(inc, tail, started, ended, "long-poll 204")
                judge_closed_report(model, started, ended, states, inc, tail, closed_flag(outcome))
                touch(model, started, ended, states, inc, write=False)
            return
        if not chunks:
            touch(model, started, ended, states, None, write=False)
            return
        self.judge_chunks(model, started, ended, states, requested, offset, chunks)

    def ok_statuses(self) -> set[int]:
        return {200}

    def judge_chunks(self, model, started, ended, states, requested, offset, chunks) -> None:  # type: ignore[no-untyped-def]
        name = started.name or ""
        inc: Incarnation | None = None
        # From -1 a read starts at the floor, which retention moves: then its first chunk says where.
        from_start = offset == "-1"
        position: int | None = (
            requested[1] if requested else (0 if from_start and not model.config.retention else None)
        )
        # An up-to-date event may not be below a tail acknowledged before it was written. The first
        # read's events were written after the request began; a later read's, no earlier than
        # contract.DELIVERY_SKEW before they arrived (not "after the previous read": two events
        # written together can arrive in two reads, the second after an acknowledgement that left
        # the server later: CI, seed 10 of the replicated slice, on a loaded 2-core machine).
        since, first = started.time, chunks[0].time if chunks else started.time
        for chunk in chunks:
            if chunk.time > first:
                since = max(started.time, chunk.time - contract.DELIVERY_SKEW)
            token = parse_token(chunk.next_offset)
            if token is None:
                model.finding(
                    "bad-offset", f"{started.op} {name}: next offset {chunk.next_offset!r}", [started.id]
                )
                return
            this = model.inc_of_token(name, chunk.next_offset, states, started.id)
            if this is None:
                return
            if inc is None:
                inc = this
                model.check(
                    "incarnation-possible",
                    inc in {s.inc for s in states},
                    "wrong-incarnation",
                    f"{started.op} {name}: data of {inc.label()}, but the name held {describe(states)}",
                    [started.id, inc.created_by],
                )
                if requested is not None and requested[0] != 0:
                    model.check(
                        "read-incarnation",
                        requested[0] in {c.number for c in inc.chain()},
                        "wrong-incarnation",
                        f"{started.op} {name}: asked from an offset of incarnation {requested[0]:016d}, "
                        f"answered with data of {inc.label()}",
                        [started.id, inc.created_by],
                    )
            elif this is not inc:
                model.finding(
                    "wrong-incarnation",
                    f"{started.op} {name}: one answer mixed {inc.label()} and {this.label()}",
                    [started.id],
                )
                return
            data = to_bytes(chunk.body)
            if inc.json and data:
                stored = payloads.json_read_to_stored(data)
                if stored is None:
                    model.finding(
                        "bad-json",
                        f"{started.op} {name}: JSON read is not an array: {data[:80]!r}",
                        [started.id],
                    )
                    return
                data = stored
            end = token[1]
            start = end - len(data) if position is None else position
            model.check(
                "offset-arithmetic",
                end - start == len(data),
                "offset-arithmetic",
                f"{started.op} {name}: {len(data)} bytes from {start} answered next offset {end}",
                [started.id],
            )
            model.check(
                "offset-increasing",
                end > start if data else end >= start,
                "offset-order",
                f"{started.op} {name}: next offset {end} after {start} for {len(data)} bytes",
                [started.id],
            )
            if end - start == len(data):
                if from_start and model.config.retention:
                    model.floor_seen(inc, start, started, ended, f"{started.op} from -1")
                    if started.params.get("final"):
                        inc.final_floor = start
                    from_start = False
                model.observe(inc, start, data, started.id)
            if (chunk.up_to_date or chunk.closed) and started.params.get("final"):
                inc.final_read = (end, started.id)  # the end-of-run read that reached the tail
            if chunk.up_to_date or chunk.closed:
                # Data ending below a tail already reached, called up to date: stale (or lost).
                kind = "stale-up-to-date" if data else "tail-went-back"
                model.tail_floor(inc, end, started, ended, started.op, since=since, kind=kind)
                judge_closed_report(model, started, ended, states, inc, end, chunk.closed)
            position = end
        touch(model, started, ended, states, inc, write=False)


@register
class Read(_Read):
    kind = "read"
    weight = 12

    def generate(self, ctx: GenContext) -> Planned | None:
        planned = super().generate(ctx)
        if planned is not None and ctx.rng.random() < 0.1:
            etag = ctx.view.etags.get((planned.name or "", planned.call.query["offset"]))
            if etag:
                planned.call.headers["If-None-Match"] = etag
        return planned

    def after(self, ctx: GenContext, planned: Planned, outcome: Outcome) -> None:
        super().after(ctx, planned, outcome)
        etag = outcome.headers.get("etag")
        if outcome.status == 200 and etag:
            with ctx.view.lock:
                if len(ctx.view.etags) > 2000:
                    ctx.view.etags.clear()
                ctx.view.etags[(planned.name or "", planned.call.query["offset"])] = etag


@register
class LongPoll(_Read):
    kind = "long_poll"
    live = "long-poll"
    weight = 5

    def ok_statuses(self) -> set[int]:
        return {200, 204}


@register
class Sse(_Read):
    kind = "sse"
    live = "sse"
    mode = "sse"
    weight = 5

    def limit(self, rng: random.Random) -> float:
        return rng.uniform(0.3, 3.0)

    def chunks(self, model: Model, started: OpStarted, ended: OpEnded) -> list:
        return ended.outcome.chunks if ended.outcome.status == 200 else []


@register
class SlowRead(_Read):
    """A client that takes the answer a byte at a time (catch-up, or SSE)."""

    kind = "slow_read"
    status_kind = "read"
    mode = "slow"
    weight = 1

    def limit(self, rng: random.Random) -> float:
        return rng.uniform(1.0, 4.0)

    def chunks(self, model: Model, started: OpStarted, ended: OpEnded) -> list:
        if ended.outcome.partial:
            return []  # cut short by its own patience: the headers describe bytes it never got
        return super().chunks(model, started, ended)


@register
class VanishRead(_Read):
    """A reader that resets its connection mid-answer (catch-up, long-poll or SSE)."""

    kind = "vanish_read"
    status_kind = "long_poll"  # any read mode; long-poll's row names every status they may answer
    mode = "vanish"
    weight = 1.5

    def generate(self, ctx: GenContext) -> Planned | None:
        planned = super().generate(ctx)
        if planned is not None:
            live = ctx.rng.choice(("", "long-poll", "sse", "sse"))
            if live:
                planned.call.query["live"] = live
            planned.call.limit = float(ctx.rng.randint(0, 400))  # bytes taken before the reset
        return planned

    def ok_statuses(self) -> set[int]:
        return {200, 204}

    def chunks(self, model: Model, started: OpStarted, ended: OpEnded) -> list:
        outcome = ended.outcome
        if outcome.status != 200:
            return []
        if started.call.query.get("live") == "sse":
            return outcome.chunks
        return [] if outcome.partial else super().chunks(model, started, ended)


def judge_gone(
    model: Model, started: OpStarted, ended: OpEnded, states: set, position: int, what: str
) -> Incarnation | None:
    """A 410 for a position of a live stream's own incarnation: retention's `offset_before_floor`,
    naming in `Stream-Earliest-Offset` a floor above the position asked for."""
    outcome = ended.outcome
    if not model.config.retention or contract.error_code(outcome.body) != "offset_before_floor":
        return None
    earliest = outcome.headers.get("stream-earliest-offset")
    inc = model.inc_of_token(started.name or "", earliest, states, started.id)
    if inc is None:
        return None
    floor = parse_token(earliest)[1]  # type: ignore[index]
    model.check(
        "gone-below-floor",
        position < floor,
        "gone-above-floor",
        f"{what} {inc.label()}: 410 offset_before_floor for position {position}, with the floor at {floor}",
        [started.id],
    )
    model.floor_seen(inc, floor, started, ended, f"{what} 410")
    return inc
