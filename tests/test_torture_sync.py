"""The sync tier of the torture (ops/torture/syncbridge.py): its judge finds what a broken bridge
would do, and a short seeded run of the real processes under faults finds nothing."""

from __future__ import annotations

import json
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


def test_the_judge_finds_a_sink_that_applied_twice_missed_or_set_aside_wrongly() -> None:
    nul = {"type": "ev", "key": "b", "value": {"s": "\u0000"}, "headers": {"operation": "insert"}}
    events = [
        {"type": "ev", "key": "a", "value": {"n": 1}, "headers": {"operation": "insert"}},
        {"headers": {"control": "snapshot-start"}},
        {"type": "ev", "key": "c", "value": {"n": 2}, "headers": {"operation": "insert"}},
        nul,
        {"headers": {"control": "snapshot-end"}},
    ]
    state = {("ev", "c"): {"n": 2}}  # the snapshot replaced a; b was refused
    log = Counter(json.dumps(m, sort_keys=True) for m in events if m is not nul)
    dead = {name: Counter([json.dumps(nul, sort_keys=True)]) for name in ("evstate", "evlog")}
    tables = syncbridge.SinkTables(state, log, dead)
    findings: list[str] = []
    syncbridge.judge_sink(events, tables, findings)
    assert findings == [] and tables.caught_up_with(events)
    syncbridge.judge_sink(events, syncbridge.SinkTables(state, log + log, dead), findings)
    syncbridge.judge_sink(
        events, syncbridge.SinkTables({("ev", "a"): {"n": 1}, **state}, log, dead), findings
    )
    twice = {**dead, "evlog": dead["evlog"] + dead["evlog"]}
    syncbridge.judge_sink(events, syncbridge.SinkTables(state, log, twice), findings)
    syncbridge.judge_sink(events, syncbridge.SinkTables(state, log, {"evlog": dead["evlog"]}), findings)
    assert [f.split(":")[0] for f in findings] == [
        "sink-log",
        "sink-state",
        "sink-dead-letter",
        "sink-dead-letter",
    ]
    assert not syncbridge.SinkTables(state, log, {}).caught_up_with(events)


def test_a_short_seeded_run_under_faults_finds_nothing(tmp_path: Path) -> None:
    result = syncbridge.run(syncbridge.Options(seed=3, duration=15, dump_dir=tmp_path))
    assert result.counts["transactions committed"] > 50 and result.counts["messages acknowledged"] > 20
    assert sum(result.counts[k] for k in ("kill", "crash-point", "pause", "postgres", "streamkeep")) >= 4
    assert result.counts["events messages Postgres refuses"] > 0  # the dead letter was judged
    assert result.findings == []
