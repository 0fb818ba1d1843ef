"""Stream operations: create, fork, append, produce, close, delete, HEAD."""

from __future__ import annotations

import time
from typing import Any

from ops.torture import contract
from ops.torture.history import AMBIGUOUS, OK, Call, OpEnded, OpStarted, Outcome, to_text
from ops.torture.model import ABSENT, Incarnation, Model, SentAppend, State, parse_token
from ops.torture.operations.base import (
    FORKS,
    PREFIX,
    REGISTRY,
    GenContext,
    Operation,
    Planned,
    ProducerGuess,
    closed_flag,
    expect_status,
    header_token,
    is_json,
    judge_closed_report,
    media_type,
    record_for,
    register,
    register_body,
    touch,
    type_mismatch,
)

# ---- stream operations --------------------------------------------------------------------------


@register
class Create(Operation):
    kind = "create"
    blocking = True
    mutator = True
    weight = 6

    def generate(self, ctx: GenContext) -> Planned | None:
        rng, view = ctx.rng, ctx.view
        candidates = [n for n in view.streams if not n.startswith("fork/")]
        absent = [n for n in candidates if not view.streams[n].exists]
        name = rng.choice(absent if absent and rng.random() < 0.8 else candidates)
        content_type = view.streams[name].content_type
        headers = {"Content-Type": content_type}
        params: dict[str, Any] = {
            "content_type": content_type,
            "ttl": None,
            "expires_at": None,
            "closed": False,
        }
        if name.startswith("ttl/"):
            if rng.random() < 0.7:
                params["ttl"] = rng.randint(3, 8)
                headers["Stream-TTL"] = str(params["ttl"])
            else:
                at = int(time.time()) + rng.randint(4, 12)
                params["expires_at"] = float(at)
                headers["Stream-Expires-At"] = _rfc3339(at)
        body = b""
        if rng.random() < 0.3:
            key, body, stored, ids = record_for(ctx, content_type)
            params.update(record=key, stored=to_text(stored), record_ids=ids)
        elif is_json(content_type) and rng.random() < 0.3:
            body = b"[]"
        if rng.random() < 0.05:
            params["closed"] = True
            headers["Stream-Closed"] = "true"
        call = Call("PUT", PREFIX + name, headers=headers, body=to_text(body))
        return Planned(self.kind, name, params, call, (name,))

    def after(self, ctx: GenContext, planned: Planned, outcome: Outcome) -> None:
        guess = ctx.view.streams[planned.name or ""]
        if outcome.status in (200, 201):
            guess.exists = True
            guess.closed = closed_flag(outcome)
            if outcome.status == 201:
                guess.size = len(planned.call.body)
                guess.tokens.clear()
            ctx.view.saw_token(planned.name or "", outcome.headers.get("stream-next-offset"))
        elif outcome.status == 409:
            guess.exists = True

    def on_start(self, model: Model, started: OpStarted) -> None:
        register_body(model, started)

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        name, p, outcome = started.name or "", started.params, ended.outcome
        append = _attempt_ended(model, started, outcome)
        states = model.states(name, started.time, ended.time)
        allowed: set[int] = set()
        for s in states:
            if s.inc is None:
                allowed.add(201)
            elif s.soft:
                allowed.add(409)
            else:
                allowed.add(200 if _create_matches(s, p) else 409)
                if s.inc.maybe_expired_by(ended.time):
                    allowed.add(201)
        expect_status(model, started, ended, allowed, states)
        json_mode = is_json(p["content_type"])
        fields = dict(
            json=json_mode,
            content_type=p["content_type"],
            ttl=p["ttl"],
            expires_at=p["expires_at"],
            foreign=p.get("foreign", False),  # written by the server itself: the wake stream
        )
        if outcome.status == 201:
            token = parse_token(outcome.headers.get("stream-next-offset"))
            if token is None:
                model.finding(
                    "missing-header", f"create {name}: 201 without a Stream-Next-Offset token", [started.id]
                )
                return
            number, tail = token
            if number in model.incs:
                model.finding(
                    "incarnation-reused",
                    f"create {name}: new stream got incarnation {number:016d}, already {model.incs[number].label()}",
                    [started.id, model.incs[number].created_by],
                )
                return
            inc = model.new_inc(name, number, started, **fields)
            closed = closed_flag(outcome)
            model.check(
                "create-closed",
                closed == p["closed"],
                "closed-mismatch",
                f"create {name}: asked closed={p['closed']}, answered Stream-Closed {closed}",
                [started.id],
            )
            if append is not None:
                model.ack(append, inc, tail, ended, started)
            else:
                model.check(
                    "empty-create-tail",
                    tail == 0,
                    "ack-offset",
                    f"create {name}: an empty stream answered tail {tail}",
                    [started.id],
                )
                model.tail_floor(inc, tail, started, ended, "create")
            if closed:
                model.close_at(inc, tail, started.id)
            model.change(name, started, ended, lambda s: [State(inc, p["closed"])])
        elif outcome.status == 200:
            found = header_token(model, started, ended, states)
            if found is not None:
                model.narrow(name, started.time, ended.time, lambda s: s.inc is found[0])
        elif outcome.status == 409:
            model.narrow(name, started.time, ended.time, lambda s: s.inc is not None)
        elif outcome.verdict == AMBIGUOUS:
            inc = model.new_inc(name, None, started, **fields)
            model.change(
                name,
                started,
                ended,
                lambda s: [State(inc, p["closed"])] if model.maybe_vacant(s, ended.time) else [s],
            )


