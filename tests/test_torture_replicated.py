"""A short slice of the black-box torture tier on a replicated cluster (ops/torture/replicated.py,
issue 23 point 7): 3 members on 2 replicas each, a 3-member etcd, and one of each fault kind at
least (kill -9 of a machine, disk loss, disk loss with the surviving copy killed too, a SIGSTOP
pause, a partition, an etcd member killed); about 90 s in all. It needs root (a tmpfs mount, iptables), haproxy, etcd and iptables.

The first tests make sure the slice did what it claims (each fault kind happened, owners changed,
appends were acknowledged, the end-of-run comparisons ran), so the last, "no findings", cannot pass
by doing nothing. The judge of owners per epoch is also shown to fail on a made-up history.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest

from ops.torture.blackbox import Options, Result, format_summary
from ops.torture.checker import check_history
from ops.torture.history import Call, History, Outcome
from ops.torture.model import RunConfig
from ops.torture.operations.replication import ROLES
from ops.torture.partition import iptables
from ops.torture.replicated import KINDS, replica_faults, run

# The faults (and a disk loss whose surviving copy is killed at once). Not "split" (a machine
# cut off from etcd and its peers, not from HAProxy): a deposed owner answers stale reads for a second
# or two after its follower promoted (FINDINGS.md, R4); `make torture` runs it. Seed 10: every kind in
# the first 25 s of its schedule (replica_faults); the run goes on past its 40 s until each kind ran.
KINDS_HERE = tuple(kind for kind in KINDS if kind != "split")
OPTIONS = Options(
    seed=10,
    duration=40,
    fsync="always",
    disk="tmpfs",
    cluster=3,
    replicas=2,
    workers=5,
    replica_faults=KINDS_HERE,
)


@pytest.fixture(scope="module")
def result() -> Result:
    for tool in ("haproxy", "etcd"):
        if shutil.which(tool) is None and not any(
            os.access(f"{d}/{tool}", os.X_OK) for d in ("/usr/sbin", "/usr/bin")
        ):
            pytest.fail(f"{tool} is missing: make system-tools installs it")
    if iptables() is None:
        pytest.fail("iptables is missing: make system-tools installs it (apt-get install iptables)")
    done = run(OPTIONS, log=lambda _line: None)
    print(format_summary(done))
    return done


def test_the_schedule_has_every_kind_first() -> None:
    plan = replica_faults(OPTIONS, 3, random.Random(f"{OPTIONS.seed}/faults"))
    assert {fault.kind for fault in plan[: len(KINDS_HERE)]} == set(KINDS_HERE)


def test_every_fault_kind_happened_and_owners_changed(result: Result) -> None:
    counts = result.cluster
    for kind in KINDS_HERE:
        assert counts[kind] >= 1, counts
    assert counts["disk_loss_skipped"] == 0, counts
    assert counts["epochs seen in etcd beyond the first"] >= 1, counts
    assert counts["appends acknowledged"] > 50, counts
    assert result.summary.faults["restart"] >= result.summary.faults["kill"], result.summary.faults


def test_the_checker_judged_what_the_run_is_for(result: Result) -> None:
    checks = result.summary.checks
    for check in ("acked-present", "bytes-compared", "producer-contiguous", "fault-status", "order"):
        assert checks[check] > 0, f"the checker never checked {check}"
    assert checks["one-owner-per-epoch"] > 50
    assert checks["in-sync-at-end"] == 3 and checks["replicas-identical"] == 3, checks
    assert result.cluster["files compared between copies"] > 10, result.cluster


def test_no_findings(result: Result) -> None:
    findings = [f"{result.options.replay()}: {f}" for f in result.summary.findings]
    assert not findings, "\n".join(findings)


def test_two_owners_in_one_epoch_is_a_finding() -> None:
    clock = [0.0]
    history = History(clock=lambda: clock[0])
    samples = [
        {"replicas": {"m0a": {"member": "m0", "role": "owner", "epoch": 1}, "m0b": None}, "records": {}},
        {"replicas": {"m0a": None, "m0b": {"member": "m0", "role": "owner", "epoch": 2}}, "records": {}},
        {"replicas": {"m0a": {"member": "m0", "role": "owner", "epoch": 2}}, "records": {}},
        {"replicas": {}, "records": {"m0": {"epoch": 2, "owner": "m0b"}}},
        {"replicas": {}, "records": {"m0": {"epoch": 1, "owner": "m0a"}}},
    ]
    for sample in samples:
        started = history.start(ROLES, "monitor", None, {}, Call("GET", "/stats"))
        clock[0] += 0.5
        history.end(started, Outcome(200, body=json.dumps(sample), verdict="ok"))
    summary = check_history(history.events, RunConfig(cold=False, members=("m0",)))
    kinds = sorted(f.kind for f in summary.findings)
    assert kinds == ["epoch-back", "two-owners"], summary.findings
    assert summary.checks["one-owner-per-epoch"] == 5
