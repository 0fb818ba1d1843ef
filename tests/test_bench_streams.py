"""ops/bench_streams.py, run tiny against a real disk server: its report holds real measurements."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ops.loadtest import h2load
from tests.ops_script import run_with_json

pytestmark = pytest.mark.skipif(not h2load.available(), reason="h2load not installed (make h2load)")

STREAMS = 120


@pytest.mark.parametrize("from_idle", [False, True])
def test_bench_streams_reports_creates_memory_and_appends(tmp_path: Path, from_idle: bool) -> None:
    out = tmp_path / "report.json"
    stdout, report = run_with_json(
        "ops.bench_streams",
        *("--streams", str(STREAMS), "--clients", "4", "--hot", "8", "--hibernate-after", "0.5"),
        *(["--hot-from-idle"] if from_idle else []),
        out=out,
    )
    # Every create made a new stream: the server counted them, not just h2load's 2xx answers.
    assert report["streams_seen"] == STREAMS
    assert report["create_failures"] == 0 and report["append_failures"] == 0
    fields = ("creates_per_s", "create_cpu_us", "appends_all_per_s", "appends_hot_per_s", "ratio")
    for field in (*fields, "append_all_cpu_us", "append_hot_cpu_us"):
        assert math.isfinite(report[field]) and report[field] > 0, field
    # CPU per create split into Python (user) and the kernel's file work (sys), adding up.
    assert report["create_user_us"] > 0 and report["create_sys_us"] >= 0
    assert report["create_user_us"] + report["create_sys_us"] == pytest.approx(report["create_cpu_us"])
    # RSS from /proc of a Python server: tens of MiB, and what the creates added shows.
    assert 10 << 20 < report["rss_before"] < 2 << 30
    assert report["rss_created"] >= report["rss_before"]
    assert report["rss_per_idle_stream"] == pytest.approx(
        (report["rss_hibernated"] - report["rss_before"]) / STREAMS
    )
    assert 0 < report["hibernate_wait_s"] < 60
    assert report["appends_all_per_s"] / report["appends_hot_per_s"] == pytest.approx(report["ratio"])
    assert "| appends over 120 streams |" in stdout
    assert report["hot_from_idle"] is from_idle
    assert ("waiting for the streams to hibernate again" in stdout) is from_idle
    assert ("| over 8 (from idle) |" in stdout) is from_idle


def test_failed_appends_are_reported_by_what_answered_them() -> None:
    from ops.bench_streams import failure_classes

    summary = "requests: 100 total, 100 started, 100 done, 90 succeeded, 10 failed, 0 errored\n"
    out = summary + "status codes: 90 2xx, 0 3xx, 2 4xx, 5 5xx\n"
    assert failure_classes([out, out], 17) == {"4xx": 4, "5xx": 10, "unanswered": 3}
    assert failure_classes([out.replace("2 4xx, 5 5xx", "0 4xx, 0 5xx")], 0) == {}
