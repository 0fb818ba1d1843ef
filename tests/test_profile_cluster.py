"""ops/profile_cluster.py: the /proc parsing and the report's arithmetic on made-up numbers, and one
short real run that checks the report has its parts (no figure is judged: the machine is shared)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from ops import profile_append as pa
from ops import profile_cluster as pc
from ops.loadtest import h2load

# A command name with a space and a ')' in it: the fields count from the last ')'.
STAT = "4242 (py thon) x) S 1 4242 4242 0 -1 4194560 900 0 0 0 250 40 0 0 20 0 3 0 100 0 0"
STATUS = """Name:\tpython
State:\tS (sleeping)
voluntary_ctxt_switches:\t1200
nonvoluntary_ctxt_switches:\t35
"""


def test_stat_ticks_reads_user_and_system_after_the_command_name() -> None:
    assert pc.stat_ticks(STAT) == (250, 40)


def test_switches_reads_both_counts() -> None:
    assert pc.switches(STATUS) == (1200, 35)
    with pytest.raises(KeyError):
        pc.switches("Name:\tpython\n")


def fake_proc(root: Path, pid: int, threads: dict[int, tuple[str, str]]) -> None:
    """A /proc with one process whose threads have (stat, status) texts."""
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "stat").write_text(STAT)
    for tid, (stat, status) in threads.items():
        task = root / str(pid) / "task" / str(tid)
        task.mkdir(parents=True)
        (task / "stat").write_text(stat)
        (task / "status").write_text(status)


def test_usage_takes_the_process_cpu_the_main_threads_and_every_threads_switches(tmp_path: Path) -> None:
    main = STAT.replace(" 250 40 ", " 200 30 ")
    worker = STAT.replace(" 250 40 ", " 50 10 ")
    fake_proc(tmp_path, 4242, {4242: (main, STATUS), 4250: (worker, STATUS.replace("1200", "5"))})
    tick = os.sysconf("SC_CLK_TCK")
    used = pc.usage(4242, tmp_path)
    assert (used.user, used.sys) == pytest.approx((250 / tick, 40 / tick))
    assert (used.main_user, used.main_sys) == pytest.approx((200 / tick, 30 / tick))
    assert (used.voluntary, used.involuntary) == (1205, 70)


def test_usage_of_this_process_is_real_and_grows() -> None:
    before = pc.usage(os.getpid())
    sum(i * i for i in range(2_000_000))
    after = pc.usage(os.getpid())
    assert (after - before).user + (after - before).sys > 0
    assert after.voluntary + after.involuntary > 0


def test_per_append_divides_by_the_appends_and_keeps_the_main_thread_within_the_whole() -> None:
    # 2 s user, 0.5 s sys over 10,000 appends; the main thread read a tick above the whole.
    used = pc.Usage(user=2.0, sys=0.5, main_user=2.01, main_sys=0.4, voluntary=300, involuntary=50)
    cost = pc.per_append(used, 10_000)
    assert (cost.user_us, cost.sys_us, cost.cpu_us) == pytest.approx((200.0, 50.0, 250.0))
    assert (cost.voluntary, cost.involuntary, cost.switches) == pytest.approx((0.03, 0.005, 0.035))
    assert (cost.main_us, cost.main_sys_us) == pytest.approx((240.0, 40.0))
    assert pc.per_append(used, 0).cpu_us == 0.0


def test_usages_subtract_and_add_field_by_field() -> None:
    a = pc.Usage(3.0, 1.0, 2.0, 0.5, 10, 4)
    b = pc.Usage(1.0, 0.5, 1.0, 0.25, 4, 1)
    assert a - b == pc.Usage(2.0, 0.5, 1.0, 0.25, 6, 3)
    assert (a - b) + b == a


def test_the_hop_is_haproxys_cpu_plus_the_members_extra() -> None:
    direct = pc.Cost(user_us=60.0, sys_us=10.0, voluntary=0.01, involuntary=0.10)
    front = pc.Cost(user_us=75.0, sys_us=18.0, voluntary=0.21, involuntary=0.12)
    haproxy = pc.Cost(user_us=30.0, sys_us=12.0, voluntary=0.8, involuntary=0.3)
    h = pc.hop(direct, front, haproxy)
    assert (h.member_user_us, h.member_sys_us, h.member_us) == pytest.approx((15.0, 8.0, 23.0))
    assert (h.member_voluntary, h.member_involuntary) == pytest.approx((0.20, 0.02))
    assert h.total_us == pytest.approx(65.0)


def made_up_pass(name: str, ok: int, member: pc.Usage, haproxy: pc.Usage) -> pc.Pass:
    return pc.Pass(name, ok, 0, 2.0, {pc.MEMBER: member, pc.HAPROXY: haproxy}, [1000, 2000, 50_000], [4])


def made_up_report() -> pc.Report:
    idle = pc.Usage()
    saturated = made_up_pass(pc.SATURATED, 20_000, pc.Usage(1.2, 0.2, 1.2, 0.2, 20, 200), idle)
    direct, front = pc.Pass(pc.DIRECT), pc.Pass(pc.FRONT)
    for _ in range(2):  # two rounds of 10,000 appends each, pooled
        direct.add(made_up_pass(pc.DIRECT, 10_000, pc.Usage(0.6, 0.1, 0.6, 0.1, 100, 10), idle))
        front.add(made_up_pass(pc.FRONT, 10_000, pc.Usage(0.75, 0.18, 0.7, 0.15, 300, 20),
                               pc.Usage(0.3, 0.12, 0.3, 0.12, 8000, 3000)))  # fmt: skip
    return pc.Report("head", 5000.0, {pc.SATURATED: saturated, pc.DIRECT: direct, pc.FRONT: front})


def test_pooled_rounds_weigh_appends_alike_and_keep_each_rounds_figure() -> None:
    report = made_up_report()
    front = report.passes[pc.FRONT]
    assert (front.ok, front.seconds, front.per_second) == (20_000, 4.0, 5000.0)
    assert front.member_us == pytest.approx([93.0, 93.0])
    assert front.backend_connections == [4, 4]
    cost = front.cost(pc.MEMBER)
    assert cost is not None and cost.cpu_us == pytest.approx(93.0)
    assert front.latency_ms(0.5) == 2.0 and front.latency_ms(1.0) == 50.0
    assert pc.Pass("empty").cost(pc.MEMBER) is None


def test_the_markdown_report_has_every_row_and_the_hop() -> None:
    report = made_up_report()
    text = pc.format_markdown(report)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["**member CPU µs**"] == "| **member CPU µs** | 70.0 | 70.0 | 93.0 | 23.0 |"
    assert rows["HAProxy sys µs"].endswith("| 12.0 | 12.0 |")
    assert rows["**all processes µs**"] == "| **all processes µs** | 70.0 | 70.0 | 135.0 | 65.0 |"
    assert rows["member voluntary switches / append"].endswith("| 0.010 | 0.030 | 0.020 |")
    assert rows["appends/s"].endswith("| 5,000 | - |")  # no difference of counts
    assert "The hop (front door) costs **65.0 µs per append**" in text
    assert json.loads(json.dumps(pc.as_json(report)))["hops"][pc.FRONT]["total_us"] == pytest.approx(65.0)


def test_an_edited_front_door_gets_its_own_column_and_hop() -> None:
    report = made_up_report()
    cheaper = made_up_pass(
        pc.EDITED, 20_000, pc.Usage(1.6, 0.3, 1.5, 0.3, 400, 30), pc.Usage(0.4, 0.2, 0, 0, 0, 0)
    )
    report.passes[pc.EDITED] = cheaper
    report.edited = "global\n    maxconn 8000\n"
    text = pc.format_markdown(report)
    head = next(line for line in text.splitlines() if line.startswith("| per append"))
    assert head.endswith("| front door - direct (paced) | edited front door - direct (paced) |")
    assert "| **member CPU µs** | 70.0 | 70.0 | 93.0 | 95.0 | 23.0 | 25.0 |" in text
    assert "The hop (edited front door) costs **55.0 µs per append**" in text
    assert "```\nglobal\n    maxconn 8000\n```" in text


GENERATED = """global
    maxconn 8000

