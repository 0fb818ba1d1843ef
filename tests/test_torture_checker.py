"""The torture checker on hand-made histories: each violation it exists for must be reported, and a
history without one must pass (so the black box's "no findings" means something)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.torture.checker import check_history
from ops.torture.history import AMBIGUOUS, Call, Chunk, Event, History, Outcome, classify, to_text
from ops.torture.model import RunConfig

TEXT = {"Content-Type": "text/plain"}
A, B, C = 101, 202, 303  # incarnation numbers
BINARY = {"Content-Type": "application/octet-stream"}
NOT_DURABLE = json.dumps({"error": {"code": "not_durable", "message": "create was done, not durably"}})


def tok(inc: int, position: int) -> str:
    return f"{inc:016d}_{position:016d}"


def rec(record_id: str, fill: str = "xx") -> str:
    return f"{record_id}:{fill};"


class Script:
    """Builds a history with explicit times: each operation takes one time unit unless told."""

    def __init__(self) -> None:
        self.clock = 0.0
        self.history = History(clock=lambda: self.clock)

    def op(
        self,
        op: str,
        name: str | None,
        call: Call,
        outcome: Outcome,
        params: dict | None = None,
        *,
        at: float | None = None,
        took: float = 1.0,
    ) -> int:
        if at is not None:
            self.clock = at
        started = self.history.start(op, "w0", name, params or {}, call)
        self.clock += took
        if outcome.verdict == AMBIGUOUS and outcome.status is not None:
            pass
        outcome.verdict = classify(outcome.status, outcome.error, outcome.body)
        self.history.end(started, outcome)
        self.clock += 0.1
        return started.id

    def fault(self, kind: str, *, at: float | None = None) -> None:
        if at is not None:
            self.clock = at
        self.history.fault(kind)
        self.clock += 0.1

    def create(self, name: str, inc: int, status: int = 201, **kw: object) -> int:
        params = {"content_type": "text/plain", "ttl": None, "expires_at": None, "closed": False}
        headers = {"stream-next-offset": tok(inc, 0)} if status in (200, 201) else {}
        return self.op(
            "create",
            name,
            Call("PUT", f"/v1/stream/{name}", headers=TEXT),
            Outcome(status, headers),
            params,
            **kw,
        )  # type: ignore[arg-type]

    def append(
        self,
        name: str,
        record_id: str,
        status: int | None,
        inc: int = A,
        end: int | None = None,
        **kw: object,
    ) -> int:
        body = rec(record_id)
        params = {"record": record_id, "stored": body, "record_ids": [record_id]}
        headers = {"stream-next-offset": tok(inc, end)} if end is not None else {}
        outcome = Outcome(status, headers, error=None if status else "timeout")
        return self.op(
            "append", name, Call("POST", f"/v1/stream/{name}", headers=TEXT, body=body), outcome, params, **kw
        )  # type: ignore[arg-type]

    def produce(
        self,
        name: str,
        record_id: str,
        seq: int,
        status: int | None,
        end: int | None,
        inc: int = A,
        **kw: object,
    ) -> int:
        body = rec(record_id)
        params = {
            "record": record_id,
            "stored": body,
            "record_ids": [record_id],
            "producer": ["p", 0, seq],
            "content_type": "text/plain",
            "body": body,
        }
        headers = {"producer-epoch": "0", "producer-seq": str(seq)}
        if end is not None:
            headers["stream-next-offset"] = tok(inc, end)
        outcome = Outcome(status, headers, error=None if status else "closed")
        return self.op("produce", name, Call("POST", f"/v1/stream/{name}", body=body), outcome, params, **kw)  # type: ignore[arg-type]

    def read(
        self,
        name: str,
        offset: str,
        body: str,
        inc: int,
        end: int,
        status: int = 200,
        up_to_date: bool = True,
        final: bool = False,
        **kw: object,
    ) -> int:
        headers = {"stream-next-offset": tok(inc, end), "content-type": "text/plain"}
        if up_to_date:
            headers["stream-up-to-date"] = "true"
        call = Call("GET", f"/v1/stream/{name}", query={"offset": offset, "final": final})
        return self.op(
            "read", name, call, Outcome(status, headers, body), {"offset": offset, "final": final}, **kw
        )  # type: ignore[arg-type]

    def fork(
        self, name: str, source: str, status: int, inc: int | None = None, body: str = "", **sent: str
    ) -> int:
        params = {"source": source, "offset": None, "sub_offset": 0, "ttl": None}
        headers = {"stream-next-offset": tok(inc, 0)} if inc is not None else {}
        call = Call(
            "PUT", f"/v1/stream/{name}", headers={"Stream-Forked-From": f"/v1/stream/{source}", **sent}
        )
        return self.op("fork", name, call, Outcome(status, headers, body), params)

    def delete(self, name: str, status: int = 204, **kw: object) -> int:
        return self.op("delete", name, Call("DELETE", f"/v1/stream/{name}"), Outcome(status), **kw)  # type: ignore[arg-type]

    def check(self, config: RunConfig | None = None) -> list[str]:
        summary = check_history(list(self.history.events), config)
        return [f.kind for f in summary.findings]


def three_appends() -> Script:
    s = Script()
    s.create("txt/0", A)
    s.append("txt/0", "w0.1", 204, end=8)
    s.append("txt/0", "w0.2", 204, end=16)
    s.append("txt/0", "w0.3", 204, end=24)
    return s


def test_a_clean_history_has_no_findings() -> None:
    s = three_appends()
    s.read("txt/0", "-1", rec("w0.1") + rec("w0.2"), A, 16, up_to_date=False)
    s.read("txt/0", tok(A, 16), rec("w0.3"), A, 24)
    s.op(
        "head",
        "txt/0",
        Call("HEAD", "/v1/stream/txt/0"),
        Outcome(200, {"stream-next-offset": tok(A, 24), "content-type": "text/plain"}),
    )
    assert s.check() == []


def test_a_lost_acknowledged_append_is_reported() -> None:
    s = three_appends()
    s.fault("kill")
    s.fault("restart")
    s.op(
        "head",
        "txt/0",
        Call("HEAD", "/v1/stream/txt/0"),
        Outcome(200, {"stream-next-offset": tok(A, 16), "content-type": "text/plain"}),
    )
    s.read("txt/0", "-1", rec("w0.1") + rec("w0.2"), A, 16, final=True)  # the third is gone
    found = s.check()
    assert "tail-went-back" in found and "lost-append" in found


def test_a_lost_append_is_reported_even_when_the_tail_looks_right() -> None:
    s = three_appends()
    s.read("txt/0", "-1", rec("w0.1") + rec("w0.9") + rec("w0.3"), A, 24)  # w0.2 replaced
    found = s.check()
    assert "ack-not-at-position" in found and "foreign-bytes" in found


def test_a_duplicate_is_reported() -> None:
    s = three_appends()
    s.append("txt/0", "w0.4", None)  # ambiguous: at most once
    s.read("txt/0", "-1", rec("w0.1") + rec("w0.2") + rec("w0.3") + rec("w0.4") + rec("w0.4"), A, 40)
    assert "duplicate" in s.check()


def test_an_ambiguous_append_may_land_once_or_not_at_all() -> None:
    for body, end in ((rec("w0.4"), 32), ("", 24)):
        s = three_appends()
        s.append("txt/0", "w0.4", None)
        s.read("txt/0", "-1", rec("w0.1") + rec("w0.2") + rec("w0.3") + body, A, end)
        assert s.check() == []


def test_a_failed_append_that_shows_up_is_reported() -> None:
    s = three_appends()
    s.append("txt/0", "w0.4", 409)  # definitely failed (and wrong for an open stream too)
    s.read("txt/0", "-1", rec("w0.1") + rec("w0.2") + rec("w0.3") + rec("w0.4"), A, 32)
    assert "failed-append-present" in s.check()


def test_a_read_from_the_wrong_incarnation_is_reported() -> None:
    s = three_appends()
    s.delete("txt/0")
    s.create("txt/0", B)
    s.append("txt/0", "w0.5", 204, inc=B, end=8)
    # A reader resuming with a token of the deleted incarnation must get 410, never B's data.
    s.read("txt/0", tok(A, 0), rec("w0.5"), B, 8)
    assert "wrong-incarnation" in s.check()


def test_data_of_a_deleted_incarnation_is_reported() -> None:
    s = three_appends()
    s.delete("txt/0")
    s.create("txt/0", B)
    s.read("txt/0", "-1", rec("w0.1"), A, 8, up_to_date=False)  # the old stream's bytes
    assert "wrong-incarnation" in s.check()


def test_a_500_is_reported() -> None:
    s = three_appends()
    s.op(
        "append",
        "txt/0",
        Call("POST", "/v1/stream/txt/0", body=rec("w0.4")),
        Outcome(500, body='{"error":{}}'),
        {"record": "w0.4", "stored": rec("w0.4"), "record_ids": ["w0.4"]},
    )
    assert "500" in s.check()


def test_an_out_of_order_offset_is_reported() -> None:
    s = three_appends()
    chunks = [
        Chunk(10.0, rec("w0.1"), tok(A, 8), False, False),
        Chunk(10.1, rec("w0.2"), tok(A, 4), False, False),  # went backwards
    ]
    s.op(
        "sse",
        "txt/0",
        Call("GET", "/v1/stream/txt/0", query={"offset": "-1", "live": "sse"}, mode="sse"),
        Outcome(200, {}, chunks=chunks),
        {"offset": "-1"},
    )
    assert "offset-order" in s.check()


def test_appends_stored_against_real_time_order_are_reported() -> None:
    s = Script()
    s.create("txt/0", A)
    s.append("txt/0", "w0.1", 204, end=8)
    s.append("txt/0", "w0.2", None)  # sent after w0.1 was acknowledged, ambiguous
    s.read("txt/0", "-1", rec("w0.2") + rec("w0.1"), A, 16)  # yet stored first
    found = s.check()
    assert "ack-not-at-position" in found or "order" in found


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("not_ready", "the server is not ready yet: recovering"),
        # A delete while a start that served early still reads streams (stream_ops._remove).
        ("recovering", "the server is still reading 3 streams from disk after a start; retry shortly"),
    ],
)
def test_not_ready_is_explained_by_a_restart_still_recovering_and_by_nothing_else(
    code: str, message: str
) -> None:
    """A restarted server answers 503 not_ready (or recovering) while it reads its data directory
    back; the rig and the sim record the restart only once that is over (rig.Server.start,
    sim._restarted), so the down window covers it."""
    error = json.dumps({"error": {"code": code, "message": message}})

    def append_during(faults: list[tuple[str, float]]) -> list[str]:
        s = three_appends()
        for kind, at in faults:
            s.fault(kind, at=at)
        s.op(
            "append",
            "txt/0",
            Call("POST", "/v1/stream/txt/0"),
            Outcome(503, body=error),
            {"record": "w0.4", "stored": rec("w0.4"), "record_ids": ["w0.4"]},
            at=20.0,
        )
        return s.check()

    assert append_during([("kill", 19.0), ("restart", 22.0)]) == []
    assert append_during([]) == ["unexplained-503"]
    assert append_during([("kill", 5.0), ("restart", 6.0)]) == ["unexplained-503"]  # long over
    assert append_during([("disk_full", 19.0), ("disk_freed", 22.0)]) == ["unexplained-503"]


def test_a_503_needs_a_fault() -> None:
    error = json.dumps(
        {"error": {"code": "storage_unavailable", "message": "Bad file descriptor; retry shortly"}}
    )
    s = three_appends()
    s.op(
        "append",
        "txt/0",
        Call("POST", "/v1/stream/txt/0"),
        Outcome(503, body=error),
        {"record": "w0.4", "stored": rec("w0.4"), "record_ids": ["w0.4"]},
    )
    assert "unexplained-503" in s.check()
    s = three_appends()
    s.fault("disk_full")
    s.op(
        "append",
        "txt/0",
        Call("POST", "/v1/stream/txt/0"),
        Outcome(503, body=error),
        {"record": "w0.4", "stored": rec("w0.4"), "record_ids": ["w0.4"]},
    )
    s.fault("disk_freed")
    assert s.check() == []


def test_the_server_must_answer_health_probes_unless_killed() -> None:
    s = Script()
    s.op("healthz", None, Call("GET", "/healthz"), Outcome(None, error="refused"))
    assert s.check() == ["server-down"]
    s = Script()
    s.fault("kill")
    s.op("healthz", None, Call("GET", "/healthz"), Outcome(None, error="refused"))
    s.fault("restart")
    s.op("healthz", None, Call("GET", "/healthz"), Outcome(200, body="ok"), at=5.0)
    assert s.check() == []


def test_producer_retries_are_exactly_once() -> None:
    s = Script()
    s.create("txt/0", A)
    s.produce("txt/0", "w0.1", 0, None, None)  # lost in a kill
    s.produce("txt/0", "w0.1", 0, 204, 8)  # the retry: a duplicate, so the first landed
    s.produce("txt/0", "w0.2", 1, 200, 16)
    s.read("txt/0", "-1", rec("w0.1") + rec("w0.2"), A, 16)
    assert s.check() == []
    s = Script()
    s.create("txt/0", A)
    s.produce("txt/0", "w0.1", 0, 204, 0)  # a duplicate of something never sent
    assert "phantom-duplicate" in s.check()
    s = Script()
    s.create("txt/0", A)
    s.produce("txt/0", "w0.1", 0, None, None)
    s.produce("txt/0", "w0.1", 0, 200, 16)  # answered as new data although the first landed
    s.read("txt/0", "-1", rec("w0.1") + rec("w0.1"), A, 16)
    assert "duplicate" in s.check()


def test_durability_follows_the_fsync_contract() -> None:
    def lost_in_power_cut() -> Script:
        s = Script()
        s.create("txt/0", A)
        s.append("txt/0", "w0.1", 204, end=8, at=1.0)
        s.append("txt/0", "w0.2", 204, end=16, at=9.5)  # just before the cut
        s.fault("power_cut", at=10.0)
        s.fault("restart", at=10.5)
        s.read("txt/0", "-1", rec("w0.1"), A, 8, at=11.0, final=True)
        return s

    assert lost_in_power_cut().check(RunConfig(fsync="interval", fsync_interval=1.0)) == []
    assert "lost-append" in lost_in_power_cut().check(RunConfig(fsync="always"))


def test_bytes_no_client_sent_are_reported() -> None:
    s = three_appends()
    s.read("txt/0", tok(A, 24), "garbage;", A, 32)
    assert "foreign-bytes" in s.check()


def test_a_history_survives_a_dump_and_is_judged_the_same(tmp_path: Path) -> None:
    s = three_appends()
    s.read("txt/0", "-1", rec("w0.1") + rec("w0.2"), A, 16)
    s.history.dump(tmp_path / "h.jsonl")
    _, events = History.load(tmp_path / "h.jsonl")
    loaded: list[Event] = events
    assert [f.kind for f in check_history(loaded).findings] == s.check() == ["stale-up-to-date"]
    assert to_text(b"\xff\x00") == "\xff\x00"


def test_a_404_for_a_stream_that_surely_exists_is_reported() -> None:
    s = three_appends()
    s.append("txt/0", "w0.4", 404)
    assert "wrong-status" in s.check()


def test_a_stream_reported_closed_that_nobody_closed_is_reported() -> None:
    s = three_appends()
    headers = {"stream-next-offset": tok(A, 24), "stream-up-to-date": "true", "stream-closed": "true"}
    call = Call("GET", "/v1/stream/txt/0", query={"offset": tok(A, 24)})
    s.op("read", "txt/0", call, Outcome(200, headers, ""), {"offset": tok(A, 24)})
    assert "closed-without-close" in s.check()


def test_an_up_to_date_answer_behind_the_tail_is_reported() -> None:
    s = three_appends()
    s.read("txt/0", tok(A, 8), rec("w0.2"), A, 16)  # says up to date; w0.3 was acknowledged before
    assert s.check() == ["stale-up-to-date"]


def sse_with_an_append_between(lag: float) -> Script:
    """An SSE reader gets w0.1 up to date at 2.0, w0.2 is acknowledged at 3.0, and the next event
    says up to date at w0.2's start ... `lag` seconds after w0.2's acknowledgement: an event the
    server may have written together with the first one (arriving late on a loaded machine), or,
    long after, a stale one."""
    s = Script()
    s.create("txt/0", A)
    s.clock = 1.5
    call = Call("GET", "/v1/stream/txt/0", query={"offset": tok(A, 0), "live": "sse"}, mode="sse")
    started = s.history.start("sse", "w1", "txt/0", {"offset": tok(A, 0)}, call)
    s.append("txt/0", "w0.1", 204, end=8, at=1.6, took=0.2)
    s.append("txt/0", "w0.2", 204, end=16, at=2.1, took=0.9)  # acknowledged at 3.0
    chunks = [
        Chunk(2.0, rec("w0.1"), tok(A, 8), True, False),
        Chunk(3.0 + lag, "", tok(A, 8), True, False),  # still "up to date" at 8
    ]
    s.clock = 3.0 + lag + 0.1
    outcome = Outcome(200, {}, chunks=chunks)
    outcome.verdict = classify(200)
    s.history.end(started, outcome)
    return s


def test_an_sse_event_behind_an_earlier_acknowledgement_is_stale_past_the_delivery_skew() -> None:
    # w0.2 was acknowledged at 3.0, one second after the first event arrived (2.0): an event
    # arriving 1.5 s after that acknowledgement could not have been written with the first.
    assert "tail-went-back" in sse_with_an_append_between(lag=1.5).check()
    # 0.2 s after: the server may have written both events before w0.2 landed (CI, seed 10).
    assert sse_with_an_append_between(lag=0.2).check() == []


def test_an_append_that_never_finished_its_body_must_not_appear() -> None:
    s = three_appends()
    params = {"record": "w0.4", "stored": rec("w0.4"), "record_ids": ["w0.4"]}
    call = Call("POST", "/v1/stream/txt/0", body=rec("w0.4"), mode="cut_body")
    s.op("vanish_append", "txt/0", call, Outcome(None, error="body_cut"), params)
    s.read("txt/0", "-1", rec("w0.1") + rec("w0.2") + rec("w0.3") + rec("w0.4"), A, 32)
    assert "failed-append-present" in s.check()


def test_a_create_whose_answer_was_lost_may_land_where_a_soft_deleted_stream_was_reaped() -> None:
    # Seeds 102 and 249: the timeline holds "soft-deleted" for a source whose last fork is gone
    # (the server may have reaped it: `states` adds ABSENT), and a create answered 503 not_durable
    # (done, maybe not durably) there. The stream it made must be known, not "unknown-incarnation".
    s = Script()
    s.create("txt/1", A)
    s.fork("fork/0", "txt/1", 201, inc=B)
    s.delete("txt/1")  # soft: fork/0 reads it
    s.delete("fork/0")  # the last fork: txt/1 may be reaped
    s.fault("disk_faults")  # a directory fsync fails: the create is done but maybe not durably
    s.op(
        "create",
        "txt/1",
        Call("PUT", "/v1/stream/txt/1", headers=TEXT),
        Outcome(503, body=NOT_DURABLE),
        {"content_type": "text/plain", "ttl": None, "expires_at": None, "closed": False},
    )
    s.create("txt/1", C, status=200)
    s.append("txt/1", "w0.1", 204, inc=C, end=8)
    assert s.check() == []


def _fork_of_binary_lost() -> Script:
    """fork/0 of a binary stream whose answer was lost: clients still think it is text/plain."""
    s = Script()
    params = {"content_type": "application/octet-stream", "ttl": None, "expires_at": None, "closed": False}
    s.op(
        "create",
        "bin/0",
        Call("PUT", "/v1/stream/bin/0", headers=BINARY),
        Outcome(201, {"stream-next-offset": tok(A, 0)}),
        params,
    )
    s.fault("disk_faults")
    s.fork("fork/0", "bin/0", 503, body=NOT_DURABLE)
    s.fault("disk_healed")
    return s


def test_a_content_type_mismatch_is_a_409_without_offset_or_producer_headers() -> None:
    # Seeds 168 and 231: the server answers an append, a produce and an append-and-close of the
    # wrong type with 409 content_type_mismatch (§5.2), which carries no Stream-Next-Offset and no
    # Producer-Expected-Seq (only a closed stream's 409 and a sequence gap's do).
    mismatch = json.dumps({"error": {"code": "content_type_mismatch", "message": "..."}})
    s = _fork_of_binary_lost()
    s.append("fork/0", "w0.1", 409)
    s.op(
        "produce",
        "fork/0",
        Call("POST", "/v1/stream/fork/0", headers=TEXT, body=rec("w0.2")),
        Outcome(409, body=mismatch),
        {
            "record": "w0.2",
            "stored": rec("w0.2"),
            "record_ids": ["w0.2"],
            "producer": ["p", 0, 0],
            "content_type": "text/plain",
            "body": rec("w0.2"),
        },
    )
    close = Call("POST", "/v1/stream/fork/0", headers={"Stream-Closed": "true", **TEXT}, body=rec("w0.3"))
    s.op(
        "close",
        "fork/0",
        close,
        Outcome(409, body=mismatch),
        {"record": "w0.3", "stored": rec("w0.3"), "record_ids": ["w0.3"]},
    )
    assert s.check() == []
    # The same 409 from a stream of the type the append names is still wrong.
    s = three_appends()
    s.append("txt/0", "w0.4", 409)
    assert "wrong-status" in s.check()
    # And a producer's 409 for a stream of its own type must be a sequence gap, with its headers.
    s = three_appends()
    s.produce("txt/0", "w0.4", 0, 409, None)
    assert "producer-gap" in s.check()
    # A fork that names a Content-Type other than its source's is refused with 409 (§4.2).
    s = _fork_of_binary_lost()
    s.fork("fork/1", "bin/0", 409, body=mismatch, **{"Content-Type": "text/plain"})
    assert s.check() == []
    s = _fork_of_binary_lost()
    s.fork("fork/1", "bin/0", 201, inc=B, **{"Content-Type": "text/plain"})
    assert "wrong-status" in s.check()


def test_a_disk_filled_while_a_mutator_ran_explains_its_507() -> None:
    """A create, fork, close or delete is judged as soon as it ends; a disk filled while it ran
    (the fault event between its start and its end) must explain its 507 (sim seed 294)."""
    full = json.dumps({"error": {"code": "storage_full", "message": "the disk has 7758 bytes free"}})
    s = Script()
    params = {"content_type": "text/plain", "ttl": None, "expires_at": None, "closed": False}
    started = s.history.start("create", "w0", "txt/0", params, Call("PUT", "/v1/stream/txt/0", headers=TEXT))
    s.clock += 0.5
    s.fault("disk_full")
    s.clock += 0.5
    s.history.end(started, Outcome(507, body=full, verdict=classify(507)))
    s.clock += 1.0
    s.fault("disk_freed")
    assert s.check() == []
    s = Script()
    s.op("create", "txt/0", Call("PUT", "/v1/stream/txt/0", headers=TEXT), Outcome(507, body=full), params)
    s.fault("disk_full")
    assert s.check() == ["unexplained-503"]


# ---- retention and compaction (issue 13) ------------------------------------------------------

RETENTION = RunConfig(retention=True)
GONE = json.dumps({"error": {"code": "offset_before_floor", "message": "dropped by retention"}})


def head_with_floor(s: Script, name: str, inc: int, tail: int, floor: int) -> None:
    headers = {
        "stream-next-offset": tok(inc, tail),
        "content-type": "text/plain",
        "stream-earliest-offset": tok(inc, floor),
    }
    s.op("head", name, Call("HEAD", f"/v1/stream/{name}"), Outcome(200, headers))


def gone(s: Script, name: str, offset: str, floor: str) -> None:
    call = Call("GET", f"/v1/stream/{name}", query={"offset": offset})
    s.op("read", name, call, Outcome(410, {"stream-earliest-offset": floor}, GONE), {"offset": offset})


def test_a_retained_history_is_clean_and_excuses_only_what_lies_below_the_floor() -> None:
    s = three_appends()
    head_with_floor(s, "txt/0", A, 24, 8)
    gone(s, "txt/0", tok(A, 0), tok(A, 8))
    s.read("txt/0", "-1", rec("w0.2") + rec("w0.3"), A, 24, final=True)
    assert s.check(RETENTION) == []
    # The same history judged without retention: a 410 for a live stream, a read from -1 not at 0.
    assert {"wrong-status", "offset-arithmetic"} <= set(s.check())


def test_an_append_above_the_floor_is_still_owed() -> None:
    s = three_appends()
    s.read("txt/0", "-1", rec("w0.2"), A, 16, final=True)  # from the floor 8, w0.3 missing
    assert "lost-append" in s.check(RETENTION) or "tail-went-back" in s.check(RETENTION)


def test_a_floor_that_goes_back_is_reported() -> None:
    s = three_appends()
    head_with_floor(s, "txt/0", A, 24, 16)
    s.read("txt/0", "-1", rec("w0.2") + rec("w0.3"), A, 24)  # starts at 8: below the floor shown
    assert "floor-went-back" in s.check(RETENTION)


def test_a_410_at_or_above_the_floor_is_reported() -> None:
    s = three_appends()
    gone(s, "txt/0", tok(A, 16), tok(A, 8))
    assert "gone-above-floor" in s.check(RETENTION)


def state_message(record_id: str, key: str, fill: str = "xx") -> dict:
    return {
        "id": record_id,
        "f": fill,
        "type": "row",
        "key": key,
        "value": record_id,
        "headers": {"operation": "upsert"},
    }


def json_history(snapshot_value: str) -> Script:
    """k0 set by w0.1 then w0.3, k1 by w0.2; a snapshot at the tail claims k0 holds `snapshot_value`."""
    from ops.torture.payloads import canonical

    s = Script()
    json_type = {"Content-Type": "application/json"}
    params = {"content_type": "application/json", "ttl": None, "expires_at": None, "closed": False}
    s.op(
        "create",
        "json/0",
        Call("PUT", "/v1/stream/json/0", headers=json_type),
        Outcome(201, {"stream-next-offset": tok(A, 0)}),
        params,
    )
    messages = [state_message("w0.1", "k0"), state_message("w0.2", "k1"), state_message("w0.3", "k0")]
    end = 0
    for message in messages:
        stored = canonical(message).decode()
        end += len(stored)
        params = {"record": message["id"], "stored": stored, "record_ids": [message["id"]]}
        outcome = Outcome(204, {"stream-next-offset": tok(A, end)})
        s.op(
            "append",
            "json/0",
            Call("POST", "/v1/stream/json/0", headers=json_type, body=stored),
            outcome,
            params,
        )
    snapshot = [
        {"headers": {"control": "snapshot-start", "offset": tok(A, end)}},
        {"type": "row", "key": "k0", "value": snapshot_value, "headers": {"operation": "insert"}},
        {"type": "row", "key": "k1", "value": "w0.2", "headers": {"operation": "insert"}},
        {"headers": {"control": "snapshot-end", "offset": tok(A, end)}},
    ]
    everything = messages + snapshot
    tail = end + sum(len(canonical(m)) for m in snapshot)
    headers = {
        "stream-next-offset": tok(A, tail),
        "content-type": "application/json",
        "stream-up-to-date": "true",
    }
    call = Call("GET", "/v1/stream/json/0", query={"offset": "-1"})
    s.op("read", "json/0", call, Outcome(200, headers, json.dumps(everything)), {"offset": "-1"})
    return s


def test_a_snapshot_is_judged_against_the_changes_before_it() -> None:
    assert json_history("w0.3").check(RETENTION) == []
    assert "snapshot-wrong" in json_history("w0.1").check(RETENTION)  # an older value of k0


# ---- the registry (issue 14) ------------------------------------------------------------------


def registry_read(s: Script, entries: list[dict]) -> None:
    headers = {
        "stream-next-offset": tok(C, 100),
        "content-type": "application/json",
        "stream-up-to-date": "true",
    }
    call = Call("GET", "/v1/stream/__registry__", query={"offset": "-1"})
    s.op(
        "registry_read",
        "__registry__",
        call,
        Outcome(200, headers, json.dumps(entries)),
        {"offset": "-1", "final": True},
    )


def entry(name: str, operation: str = "insert") -> dict:
    message: dict = {"type": "stream", "key": name, "headers": {"operation": operation}}
    if operation != "delete":
        message["value"] = {"path": name, "contentType": "text/plain", "createdAt": 1}
    return message


def test_the_registry_must_list_exactly_the_live_streams() -> None:
    def history() -> Script:
        s = three_appends()  # txt/0 lives
        s.create("txt/1", B)
        s.delete("txt/1")  # txt/1 is gone
        return s

    s = history()
    registry_read(s, [entry("txt/0"), entry("txt/1"), entry("txt/1", "delete")])
    assert s.check() == []
    s = history()
    registry_read(s, [entry("txt/0"), entry("txt/1")])  # the delete never made it
    assert "registry" in s.check()
    s = history()
    registry_read(s, [entry("txt/1"), entry("txt/1", "delete")])  # the live one is missing
    assert "registry" in s.check()


def test_a_source_reaped_by_a_fork_delete_still_running_may_answer_404() -> None:
    """Sim seed 3098: a fork's delete reaped its soft-deleted source; the source's own delete,
    started after and ended before the fork's answer, got 404. Mutators are judged when they end,
    so the fork's delete, still in flight, must count as maybe done."""
    s = Script()
    s.create("txt/0", A)
    s.fork("fork/0", "txt/0", 201, inc=B)
    s.delete("txt/0")  # soft: its fork reads it
    history = s.history
    fork_delete = history.start("delete", "w1", "fork/0", {}, Call("DELETE", "/v1/stream/fork/0"))
    s.clock += 0.1
    source_delete = history.start("delete", "w0", "txt/0", {}, Call("DELETE", "/v1/stream/txt/0"))
    s.clock += 0.1
    gone = json.dumps({"error": {"code": "stream_not_found", "message": "no such stream"}})
    history.end(source_delete, Outcome(404, {}, gone, verdict="failed"))
    s.clock += 0.1
    history.end(fork_delete, Outcome(204, {}, verdict="ok"))
    assert s.check() == []


