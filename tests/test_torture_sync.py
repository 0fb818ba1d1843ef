"""The sync tier of the torture (ops/torture/syncbridge.py): its judge finds what a broken bridge
would do, and a short seeded run of the real processes under faults finds nothing."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from ops.torture import syncbridge


def change(xid: int, lsn: str, key: int, operation: str = "insert", v: int = 0) -> dict[str, Any]:
    message: dict[str, Any] = {
        "type": "public.items",
        "key": str(key),
        "headers": {"operation": operation, "txid": str(xid), "lsn": lsn},
    }
    if operation != "delete":
        message["value"] = {"id": key, "v": v, "note": ""}
    return message


def writer_with(committed: dict[int, int]) -> syncbridge.Writer:
    writer = syncbridge.Writer("", __import__("random").Random(0))
    writer.committed = dict(committed)
    return writer


TABLE = {"1": {"id": 1, "v": 0, "note": ""}, "2": {"id": 2, "v": 5, "note": ""}}
GOOD = [
    {"headers": {"control": "snapshot-start"}},
    {"headers": {"control": "snapshot-end"}},
    change(700, "0/100", 1),
    change(701, "0/200", 2),
    change(702, "0/300", 2, "update", 5),
]


def judged(messages: list[dict[str, Any]], committed: dict[int, int] | None = None) -> list[str]:
    findings: list[str] = []
    syncbridge.judge_source(messages, TABLE, writer_with(committed or {700: 1, 701: 1, 702: 1}), findings)
    return findings


def test_the_judge_passes_a_faithful_stream() -> None:
    assert judged(GOOD) == []


def test_the_judge_finds_a_transaction_sent_twice_lost_reordered_or_echoed() -> None:
    assert any(f.startswith("source-duplicate") for f in judged([*GOOD, change(701, "0/200", 2)]))
    assert any(f.startswith("source-lost") for f in judged(GOOD, {700: 1, 701: 1, 702: 1, 703: 2}))
    reordered = [GOOD[0], GOOD[1], GOOD[3], GOOD[2], GOOD[4]]
    assert any(f.startswith("source-order") for f in judged(reordered))
    echoed = [*GOOD, {"type": "public.ev_state", "key": "k", "value": {}, "headers": {"operation": "insert"}}]
    assert any(f.startswith("echo") for f in judged(echoed))
    assert any(f.startswith("source-fold") for f in judged(GOOD[:-1], {700: 1, 701: 1}))


def test_the_judge_finds_a_sink_that_applied_twice_or_missed() -> None:
    events = [{"type": "ev", "key": "a", "value": {"n": 1}, "headers": {"operation": "insert"}}]
    state = {("ev", "a"): {"n": 1}}
    log = Counter(__import__("json").dumps(m, sort_keys=True) for m in events)
    findings: list[str] = []
    syncbridge.judge_sink(events, state, log, findings)
    assert findings == []
    syncbridge.judge_sink(events, state, log + log, findings)
    syncbridge.judge_sink(events, {}, log, findings)
    assert [f.split(":")[0] for f in findings] == ["sink-log", "sink-state"]


def test_a_short_seeded_run_under_faults_finds_nothing(tmp_path: Path) -> None:
    result = syncbridge.run(syncbridge.Options(seed=3, duration=15, dump_dir=tmp_path))
    assert result.counts["transactions committed"] > 50 and result.counts["messages acknowledged"] > 20
    assert sum(result.counts[k] for k in ("kill", "crash-point", "pause", "postgres", "streamkeep")) >= 4
    assert result.findings == []