def _create_matches(state: State, p: dict[str, Any]) -> bool:
    inc = state.inc
    assert inc is not None
    return (
        inc.source is None
        and inc.content_type.split(";")[0] == p["content_type"].split(";")[0]
        and inc.ttl == p["ttl"]
        and inc.expires_at == p["expires_at"]
        and state.closed == p["closed"]
    )


def _rfc3339(epoch_seconds: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(epoch_seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@register
class Fork(Operation):
    kind = "fork"
    blocking = True
    mutator = True
    weight = 3

    def generate(self, ctx: GenContext) -> Planned | None:
        rng, view = ctx.rng, ctx.view
        source = view.existing(rng, ("txt", "json", "bin", "ttl", "fork"))
        if source is None:
            return None
        target = f"fork/{rng.randrange(FORKS)}"
        free = [f"fork/{i}" for i in range(FORKS) if not view.streams[f"fork/{i}"].exists]
        if view.prefer_free_forks and free and rng.random() < 0.75:
            target = rng.choice(free)
        if target == source:
            return None
        guess = view.streams[source]
        headers = {"Stream-Forked-From": PREFIX + source}
        params: dict[str, Any] = {"source": source, "offset": None, "sub_offset": 0, "ttl": None}
        roll = rng.random()
        if roll < 0.6 and guess.tokens:
            params["offset"] = rng.choice(list(guess.tokens))
            headers["Stream-Fork-Offset"] = params["offset"]
            if roll < 0.15:
                params["sub_offset"] = 1 if is_json(guess.content_type) else rng.randint(1, 6)
                headers["Stream-Fork-Sub-Offset"] = str(params["sub_offset"])
        if rng.random() < 0.2:
            params["ttl"] = rng.randint(4, 10)
            headers["Stream-TTL"] = str(params["ttl"])
        if rng.random() < 0.5:
            headers["Content-Type"] = guess.content_type
        call = Call("PUT", PREFIX + target, headers=headers)
        return Planned(self.kind, target, params, call, tuple(sorted((source, target))))

    def after(self, ctx: GenContext, planned: Planned, outcome: Outcome) -> None:
        if outcome.status == 201:
            guess = ctx.view.streams[planned.name or ""]
            guess.content_type = ctx.view.streams[planned.params["source"]].content_type
            guess.exists, guess.closed, guess.size = True, False, 0
            guess.tokens.clear()
            ctx.view.saw_token(planned.name or "", outcome.headers.get("stream-next-offset"))
        elif outcome.status == 404:
            ctx.view.streams[planned.params["source"]].exists = False

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        name, p, outcome = started.name or "", started.params, ended.outcome
        if model.cluster is not None:
            model.cluster.note_fork(p["source"], name, started.time, ended.time)
        source_states = model.states(p["source"], started.time, ended.time)
        target_states = model.states(name, started.time, ended.time)
        offset = parse_token(p["offset"]) if p["offset"] else None
        # The server looks at the target path first (an existing stream there answers 200 or 409
        # whatever the source), then at the source.
        allowed: set[int] = set()
        target_free = False
        for tgt in target_states:
            if tgt.inc is None:
                target_free = True
            elif tgt.soft:
                allowed.add(409)  # the path still holds a deleted stream its forks read
            else:
                allowed.update((200, 409))
        for src in source_states if target_free else ():
            if src.inc is None:
                allowed.add(404)
            elif src.soft:
                allowed.add(409)
            elif _fork_type_mismatch(src, started):
                allowed.add(409)  # checked before the fork point (see type_mismatch)
            else:
                allowed.add(201)
                if p["sub_offset"]:
                    allowed.add(400)  # the sub-offset may pass the end of the append there
                if offset is not None and offset[0] not in {i.number for i in src.inc.chain()}:
                    allowed.update((400, 410))  # a token of an earlier incarnation
                elif offset is not None and model.config.retention:
                    allowed.add(410)  # a fork point below the source's floor
        expect_status(model, started, ended, allowed, source_states | target_states)
        if outcome.status == 410 and offset is not None and model.config.retention:
            code = contract.error_code(outcome.body)
            model.check(
                "fork-410-code",
                code in ("offset_before_floor", "offset_of_deleted_stream") or not code,
                "fork-410",
                f"fork {name}: 410 with code {code!r}",
                [started.id],
            )
        sources = [s.inc for s in source_states if s.inc is not None and not s.soft]
        if offset is not None:
            named = [i for i in sources if offset[0] in {c.number for c in i.chain()}]
            sources = named or sources
        answered_type = outcome.headers.get("content-type", "").split(";")[0]
        if answered_type and len(sources) > 1:
            # Several incarnations may have been the source (a lost answer left both): the
            # fork's type says which kind it was. Picking by set order instead made the verdict
            # depend on memory addresses (seed 6168 judged a text fork as JSON in one process).
            typed = [i for i in sources if i.content_type.split(";")[0] == answered_type]
            sources = typed or sources
        sources.sort(key=lambda i: i.created_by)  # a fixed order, whatever the set's
        source = sources[-1] if sources else None
        if outcome.status == 201 and source is not None:
            token = parse_token(outcome.headers.get("stream-next-offset"))
            if token is None:
                model.finding("missing-header", f"fork {name}: 201 without Stream-Next-Offset", [started.id])
                return
            number, base = token
            if offset is not None and offset[0] in {c.number for c in source.chain()}:
                model.check(
                    "fork-base",
                    base == offset[1] if not p["sub_offset"] else offset[1] < base <= offset[1] + 10**6,
                    "fork-base",
                    f"fork {name}: asked to fork {source.label()} at {offset[1]} (+{p['sub_offset']}), "
                    f"the fork starts at {base}",
                    [started.id],
                )
            inc = _new_fork(model, name, number, started, source, base, p["ttl"])
            model.tail_floor(inc, base, started, ended, "fork")
            model.change(name, started, ended, lambda s: [State(inc)])
        elif outcome.verdict == AMBIGUOUS and source is not None:
            base = offset[1] if offset is not None and not p["sub_offset"] else 0
            opaque = offset is None or bool(p["sub_offset"])
            inc = _new_fork(model, name, None, started, source, base, p["ttl"], opaque=opaque)
            # The target may also have been freed meanwhile (expired, or reaped): see maybe_vacant.
            model.change(
                name, started, ended, lambda s: [State(inc)] if model.maybe_vacant(s, ended.time) else [s]
            )


def _attempt_ended(model: Model, started: OpStarted, outcome: Outcome) -> SentAppend | None:
    """The append a create or close carried (params "record"), its attempt noted as ended."""
    record = started.params.get("record")
    append = model.appends.get(record) if record else None
    if append is not None:
        model.attempt_ended(append, outcome.verdict)
    return append


def _new_fork(
    model: Model,
    name: str,
    number: int | None,
    started: OpStarted,
    source: Incarnation,
    base: int,
    ttl: int | None,
    *,
    opaque: bool = False,
) -> Incarnation:
    """A fork's incarnation: its source's type, and its own TTL or else the source's lifetime."""
    expires = None
    if ttl is None:
        ttl, expires = source.ttl, source.expires_at
    inc = model.new_inc(
        name,
        number,
        started,
        json=source.json,
        content_type=source.content_type,
        source=source,
        base=base,
        ttl=ttl,
        expires_at=expires,
        opaque=opaque,
    )
    source.forks.append(inc)
    return inc


def _fork_type_mismatch(source: State, started: OpStarted) -> bool:
    """A fork's optional Content-Type must be its source's (§4.2), else 409."""
    sent = started.call.headers.get("Content-Type")
    return (
        source.inc is not None
        and sent is not None
        and media_type(sent) != media_type(source.inc.content_type)
    )


class _Append(Operation):
    """Plain appends and producers share everything but the producer rules."""

    blocking = True
    stores: tuple[int, ...] = (204,)  # the statuses that mean a new record was stored

    def on_start(self, model: Model, started: OpStarted) -> None:
        register_body(model, started)

    def after(self, ctx: GenContext, planned: Planned, outcome: Outcome) -> None:
        name = planned.name or ""
        if outcome.status in (200, 204):
            ctx.view.saw_token(name, outcome.headers.get("stream-next-offset"))
            ctx.view.streams[name].size += len(planned.params.get("stored", ""))
        elif outcome.status == 404:
            ctx.view.streams[name].exists = False
        elif outcome.status == 409 and closed_flag(outcome):
            ctx.view.streams[name].closed = True

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        append = model.appends[started.params["record"]]
        model.attempt_ended(append, ended.outcome.verdict)
        self.judge_answer(model, started, ended, append)

    def judge_answer(self, model: Model, started: OpStarted, ended: OpEnded, append: SentAppend) -> None:
        name, outcome = started.name or "", ended.outcome
        states = model.states(name, started.time, ended.time)
        allowed: set[int] = set()
        for s in states:
            if s.inc is None:
                allowed.add(404)
            elif s.soft:
                allowed.add(410)
            elif s.closed:
                allowed.add(409)
            elif type_mismatch(s, started):
                allowed.add(409)
            else:
                allowed |= self.open_statuses()
        expect_status(model, started, ended, allowed, states)
        found = None
        if outcome.status in (200, 204) or (outcome.status == 409 and closed_flag(outcome)):
            found = header_token(model, started, ended, states)
        # Only a new record outlives a restart: a producer's duplicate (204) stores nothing.
        touch(model, started, ended, states, found[0] if found else None, write=outcome.status in self.stores)
        if found is None:
            if outcome.status == 404:
                model.narrow(name, started.time, ended.time, lambda s: s.inc is None)
            return
        inc, tail = found
        if outcome.status == 409:
            model.check(
                "closed-possible",
                any(s.inc is inc and s.closed for s in states),
                "closed-without-close",
                f"{started.op} {name}: 409 closed from {inc.label()}, which no close could have closed",
                [started.id],
            )
            model.close_at(inc, tail, started.id)
            model.tail_floor(inc, tail, started, ended, "409 closed")
            return
        model.check(
            "open-for-append",
            any(s.inc is inc and not s.closed for s in states),
            "append-after-close",
            f"{started.op} {name}: {outcome.status} from {inc.label()}, closed before the append began",
            [started.id] + ([inc.final_tail[1]] if inc.final_tail else []),
        )
        model.check(
            "append-not-closing",
            not closed_flag(outcome),
            "closed-without-close",
            f"{started.op} {name}: a plain append answered Stream-Closed: true",
            [started.id],
        )
        self.accepted(model, started, ended, append, inc, tail)

    def open_statuses(self) -> set[int]:
        return {204}

    def accepted(
        self,
        model: Model,
        started: OpStarted,
        ended: OpEnded,
        append: SentAppend,
        inc: Incarnation,
        tail: int,
    ) -> None:
        model.check(
            "plain-append-204",
            ended.outcome.status == 204,
            "wrong-status",
            f"append {started.name}: plain append answered {ended.outcome.status}, not 204",
            [started.id],
        )
        model.ack(append, inc, tail, ended, started)


@register
class Append(_Append):
    kind = "append"
    weight = 25

    def generate(self, ctx: GenContext) -> Planned | None:
        name = ctx.view.existing(ctx.rng, ("txt", "json", "bin", "ttl", "fork"))
        if name is None:
            return None
        content_type = ctx.view.streams[name].content_type
        batch = ctx.rng.choice((1, 1, 1, 2, 3)) if is_json(content_type) else 1
        key, body, stored, ids = record_for(ctx, content_type, batch)
        params = {"record": key, "stored": to_text(stored), "record_ids": ids}
        call = Call("POST", PREFIX + name, headers={"Content-Type": content_type}, body=to_text(body))
        return Planned(self.kind, name, params, call)


@register
class Produce(_Append):
    """An idempotent producer: one per (worker, stream); retries an ambiguous attempt with the
    same (epoch, seq) and body until it gets a definite answer."""

    kind = "produce"
    weight = 15
    stores = (200,)  # 204 is a duplicate

    def generate(self, ctx: GenContext) -> Planned | None:
        view, rng = ctx.view, ctx.rng
        pending = [(k, p) for k, p in view.producers.items() if k[0] == ctx.worker and p.pending]
        if pending:
            (_, name), producer = pending[0]
            assert producer.pending is not None
            params = dict(producer.pending)
            params["attempt"] = producer.retries + 1
        else:
            name = view.existing(rng, ("txt", "json", "bin", "fork"))
            if name is None:
                return None
            producer = view.producers.setdefault(
                (ctx.worker, name), ProducerGuess(f"{ctx.worker}-{name.replace('/', '-')}")
            )
            if rng.random() < 0.03 and producer.seq > 0:
                producer.epoch, producer.seq = producer.epoch + 1, 0  # a producer restart
            content_type = view.streams[name].content_type
            key, body, stored, ids = record_for(ctx, content_type)
            params = {
                "record": key,
                "stored": to_text(stored),
                "record_ids": ids,
                "producer": [producer.producer_id, producer.epoch, producer.seq],
                "content_type": content_type,
                "body": to_text(body),
                "attempt": 0,
            }
        pid, epoch, seq = params["producer"]
        headers = {
            "Content-Type": params["content_type"],
            "Producer-Id": pid,
            "Producer-Epoch": str(epoch),
            "Producer-Seq": str(seq),
        }
        call = Call("POST", PREFIX + name, headers=headers, body=params["body"])
        return Planned(self.kind, name, params, call)

    def after(self, ctx: GenContext, planned: Planned, outcome: Outcome) -> None:
        super().after(ctx, planned, outcome)
        name = planned.name or ""
        producer = ctx.view.producers[(ctx.worker, name)]
        # Once an attempt's fate is unknown, the same (epoch, seq) is only ever sent again with the
        # same body: a later 503 says nothing of the earlier attempt, which may be stored (a new
        # body under that seq would be answered 204, a duplicate of the first; replicated run,
        # seed 200). A client that gives up on it starts a new epoch.
        unknown = outcome.verdict == AMBIGUOUS or (
            producer.retries > 0 and (outcome.status is None or outcome.status >= 500)
        )
        if unknown and producer.retries < 12:
            producer.pending, producer.retries = dict(planned.params), producer.retries + 1
            return
        if unknown:
            producer.pending, producer.retries = None, 0
            producer.epoch, producer.seq = producer.epoch + 1, 0
            return
        producer.pending, producer.retries = None, 0
        if outcome.status in (200, 204):
            producer.seq += 1
        elif outcome.status == 409 and "producer-expected-seq" in outcome.headers:
            producer.seq = int(outcome.headers["producer-expected-seq"])
        elif outcome.status == 403 and "producer-epoch" in outcome.headers:
            producer.epoch, producer.seq = int(outcome.headers["producer-epoch"]) + 1, 0
        elif outcome.status == 400:
            producer.epoch, producer.seq = producer.epoch + 1, 0

    def open_statuses(self) -> set[int]:
        return {200, 204, 400, 403, 409}

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        super().judge(model, started, ended)
        outcome = ended.outcome
        _, epoch, seq = started.params["producer"]
        if outcome.status == 403:
            server_epoch = int(outcome.headers.get("producer-epoch", "-1") or -1)
            model.check(
                "producer-403",
                server_epoch > epoch,
                "producer-fencing",
                f"produce {started.name}: 403 for epoch {epoch}, but the server's epoch is {server_epoch}",
                [started.id],
            )
        elif outcome.status == 409 and not closed_flag(outcome):
            expected = outcome.headers.get("producer-expected-seq")
            states = model.states(started.name or "", started.time, ended.time)
            if expected is None and any(type_mismatch(s, started) for s in states if not s.closed):
                return  # a content-type mismatch, checked before the producer's seq (§5.2)
            model.check(
                "producer-409",
                expected is not None and int(expected) != seq,
                "producer-gap",
                f"produce {started.name}: 409 for seq {seq} with Producer-Expected-Seq {expected}",
                [started.id],
            )

    def accepted(
        self,
        model: Model,
        started: OpStarted,
        ended: OpEnded,
        append: SentAppend,
        inc: Incarnation,
        tail: int,
    ) -> None:
        outcome = ended.outcome
        pid, epoch, seq = started.params["producer"]
        echoed = (outcome.headers.get("producer-epoch"), outcome.headers.get("producer-seq"))
        if outcome.status == 200:
            model.check(
                "producer-echo",
                echoed == (str(epoch), str(seq)),
                "producer-headers",
                f"produce {started.name}: 200 for ({epoch}, {seq}) echoed Producer-Epoch/Seq {echoed}",
                [started.id],
            )
            model.ack(append, inc, tail, ended, started)
            return
        # 204: a duplicate. An earlier attempt of the same (id, epoch, seq) must have landed.
        earlier = append.verdicts[:-1]
        model.check(
            "duplicate-has-original",
            any(v in (OK, AMBIGUOUS) for v in earlier),
            "phantom-duplicate",
            f"produce {started.name}: 204 duplicate for ({pid}, {epoch}, {seq}), but no earlier attempt "
            f"of it could have been stored ({', '.join(earlier) or 'this was the first'})",
            [started.id, *append.attempts],
        )
        model.check(
            "producer-dup-seq",
            echoed[1] is not None and int(echoed[1]) >= seq,
            "producer-headers",
            f"produce {started.name}: duplicate of seq {seq} answered Producer-Seq {echoed[1]}",
            [started.id],
        )
        append.duplicate_of.append((inc, tail))
        model.tail_floor(inc, tail, started, ended, "duplicate")


@register
class Close(Operation):
    kind = "close"
    blocking = True
    mutator = True
    weight = 1.5

    def generate(self, ctx: GenContext) -> Planned | None:
        name = ctx.view.existing(ctx.rng, ("txt", "json", "bin", "ttl", "fork"))
        if name is None:
            return None
        params: dict[str, Any] = {"record": None}
        headers = {"Stream-Closed": "true"}
        body = b""
        if ctx.rng.random() < 0.4:
            content_type = ctx.view.streams[name].content_type
            key, body, stored, ids = record_for(ctx, content_type)
            params.update(record=key, stored=to_text(stored), record_ids=ids)
            headers["Content-Type"] = content_type
        return Planned(
            self.kind, name, params, Call("POST", PREFIX + name, headers=headers, body=to_text(body)), (name,)
        )

    def on_start(self, model: Model, started: OpStarted) -> None:
        register_body(model, started)

    def after(self, ctx: GenContext, planned: Planned, outcome: Outcome) -> None:
        if outcome.status in (204, 409):
            ctx.view.streams[planned.name or ""].closed = True
            ctx.view.saw_token(planned.name or "", outcome.headers.get("stream-next-offset"))

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        name, outcome = started.name or "", ended.outcome
        append = _attempt_ended(model, started, outcome)
        states = model.states(name, started.time, ended.time)
        allowed: set[int] = set()
        for s in states:
            if s.inc is None:
                allowed.add(404)
            elif s.soft:
                allowed.add(410)
            elif s.closed:
                allowed.add(409 if append is not None else 204)
            elif append is not None and type_mismatch(s, started):
                allowed.add(409)  # an append-and-close of the wrong type: nothing happens
            else:
                allowed.add(204)
        expect_status(model, started, ended, allowed, states)
        found = None
        # Only a 409 for a closed stream carries Stream-Closed and Stream-Next-Offset (§5.2); a
        # content-type mismatch's 409 carries neither.
        if outcome.status == 204 or (outcome.status == 409 and closed_flag(outcome)):
            found = header_token(model, started, ended, states)
        # A close of a stream already closed writes no record: its touch ends with the process.
        stored = outcome.status == 204 and not all(s.closed for s in states if s.inc is not None)
        touch(model, started, ended, states, found[0] if found else None, write=stored)
        if found is None:
            if outcome.verdict == AMBIGUOUS:
                model.change(
                    name, started, ended, lambda s: [s._replace(closed=True)] if s.inc and not s.soft else [s]
                )
            return
        inc, tail = found
        model.check(
            "close-says-closed",
            closed_flag(outcome),
            "missing-header",
            f"close {name}: {outcome.status} without Stream-Closed: true",
            [started.id],
        )
        if outcome.status == 204:
            open_before = any(s.inc is inc and not s.closed for s in states)
            if append is not None and open_before:
                model.ack(append, inc, tail, ended, started)
            else:
                model.tail_floor(inc, tail, started, ended, "close")
            model.close_at(inc, tail, started.id)
            model.change(name, started, ended, lambda s: [s._replace(closed=True)] if s.inc is inc else [s])
        else:
            model.check(
                "closed-possible",
                any(s.inc is inc and s.closed for s in states),
                "closed-without-close",
                f"close {name}: 409 closed from {inc.label()}, which no close could have closed",
                [started.id],
            )
            model.close_at(inc, tail, started.id)


@register
class Delete(Operation):
    kind = "delete"
    blocking = True
    mutator = True
    weight = 3

    def generate(self, ctx: GenContext) -> Planned | None:
        view, rng = ctx.view, ctx.rng
        big = [n for n, g in view.streams.items() if g.exists and g.size > 200_000]
        closed = [n for n, g in view.streams.items() if g.exists and g.closed]
        if big:
            name = rng.choice(big)
        elif closed and rng.random() < 0.5:
            name = rng.choice(closed)  # a closed stream takes no appends: make room for a new one
        else:
            name = view.existing(rng)
        if name is None:
            return None
        return Planned(self.kind, name, {}, Call("DELETE", PREFIX + name), (name,))

    def after(self, ctx: GenContext, planned: Planned, outcome: Outcome) -> None:
        if outcome.status in (204, 404, 410):
            guess = ctx.view.streams[planned.name or ""]
            guess.exists, guess.size, guess.closed = False, 0, False

    def on_start(self, model: Model, started: OpStarted) -> None:
        model.deletes_in_flight[started.id] = (started.name or "", started.time)

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        model.deletes_in_flight.pop(started.id, None)
        name, outcome = started.name or "", ended.outcome
        states = model.states(name, started.time, ended.time)
        allowed = {404 if s.inc is None else 410 if s.soft else 204 for s in states}
        expect_status(model, started, ended, allowed, states)
        if outcome.status == 404:
            model.narrow(name, started.time, ended.time, lambda s: s.inc is None)
        elif outcome.status == 410:
            model.narrow(name, started.time, ended.time, lambda s: s.soft)

        def effect(state: State) -> list[State]:
            inc = state.inc
            if inc is None or state.soft:
                return [state]
            if any(model.surely_live(f, ended.time) for f in inc.forks):
                return [state._replace(soft=True)]
            if any(model.maybe_live(f, ended.time) for f in inc.forks) or model.maybe_leaky(inc, ended.time):
                return [state._replace(soft=True), ABSENT]
            return [ABSENT]

        if outcome.status == 204 or outcome.verdict == AMBIGUOUS:
            model.change(name, started, ended, effect)


@register
class Head(Operation):
    kind = "head"
    weight = 4

    def generate(self, ctx: GenContext) -> Planned | None:
        name = ctx.rng.choice(list(ctx.view.streams))
        return Planned(self.kind, name, {}, Call("HEAD", PREFIX + name))

    def after(self, ctx: GenContext, planned: Planned, outcome: Outcome) -> None:
        guess = ctx.view.streams[planned.name or ""]
        if outcome.status == 200:
            guess.exists = True
            ctx.view.saw_token(planned.name or "", outcome.headers.get("stream-next-offset"))
            ctx.view.saw_content_type(planned.name or "", outcome.headers.get("content-type"))
        elif outcome.status == 404:
            guess.exists = False

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        name, outcome = started.name or "", ended.outcome
        states = model.states(name, started.time, ended.time)
        allowed = {404 if s.inc is None else 410 if s.soft else 200 for s in states}
        expect_status(model, started, ended, allowed, states)
        if outcome.status == 404:
            model.narrow(name, started.time, ended.time, lambda s: s.inc is None)
        if outcome.status != 200:
            return
        found = header_token(model, started, ended, states)
        if found is None:
            return
        inc, tail = found
        model.check(
            "head-content-type",
            outcome.headers.get("content-type", "").split(";")[0] == inc.content_type.split(";")[0],
            "content-type",
            f"head {name}: Content-Type {outcome.headers.get('content-type')!r}, created as {inc.content_type!r}",
            [started.id],
        )
        model.tail_floor(inc, tail, started, ended, "HEAD")
        earliest = parse_token(outcome.headers.get("stream-earliest-offset"))
        if earliest is not None and earliest[0] == inc.number:
            model.floor_seen(inc, earliest[1], started, ended, "HEAD")
        judge_closed_report(model, started, ended, states, inc, tail, closed_flag(outcome))
        model.narrow(name, started.time, ended.time, lambda s: s.inc is inc)


@register
class VanishAppend(Operation):
    """A writer that resets its connection: mid-body (the append cannot have happened) or right
    after sending it all (it may or may not have)."""

    kind = "vanish_append"
    status_kind = "append"
    blocking = True
    weight = 1

    def generate(self, ctx: GenContext) -> Planned | None:
        planned = REGISTRY["append"].generate(ctx)
        if planned is None:
            return None
        planned.op = self.kind
        planned.call.mode = ctx.rng.choice(("cut_body", "send_and_vanish"))
        return planned

    def on_start(self, model: Model, started: OpStarted) -> None:
        register_body(model, started)

    def judge(self, model: Model, started: OpStarted, ended: OpEnded) -> None:
        append = model.appends[started.params["record"]]
        model.attempt_ended(append, ended.outcome.verdict)
        if ended.outcome.status is not None:  # the server answered before the reset
            plain = REGISTRY["append"]
            assert isinstance(plain, _Append)
            plain.judge_answer(model, started, ended, append)
