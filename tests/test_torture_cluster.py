"""A short slice of the black-box torture tier on a cluster (ops/torture/cluster.py, issue 16): two
members behind HAProxy, one killed or stopped at a time, some kills aimed at a fork whose source
lives on the other member while it is being created or deleted; about 60 s in all, more on a
loaded machine: the run goes on past its 35 s until it has killed twice, stopped once and killed
during a cross-member fork create (`MINIMUM_FAULTS`; at most three times as long), so what the
first test counts does not depend on how fast members restart. It needs root (a tmpfs mount) and
haproxy.

The first tests make sure the slice did what it claims (kills happened, some mid-fork; forks were
created across members both ways; the other member kept answering; the pin count was taken), so
the last, "no findings", cannot pass by doing nothing.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from ops.torture.blackbox import Options, Result, format_summary
from ops.torture.checker import check_history
from ops.torture.cluster import MINIMUM_FAULTS, RUN_ON, ClusterRun, haproxy_binary, member_faults, run
from ops.torture.history import Call, History, Outcome
from ops.torture.model import RunConfig
from ops.torture.operations.cluster import PINS
from streamkeep.cluster.placement import Member, Placement
from tests.test_torture_checker import TEXT, A, B, Script, tok

CREATED = {"content_type": "text/plain", "ttl": None, "expires_at": None, "closed": False}

# Seed 57's schedule has four kills aimed at a cross-member fork create (ops/torture/cluster.py,
# member_faults; each lands within the create's 1-3 ms more often than not) besides plain kills and
# stops, so at least one lands while the fork is in flight.
OPTIONS = Options(seed=57, duration=35, fsync="always", disk="tmpfs", cold=True, cluster=2)


@pytest.fixture(scope="module")
def result() -> Result:
    if haproxy_binary() is None:
        pytest.fail("haproxy is missing: make system-tools installs it (apt-get install haproxy)")
    done = run(OPTIONS, log=lambda _line: None)
    print(format_summary(done))
    return done


def test_members_were_killed_and_stopped_some_in_the_middle_of_a_fork(result: Result) -> None:
    counts = result.cluster
    for name, least in MINIMUM_FAULTS.items():
        assert counts[name] >= least, counts
    assert MINIMUM_FAULTS["member kills"] >= 2 and MINIMUM_FAULTS["member stops"] >= 1
    assert MINIMUM_FAULTS["kills during a cross-member fork create"] >= 1
    assert result.summary.faults["restart"] >= counts["member kills"] + counts["member stops"]


def test_forks_were_made_across_members_both_ways_and_the_other_member_kept_answering(result: Result) -> None:
    counts = result.cluster
    assert counts["cross-member fork attempts a->b"] >= 1 and counts["cross-member fork attempts b->a"] >= 1
    assert counts["cross-member forks created"] >= 1, counts
    assert counts["answers from up members while another was down"] > 0, counts
    checks = result.summary.checks
    assert checks["pins-exact"] == 2, "the pin count of each member was not taken at the end"
    assert checks["fork-count-exact"] > 0
    for check in ("acked-present", "bytes-compared", "fault-status", "server-up"):
        assert checks[check] > 0, f"the checker never checked {check}"


def test_no_findings(result: Result) -> None:
    findings = [str(f) for f in result.summary.findings]
    dumped = f" (history: {result.dumped})" if result.dumped else ""
    assert not findings, f"{OPTIONS.replay()}{dumped}:\n" + "\n".join(findings)


def test_the_run_goes_on_until_its_minimum_faults_happened() -> None:
    """`workload_done` past the duration: not before the minimum faults are in the history (kills
    and stops counted as `cluster_counts` counts them), and at `RUN_ON` times the duration anyway.
    The longer schedule that feeds it begins with the planned one."""
    ids = ("a", "b")
    planned = member_faults(OPTIONS, ids, random.Random("57/faults"))
    longer = member_faults(OPTIONS, ids, random.Random("57/faults"), until=RUN_ON * OPTIONS.duration)
    assert longer[: len(planned)] == planned and longer[-1].at > OPTIONS.duration
    clock = [0.0]
    history = History(clock=lambda: clock[0])
    cluster = ClusterRun.__new__(ClusterRun)  # the bookkeeping only: no processes, no mounts
    cluster.options, cluster.history, cluster.minimum_met = OPTIONS, history, False
    cluster.placement = Placement.of([Member(m, "127.0.0.1:1") for m in ids], 1)
    duration = OPTIONS.duration
    assert not cluster.workload_done(duration - 1) and not cluster.workload_done(duration)
    for at, kind, member in ((1.0, "kill", "a"), (2.0, "term", "b")):
        clock[0] = at
        history.fault(kind, member=member)
    clock[0] = 3.0
    fork = Call("PUT", "/v1/stream/fork/0", headers={"Stream-Forked-From": "/v1/stream/txt/0"})
    params = {"source": "txt/0", "offset": None, "sub_offset": 0, "ttl": None}
    started = history.start("fork", "w0", "fork/0", params, fork)  # fork/0 on b, txt/0 on a
    clock[0] = 3.5
    assert not cluster.workload_done(duration)
    history.fault("kill", member="a", during="fork fork/0")
    clock[0] = 4.0
    history.end(started, Outcome(None, error="reset", verdict="ambiguous"))
    assert cluster.workload_done(duration) and not cluster.workload_done(duration - 1)
    cluster.minimum_met = False
    cluster.history = History()
    assert cluster.workload_done(RUN_ON * duration)


def test_the_cluster_rig_leaves_nothing_mounted() -> None:
    mounts = Path("/proc/mounts").read_text()
    assert f"torture-{OPTIONS.seed}-" not in mounts


# ---- the cluster rules of the model, on hand-made histories (no processes) ----------------------

CLUSTER = RunConfig(members=("a", "b"))  # txt/0 and fork/3 live on a; txt/3 and fork/0 on b
UNAVAILABLE = json.dumps({"error": {"code": "owner_unavailable", "message": "the process ... retry"}})
PEER_DOWN = json.dumps(
    {"error": {"code": "member_unavailable", "message": "cluster member 'a' is not reachable (ConnectError)"}}
)


RETRY = {"retry-after": "1"}


def member_fault(script: Script, kind: str, member: str, **detail: object) -> None:
    script.history.fault(kind, member=member, **detail)
    script.clock += 0.1


def kinds(script: Script) -> list[str]:
    return [f.kind for f in check_history(script.history.events, CLUSTER).findings]


def test_a_down_members_streams_may_answer_503_and_the_other_members_may_not() -> None:
    s = Script()
    s.op(
        "create",
        "txt/3",
        Call("PUT", "/v1/stream/txt/3", headers=TEXT),
        Outcome(201, {"stream-next-offset": tok(A, 0)}),
        CREATED,
    )
    member_fault(s, "kill", "b")
    s.op("head", "txt/3", Call("HEAD", "/v1/stream/txt/3"), Outcome(503, RETRY, body=UNAVAILABLE))
    member_fault(s, "restart", "b")
    s.op(
        "head",
        "txt/3",
        Call("HEAD", "/v1/stream/txt/3"),
        Outcome(503, RETRY, body=UNAVAILABLE),
        at=s.clock + 1,
    )
    assert kinds(s) == []  # HAProxy notices a member is back within its health-check grace
    member_fault(s, "kill", "a")
    s.op(
        "head",
        "txt/3",
        Call("HEAD", "/v1/stream/txt/3"),
        Outcome(503, RETRY, body=UNAVAILABLE),
        at=s.clock + 10,
    )
    s.op("head", "txt/3", Call("HEAD", "/v1/stream/txt/3"), Outcome(502, body="<html>502 Bad Gateway</html>"))
    assert kinds(s) == ["unexplained-503", "unexplained-proxy-error"]
    s.op("head", "txt/0", Call("HEAD", "/v1/stream/txt/0"), Outcome(503, body=UNAVAILABLE))
    assert kinds(s)[-1] == "no-retry-after"


def test_a_source_that_may_keep_a_leaked_pin_may_be_soft_deleted_and_only_then() -> None:
    def history(leak: bool) -> Script:
        s = Script()
        s.op(
            "create",
            "txt/0",
            Call("PUT", "/v1/stream/txt/0", headers=TEXT),
            Outcome(201, {"stream-next-offset": tok(A, 0)}),
            CREATED,
        )
        fork = Call("PUT", "/v1/stream/fork/0", headers={"Stream-Forked-From": "/v1/stream/txt/0"})
        params = {"source": "txt/0", "offset": None, "sub_offset": 0, "ttl": None}
        if leak:  # a's member died after pinning the fork and before answering
            member_fault(s, "kill", "a")
            s.op("fork", "fork/0", fork, Outcome(503, RETRY, body=PEER_DOWN), params)
            member_fault(s, "restart", "a")
        else:
            s.op("fork", "fork/0", fork, Outcome(201, {"stream-next-offset": tok(B, 0)}), params)
            s.op("delete", "fork/0", Call("DELETE", "/v1/stream/fork/0"), Outcome(204))
        s.op("delete", "txt/0", Call("DELETE", "/v1/stream/txt/0"), Outcome(204))
        s.op(
            "create",
            "txt/0",
            Call("PUT", "/v1/stream/txt/0", headers=TEXT),
            Outcome(409, body='{"error": {"code": "stream_soft_deleted"}}'),
            CREATED,
        )
        return s

    assert kinds(history(leak=True)) == []
    assert kinds(history(leak=False)) == ["wrong-status"]


def pins_history(pins_on_a: int) -> Script:
    streams = {
        "a": [{"name": "txt/0", "forked_from": None, "fork_count": 1, "deleted": True, "expired": False}],
        "b": [
            {"name": "fork/0", "forked_from": "txt/0", "fork_count": 0, "deleted": False, "expired": False}
        ],
    }
    body = {
        "a": {"cluster_forks": {"pins": pins_on_a}, "streams": streams["a"]},
        "b": {"cluster_forks": {"pins": 0}, "streams": streams["b"]},
    }
    s = Script()
    s.op(PINS, None, Call("GET", "/stats"), Outcome(200, body=json.dumps(body)))
    return s


def test_the_pin_count_must_be_exact() -> None:
    assert kinds(pins_history(1)) == []
    assert kinds(pins_history(2)) == ["pin-leak"]
    assert kinds(pins_history(0)) == ["pin-missing"]