def test_a_delete_not_made_durable_may_come_back_after_a_power_cut() -> None:
    """Sim seed 5161: a delete answered 503 not_durable, a read then got 404, and the power cut
    that followed brought the stream back, as the answer allowed."""
    s = three_appends()
    not_durable = json.dumps({"error": {"code": "not_durable", "message": "delete was done, not durably"}})
    s.fault("disk_faults")  # directory syncs fail: what explains the 503
    s.op("delete", "txt/0", Call("DELETE", "/v1/stream/txt/0"), Outcome(503, {}, not_durable))
    gone = json.dumps({"error": {"code": "stream_not_found", "message": "no such stream"}})
    s.op("head", "txt/0", Call("HEAD", "/v1/stream/txt/0"), Outcome(404, {}, gone))
    s.fault("power_cut")
    s.fault("restart")
    back = {"stream-next-offset": tok(A, 24), "content-type": "text/plain"}
    s.op("head", "txt/0", Call("HEAD", "/v1/stream/txt/0"), Outcome(200, back))
    assert s.check() == []
    # Without the power cut, the stream coming back is a finding.
    t = three_appends()
    t.fault("disk_faults")
    t.op("delete", "txt/0", Call("DELETE", "/v1/stream/txt/0"), Outcome(503, {}, not_durable))
    t.op("head", "txt/0", Call("HEAD", "/v1/stream/txt/0"), Outcome(404, {}, gone))
    t.op("head", "txt/0", Call("HEAD", "/v1/stream/txt/0"), Outcome(200, back))
    assert t.check() != []
