"""A short slice of the black-box torture tier (ops/torture/blackbox.py): two seeded runs of a real
server under every fault kind, about 75 s in all. It needs root (tmpfs and loop mounts).

The first two tests make sure the slice did what it claims (every fault happened, every operation
kind ran and succeeded at least once), so the third, "no findings", cannot pass by doing nothing.
"""

from __future__ import annotations

from collections import Counter

import pytest

from ops.torture.blackbox import Options, Result, format_summary, run
from ops.torture.operations import REGISTRY

RUNS = [
    Options(seed=11, duration=30, fsync="always", disk="tmpfs", cold=True),
    # 25 s, not 15: a restart now counts as down until recovery ends, which leaves a short run few
    # subscription claims, and with them few acks (CI once saw none succeed: stop 32).
    Options(seed=12, duration=25, fsync="interval", sync_method="syncfs", disk="ext4", cold=False),
]

FAULTS = {
    "kill",
    "term",
    "restart",
    "disk_full",
    "disk_freed",
    "s3_stop",
    "s3_start",
    "s3_freeze",
    "s3_thaw",
    "s3_wipe",
    "client_vanish",
}
# Kinds that must have succeeded at least once (some kinds only fail by design: a vanishing
# client gets no answer).
SUCCEEDED = {
    "create",
    "fork",
    "append",
    "produce",
    "close",
    "delete",
    "head",
    "read",
    "long_poll",
    "sse",
    "slow_read",
    "sub_put",
    "sub_claim",
    "sub_ack",
    "sub_get",
    "webhook",
    "healthz",
    "fd_probe",
}


@pytest.fixture(scope="module")
def results() -> list[Result]:
    out = []
    for options in RUNS:
        result = run(options, log=lambda _line: None)
        print(format_summary(result))
        out.append(result)
    return out


def test_every_fault_kind_happened(results: list[Result]) -> None:
    faults: Counter[str] = Counter()
    for result in results:
        faults.update(result.summary.faults)
    assert FAULTS <= set(faults), f"missing faults: {FAULTS - set(faults)}"


def test_every_operation_kind_ran(results: list[Result]) -> None:
    ran: Counter[str] = Counter()
    succeeded: set[str] = set()
    for result in results:
        ran.update(result.summary.op_kinds())
        succeeded |= {key.split()[0] for key in result.summary.ops if key.endswith(" ok")}
    generated = {kind for kind, op in REGISTRY.items() if op.weight > 0}
    assert generated <= set(ran), f"never ran: {generated - set(ran)}"
    assert SUCCEEDED <= succeeded, f"never succeeded: {SUCCEEDED - succeeded}"
    checks: Counter[str] = Counter()
    for result in results:
        checks.update(result.summary.checks)
    for check in ("acked-present", "tail-floor", "bytes-compared", "producer-contiguous", "server-up"):
        assert checks[check] > 0, f"the checker never checked {check}"


def test_segments_reached_the_bucket(results: list[Result]) -> None:
    assert results[0].cold_objects > 0, "no segment was sealed (by size, count or age) and uploaded"


def test_no_findings(results: list[Result]) -> None:
    findings = [f"{r.options.replay()}: {f}" for r in results for f in r.summary.findings]
    assert not findings, "\n".join(findings)