defaults
    mode http
    option forwardfor

frontend streams
    bind 127.0.0.1:4437
    http-request set-header Streamkeep-Client-Http-Version %[req.ver]
    http-request set-header Streamkeep-Client-Scheme %[ssl_fc,iif(https,http)]
    default_backend member_m0

backend member_m0
    server m0 127.0.0.1:35177 check inter 1s fall 2 rise 1
"""


def test_edit_config_drops_adds_and_moves_the_front_door_only() -> None:
    text = pc.edit_config(
        GENERATED, drop=["Client-(Http-Version|Scheme)"], defaults=["http-reuse always"], port=5000
    )
    assert "set-header" not in text
    assert "    bind 127.0.0.1:5000\n" in text
    assert "server m0 127.0.0.1:35177" in text  # the member's address is not the front door's
    assert "defaults\n    http-reuse always\n    mode http\n" in text
    assert pc.edit_config(GENERATED, drop=[], defaults=[], port=4437) == GENERATED
    replaced = pc.edit_config(GENERATED, drop=[], defaults=[], port=4437, replace=[("%[req.ver]", "1.1")])
    assert "Streamkeep-Client-Http-Version 1.1\n" in replaced


PERF = """# Samples: 1K of event 'cpu-clock:ppp'
#
# Overhead  Shared Object      Symbol
# ........  .................  .........................................
#
     6.51%  [kernel.kallsyms]  [k] _raw_spin_unlock_irqrestore
    22.39%  haproxy            [.] pat_match_int
     1.64%  haproxy            [.] process_stream
