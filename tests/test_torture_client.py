"""The black-box torture tier driving the project's own client (ops/torture/operations/client.py):
`streamkeep.client`'s IdempotentProducer and Reader against a real server under kills, restarts
and a full disk, with answers lost and connections cut by the client's own transport. About 45 s;
it needs root, like tests/test_torture_blackbox.py (tmpfs).

The first run must end with no finding and must have exercised what it claims (retries answered
as duplicates, readers resumed after cuts, every acknowledged receipt checked against the final
read). The second breaks the client on purpose, each try of an append under a new producer id (a
retry the server cannot tell from a new write), and must end with a finding: proof that the
checks can fail.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import httpx
import pytest

from ops.torture.blackbox import Options, Result, format_summary, run
from ops.torture.operations import REGISTRY
from ops.torture.operations import client as client_ops


@pytest.fixture
def client_heavy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The client's sessions picked far more often than in a full run, so a short run has many."""
    monkeypatch.setattr(REGISTRY["client_produce"], "weight", 20)
    monkeypatch.setattr(REGISTRY["client_read"], "weight", 15)
    yield


def short_run(seed: int) -> Result:
    # 20 s, not 12: a restart counts as down until recovery ends, and in a 12 s run on a loaded CI no
    # client read once got far enough to judge (stop 32).
    result = run(Options(seed=seed, duration=20, workers=4, disk="tmpfs", cold=False), log=lambda _line: None)
    print(format_summary(result))
    return result


def test_the_client_through_faults_has_no_findings(client_heavy: None) -> None:
    result = short_run(21)
    summary = result.summary
    findings = [f"{result.options.replay()}: {f}" for f in summary.findings]
    assert not findings, "\n".join(findings)
    ok = {key.split()[0] for key in summary.ops if key.endswith(" ok")}
    assert {"client_produce", "client_read", "client_append"} <= ok, summary.ops
    assert summary.faults["client_drop"] > 0 and summary.faults["client_cut"] > 0, summary.faults
    assert summary.faults["kill"] + summary.faults["term"] > 0, summary.faults
    for check in (
        "client-receipt-ack",  # a receipt written as new is its own batch's acknowledgement
        "client-receipt-present",  # every written receipt is in the stream read at the end
        "client-receipt-order",  # in the order of the appends
        "duplicate-has-original",  # a lost answer was retried and answered as a duplicate
        "client-read-contiguous",  # a reader's batches follow on from each other
        "producer-contiguous",
    ):
        assert summary.checks[check] > 0, f"the checker never checked {check}"


def _fresh_producer_per_try() -> object:
    """A broken client: every try of an append goes under a producer id never used before (seq
    0), so the server stores a retry as a new append."""
    numbers = itertools.count()

    def rewrite(request: httpx.Request) -> httpx.Request:
        if request.method != "POST" or "producer-id" not in request.headers:
            return request
        headers = httpx.Headers(request.headers)
        headers["producer-id"] = f"{request.headers['producer-id']}-try{next(numbers)}"
        headers["producer-epoch"] = "0"
        headers["producer-seq"] = "0"
        return httpx.Request(
            request.method,
            request.url,
            headers=headers,
            content=request.content,
            extensions=request.extensions,
        )

    return rewrite


def test_a_client_whose_retries_defeat_deduplication_is_found(
    client_heavy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_ops, "BROKEN_REWRITE", _fresh_producer_per_try())
    monkeypatch.setattr(client_ops, "DROP_ANSWER", 0.5)
    result = short_run(22)
    kinds = {f.kind for f in result.summary.findings}
    assert result.summary.faults["client_drop"] > 0
    assert kinds & {"duplicate", "acked-twice"}, format_summary(result)