"""


def test_perfs_report_becomes_symbols_by_share_and_us_over_haproxys_cpu() -> None:
    symbols = pc.parse_perf(PERF)
    assert symbols[0] == ("pat_match_int (haproxy)", 22.39)
    assert [name for name, _ in symbols[1:]] == [
        "_raw_spin_unlock_irqrestore ([kernel.kallsyms])",
        "process_stream (haproxy)",
    ]
    report = made_up_report()
    report.haproxy_symbols[pc.FRONT] = symbols
    assert "| `pat_match_int (haproxy)` | 22.4 | 9.4 |" in pc.format_markdown(report)  # 22.39 % of 42 µs


def test_the_part_load_split_has_its_own_tables() -> None:
    report = made_up_report()
    report.components = [("trio scheduling", 30.0, 33.0, 3.0)]
    report.pacing_components = [("trio scheduling", 20.0, 30.0, 10.0), ("storage", 9.0, 8.0, -1.0)]
    report.pacing_functions = [(f"f{i}", 0.0, 1.0, 1.0) for i in range(10)] + [("g", 2.0, 1.0, -1.0)]
    text = pc.format_markdown(report)
    assert "| component | direct saturated µs | direct paced µs | difference µs |" in text
    assert "| trio scheduling | 20.0 | 30.0 | +10.0 |" in text
    assert (
        "`f7`" in text and "`f8`" not in text and "| `g` | 2.0 | 1.0 | -1.0 |" in text
    )  # 8 gains, then losses


def test_differences_rank_the_largest_gain_first() -> None:
    rows = pc.differences({"a": 10.0, "b": 5.0}, {"a": 12.0, "b": 1.0, "c": 3.0})
    assert [(name, round(diff, 6)) for name, _, _, diff in rows] == [("c", 3.0), ("a", 2.0), ("b", -4.0)]


def test_the_split_puts_the_members_cpu_over_its_samples() -> None:
    pid = 4242
    loop = "run (trio/_core/_run.py:1);serve_h1 (streamkeep/http/h1_connection.py:2)"
    text = (
        f"thread ({pid}): MainThread;{loop};receive (streamkeep/http/sockets.py:3) 1\n"
        f"thread ({pid}): MainThread;{loop};RequestReader.feed (streamkeep/http/h1_parser.py:4) 3\n"
    )
    cost = pc.Cost(user_us=60.0, sys_us=20.0, voluntary=0, involuntary=0, main_us=80.0, main_sys_us=20.0)
    result = pc.split(pa.parse_raw(text), pid, cost)
    assert result.us[pa.SOCKET] == pytest.approx(20.0)  # the kernel time, over the syscall's samples
    assert result.us[pa.HTTP1] == pytest.approx(60.0)


def test_h2load_output_latencies_and_command() -> None:
    out = (
        "finished in 2.00s, 1000.00 req/s, 530.27KB/s\n"
        "requests: 2000 total, 2000 started, 2000 done, 1998 succeeded, 2 failed, 1 errored, 0 timeout\n"
        "status codes: 1998 2xx, 0 3xx, 1 4xx, 0 5xx\n"
    )
    assert h2load.parse(out) == h2load.Counts(1998, 2, 2.0)
    # Replies h2load could not read (an HTTP/1.1 status line it refused): failed, with no status code.
    unread = out.replace("1998 succeeded, 2 failed", "0 succeeded, 2000 failed").replace("1998 2xx", "0 2xx")
    assert h2load.parse(unread) == h2load.Counts(0, 2000, 2.0)
    # A timed run ends with requests in flight: started, not done, not failed.
    assert h2load.parse(out.replace("2000 started", "2032 started")) == h2load.Counts(1998, 2, 2.0)
    with pytest.raises(RuntimeError):
        h2load.parse("nothing")
    assert h2load.parse_latencies("1700000000\t201\t1234\n1700000001\t201\t99\nbad\n") == [1234, 99]
    paced = pc.h2load_command(Path("u"), Path("b"), clients=32, seconds=1.5, rate=4000, h2=False, cpu=1,
                              log=Path("l"))  # fmt: skip
    assert paced[:3] == ["taskset", "-c", "1"]
    assert paced[paced.index("--rps") + 1] == "125.000" and "--h1" in paced and "1500ms" in paced
    assert "--rps" not in pc.h2load_command(Path("u"), Path("b"), clients=4, seconds=1, rate=None, h2=True,
                                            cpu=1, log=Path("l"))  # fmt: skip


def test_haproxys_connections_are_told_from_others_by_socket_inode() -> None:
    # Local, remote (hex ports), state 01 = established; inode in the tenth field. 0x1F90 = 8080.
    header = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    )
    row = "   {n}: 0100007F:{local} 0100007F:{remote} {state} 00000000:00000000 00:00000000 00000000 0 0 {inode}\n"
    text = header + "".join(
        row.format(n=n, local=local, remote=remote, state=state, inode=inode)
        for n, (local, remote, state, inode) in enumerate(
            [
                ("C350", "1F90", "01", 11),  # HAProxy -> member
                ("C351", "1F90", "01", 12),  # HAProxy -> member
                ("C352", "1F90", "01", 13),  # h2load -> member: not HAProxy's socket
                ("C353", "1F90", "06", 14),  # HAProxy's, in TIME_WAIT
                ("1F90", "C350", "01", 15),  # the member's end of a connection
            ]
        )
    )
    assert pc.connections_to(8080, {11, 12, 14, 15}, text) == 2


def test_pressure_and_the_members_address() -> None:
    text = (
        "some avg10=38.54 avg60=28.86 avg300=21.18 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    )
    assert pc.pressure(text) == pytest.approx(28.86)
    assert pc.pressure("") is None
    output = [
        "[m0] member listening on http://127.0.0.1:1\n",
        "member m0 at http://127.0.0.1:35177: 4096 of 4096 slots\n",
    ]
    assert pc.member_url(output) == "http://127.0.0.1:35177"
    with pytest.raises(RuntimeError):
        pc.member_url(["streamkeep listening on http://127.0.0.1:2\n"])


needs_tools = pytest.mark.skipif(
    not (shutil.which("h2load") and shutil.which("haproxy") and shutil.which("taskset"))
    or len(os.sched_getaffinity(0)) < 2,
    reason="needs h2load, haproxy, taskset and two CPUs",
)


@needs_tools
def test_a_short_real_run_reports_every_pass_with_cpu(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    argv = ["--seconds", "1", "--rounds", "1", "--no-sample", "--clients", "4", "--json", str(out)]
    assert pc.main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["passes"]) == {pc.SATURATED, pc.DIRECT, pc.FRONT}
    for done in report["passes"].values():
        assert done["ok"] > 0 and done["failed"] == 0
        assert done["per_append"][pc.MEMBER]["user_us"] + done["per_append"][pc.MEMBER]["sys_us"] > 0
    front = report["passes"][pc.FRONT]["per_append"][pc.HAPROXY]
    assert front["user_us"] + front["sys_us"] > 0  # HAProxy worked for the front door's appends
