"""ops/profile_append.py without a server: attribution of py-spy samples, the split, the tables."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ops import profile_append as pa

ROOT = Path(__file__).resolve().parent.parent
PID = 4242
MAIN = f"thread ({PID}): MainThread"
WORKER = "thread (4250): Trio thread 0"
LOOP = "_run_module_as_main (<frozen runpy>:198);run (trio/_core/_run.py:2532);unrolled_run (trio/_core/_run.py:2866)"
H1 = f"{LOOP};serve_connection (streamkeep/http/accept.py:85);serve_h1 (streamkeep/http/h1_connection.py:150)"
APPEND = (
    f"{H1};Service.handle (streamkeep/server/service.py:140);Service.begin (streamkeep/server/service.py:160)"
)
NOW = f"{APPEND};Supervisor.call_now (streamkeep/actors/supervisor.py:90);StreamActor.call_now (streamkeep/actors/actor.py:78)"


def one(line: str) -> pa.Stack:
    stacks = pa.parse_raw(line + "\n")
    assert len(stacks) == 1
    return stacks[0]


def component(line: str) -> str:
    return pa.attribute(one(line).frames)


def test_parse_raw_reads_threads_frames_and_counts() -> None:
    text = f"{MAIN};{H1};RequestReader.feed (streamkeep/http/h1_parser.py:131) 7\n{WORKER};Thread.run (threading.py:982) 2\n\n"
    main, worker = pa.parse_raw(text)
    assert (main.thread, main.tid, main.count) == ("MainThread", PID, 7)
    assert main.frames[0] == pa.Frame("_run_module_as_main", "<frozen runpy>", 198)  # a file with a space
    assert main.frames[-1] == pa.Frame("RequestReader.feed", "streamkeep/http/h1_parser.py", 131)
    assert (worker.thread, worker.tid, worker.count) == ("Trio thread 0", 4250, 2)
    bare = one("main (app.py:3);_make.<locals>.wrapper (trio/_socket.py) 1")  # no thread, no line
    assert (bare.thread, bare.tid) == ("", None)
    assert bare.frames[-1] == pa.Frame("_make.<locals>.wrapper", "trio/_socket.py", None)


def test_llhttp_under_the_h1_reader_is_http1_parsing() -> None:
    line = f"{MAIN};{H1};RequestReader._read_until (streamkeep/http/h1_parser.py:181);RequestReader.feed (streamkeep/http/h1_parser.py:131);feed_data (httptools/parser/parser.pyx:194) 5"
    assert component(line) == pa.HTTP1
    # A callback llhttp makes into our reader is parsing too.
    assert component(f"{MAIN};{H1};RequestReader.on_header (streamkeep/http/h1_parser.py:100) 1") == pa.HTTP1


def test_the_edges_own_reads_and_writes_are_socket_io() -> None:
    read = f"{MAIN};{H1};RequestReader._read_until (streamkeep/http/h1_parser.py:190);receive (streamkeep/http/sockets.py:28) 4"
    assert component(read) == pa.SOCKET
    # The parsing that follows the read is not.
    assert (
        component(
            f"{MAIN};{H1};RequestReader._read_until (streamkeep/http/h1_parser.py:192);RequestReader.feed (streamkeep/http/h1_parser.py:131) 1"
        )
        == pa.HTTP1
    )


def test_trio_called_from_storage_is_trio_scheduling() -> None:
    line = (
        f"{MAIN};{NOW};StreamOps.append_now (streamkeep/actors/stream_ops.py:108);"
        "MemoryLog.submit (streamkeep/storage/memory.py:99);resolved (streamkeep/storage/base.py:90);"
        "Commit.resolve (streamkeep/storage/base.py:66);Event.set (trio/_sync.py:80);"
        "reschedule (trio/_core/_generated_run.py:124);Runner.reschedule (trio/_core/_run.py:1919) 3"
    )
    assert component(line) == pa.TRIO
    # The same stack one frame shorter is storage's own time.
    assert component(line.rsplit(";Event.set", 1)[0] + " 1") == pa.STORAGE


def test_generated_and_stdlib_frames_belong_to_their_caller() -> None:
    line = (
        f"{MAIN};{NOW};StreamOps.append_now (streamkeep/actors/stream_ops.py:108);"
        "StreamOps._plan_append (streamkeep/actors/stream_ops.py:165);copy_meta (streamkeep/protocol/stream.py:370);"
        "replace (dataclasses.py:1453);__create_fn__.<locals>.__init__ (<string>:3) 2"
    )
    assert component(line) == pa.PLANNING


def test_a_stack_of_the_standard_library_alone_is_other() -> None:
    assert (
        component(
            "_run_module_as_main (<frozen runpy>:198);dumps (json/__init__.py:231);encode (json/encoder.py:200) 1"
        )
        == pa.OTHER
    )


def test_functions_of_shared_files_go_by_function() -> None:
    actor = f"{MAIN};{NOW}"
    assert component(actor + " 1") == pa.HANDOFF
    assert component(f"{actor};StreamOps.append_now (streamkeep/actors/stream_ops.py:108) 1") == pa.PLANNING
    assert component(f"{actor};StreamOps._notify (streamkeep/actors/stream_ops.py:205) 1") == pa.PUBLISH
    service = f"{MAIN};{APPEND}"
    assert component(f"{service};AppendSpec.from_request (streamkeep/protocol/stream.py:194) 1") == pa.HEADERS
    assert component(f"{service};AppendOutcome.headers (streamkeep/protocol/stream.py:230) 1") == pa.RESPONSE
    assert component(f"{service};encode (streamkeep/protocol/offsets.py:50) 1") == pa.RESPONSE
    assert component(f"{service};Headers.get (streamkeep/protocol/model.py:34) 1") == pa.HEADERS
    assert component(f"{service};classify (streamkeep/protocol/routes.py:83) 1") == pa.ROUTING
    assert component(f"{service} 1") == pa.RESPONSE
    assert component(f"{MAIN};{H1};_send (streamkeep/http/h1_connection.py:233) 1") == pa.SOCKET
    assert component(f"{MAIN};{H1};encode (streamkeep/http/h1_writer.py:40) 1") == pa.HTTP1
    assert component(f"{MAIN};{H1} 1") == pa.GLUE
    h2 = f"{MAIN};{LOOP};_H2Connection.run (streamkeep/http/h2_connection.py:130);_H2Connection.handle (streamkeep/http/h2_connection.py:160)"
    assert component(f"{h2};malformed (streamkeep/http/h2_validate.py:40) 1") == pa.HTTP2
    assert component(f"{h2};_H2Connection.write_queued (streamkeep/http/h2_connection.py:396) 1") == pa.SOCKET


def test_waits_and_empty_stacks_are_left_out() -> None:
    assert (
        component(
            f"{MAIN};_run_module_as_main (<frozen runpy>:198);run (trio/_core/_run.py:2535);EpollIOManager.get_events (trio/_core/_io_epoll.py:243) 4"
        )
        == pa.IDLE
    )
    assert (
        component(
            f"{WORKER};Thread.run (threading.py:982);WorkerThread._work (trio/_core/_thread_cache.py:211) 9"
        )
        == pa.IDLE
    )
    assert component(f"{MAIN} 3") == pa.EMPTY
    # Only as the innermost frame: trio's loop below other work is not a wait.
    line = f"{MAIN};run (trio/_core/_run.py:2535);EpollIOManager.get_events (trio/_core/_io_epoll.py:243);Service.begin (streamkeep/server/service.py:160) 1"
    assert component(line) == pa.RESPONSE


def test_rules_name_functions_that_exist() -> None:
    """A renamed function would silently move its samples to another component: the rules must
    follow the code (this test fails first, naming the rule to update)."""
    for rule in pa.RULES + pa.IDLE_RULES + pa.KERNEL_RULES:
        if not rule.file.startswith("streamkeep/"):
            continue
        if "*" in rule.file:
            continue  # a pattern, for files that may come and go
        path = ROOT / rule.file
        assert path.exists(), rule
        defined = _qualified_names(ast.parse(path.read_text()))
        for pattern in rule.functions:
            if "*" in pattern:
                stem = pattern.split("*")[0].rstrip(".")
                assert not stem or any(name.startswith(stem) for name in defined), (rule, pattern)
            else:
                assert pattern in defined, f"{rule.file} no longer defines {pattern}: update RULES"


def _qualified_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(prefix + child.name)
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return names


def test_breakdown_splits_each_thread_pools_cpu_by_its_own_samples() -> None:
    text = "\n".join([
        f"{MAIN};{H1};RequestReader.feed (streamkeep/http/h1_parser.py:131) 30",
        f"{MAIN};{H1};_send (streamkeep/http/h1_connection.py:233) 10",
        f"{MAIN};run (trio/_core/_run.py:2535);EpollIOManager.get_events (trio/_core/_io_epoll.py:243) 50",
        f"{WORKER};Thread.run (threading.py:982);Committer._write_group (streamkeep/storage/disk/committer.py:138);SegmentWriter.write (streamkeep/storage/disk/writer.py:175) 90",
        f"{WORKER};Thread.run (threading.py:982);to_thread_run_sync.<locals>.worker_fn (trio/_threads.py:392) 10",
    ])  # fmt: skip
    result = pa.breakdown(pa.parse_raw(text), PID, pa.Cpu(80.0, sys_us=20.0), pa.Cpu(20.0, sys_us=18.0))
    assert result.us[pa.HTTP1] == pytest.approx(60.0)  # the main thread's user time
    assert result.us[pa.SOCKET] == pytest.approx(20.0)  # its kernel time
    assert result.us[pa.STORAGE] == pytest.approx(18.0)  # the worker's CPU, not its wall time in fdatasync
    assert result.us[pa.THREADS] == pytest.approx(2.0)
    assert sum(result.us.values()) == pytest.approx(100.0)
    assert result.left_out == {pa.IDLE: 50, pa.EMPTY: 0}
    assert result.threads == {"MainThread": 40, "Trio thread 0": 100}
    assert result.top[0] == ("RequestReader.feed (streamkeep/http/h1_parser.py)", 30, pytest.approx(60.0))
    assert result.unsampled_us == 0.0
    # Other threads' CPU with no samples to split it by is not dropped: it is "other".
    alone = pa.breakdown(pa.parse_raw(text.split("\n")[0]), PID, pa.Cpu(80.0), pa.Cpu(5.0))
    assert alone.us[pa.OTHER] == pytest.approx(5.0)
    assert alone.unsampled_us == pytest.approx(5.0)


def test_kernel_time_goes_to_samples_in_syscalls_and_user_time_to_the_rest() -> None:
    """A sampler that lands on syscalls twice as often as they take CPU is corrected by /proc's
    split: here half the samples are in os.write, but the kernel took a quarter of the CPU."""
    text = "\n".join([
        f"{MAIN};{H1};RequestReader.feed (streamkeep/http/h1_parser.py:131) 30",
        f"{MAIN};{H1};_send (streamkeep/http/h1_connection.py:233) 20",
        f"{MAIN};{H1};_wait (trio/_core/_io_epoll.py:290);EpollIOManager._update_registrations (trio/_core/_io_epoll.py:275) 10",
        f"{MAIN};{H1};Runner.reschedule (trio/_core/_run.py:1919) 40",
    ])  # fmt: skip
    result = pa.breakdown(pa.parse_raw(text), PID, pa.Cpu(80.0, sys_us=20.0), pa.Cpu(0.0))
    assert result.us[pa.SOCKET] == pytest.approx(20.0 * 20 / 30)  # kernel time over 30 kernel samples
    assert result.us[pa.TRIO] == pytest.approx(20.0 * 10 / 30 + 60.0 * 40 / 70)  # epoll_ctl + user
    assert result.us[pa.HTTP1] == pytest.approx(60.0 * 30 / 70)
    assert sum(result.us.values()) == pytest.approx(80.0)
    # With no kernel samples to give it to, kernel time is spread like the rest.
    plain = pa.breakdown(pa.parse_raw(text.split("\n")[0]), PID, pa.Cpu(80.0, sys_us=20.0), pa.Cpu(0.0))
    assert plain.us[pa.HTTP1] == pytest.approx(80.0)


def test_generated_code_is_named_with_its_caller_in_the_top_list() -> None:
    line = f"{MAIN};{H1};Request.__init__ (streamkeep/protocol/model.py:70);__init__ (<string>:3) 4"
    result = pa.breakdown(pa.parse_raw(line), PID, pa.Cpu(10.0), pa.Cpu(0.0))
    assert result.top[0][0] == "__init__ (<string>) in Request.__init__"


def _combination(name: str, us: list[float]) -> pa.Combination:
    storage, protocol = name.split()
    values = dict(zip(pa.COMPONENTS, us, strict=True))
    total = sum(us)
    clean = pa.Pass(ok=30_000, failed=0, seconds=3.0, cpu_us=total, main_us=total, other_us=0.0)
    result = pa.Breakdown(
        values, dict.fromkeys(pa.COMPONENTS, 1), [("serve_h1 (streamkeep/http/h1_connection.py)", 9, 7.0)],
        {pa.IDLE: 0, pa.EMPTY: 0}, {"MainThread": 15},
    )  # fmt: skip
    return pa.Combination(storage, protocol, clean, clean, result, {"samples": 15, "errors": 2})


def test_markdown_table_percentages_sum_to_100_within_rounding() -> None:
    # Awkward thirds and sevenths, so rounding each cell really is tested.
    first = [10 / 3, 0.0, 20 / 7, 1.05, 0.0, 2.95, 4.449, 5.0, 1 / 7, 0.0, 0.01, 7.77, 1.234, 3.0, 9.99, 0.5]
    second = [0.0, 123.4567, 1.0, 2.0, 0.0, 3.0, 4.0, 5.0, 6.0, 0.1, 0.2, 0.3, 0.4, 10.0, 33.3333, 0.0]
    combos = [_combination("memory h1", first), _combination("disk h2c", second)]
    text = pa.format_markdown(combos, "date: test")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "µs (" in line]
    assert [row.split(" | ")[0][2:] for row in rows] == list(pa.COMPONENTS)
    for column, values in enumerate((first, second)):
        cells = [row.strip("| ").split(" | ")[column + 1] for row in rows]
        parsed = [re.fullmatch(r"([\d.]+) µs \(([\d.]+) %\)", cell) for cell in cells]
        assert all(parsed), cells
        shares = [float(match.group(2)) for match in parsed if match]
        assert abs(sum(shares) - 100) <= 0.05 * len(shares)
        micros = [float(match.group(1)) for match in parsed if match]
        assert micros == [round(value, 1) for value in values]
    assert f"**{sum(first):.1f} µs**" in text
    assert text.splitlines()[0] == "date: test"
    # The text form carries the same components and a 100 % total.
    plain = pa.format_text(combos[1])
    assert all(name in plain for name in pa.COMPONENTS)
    assert re.search(r"total\s+[\d.]+\s+100\.0", plain)


def test_missing_tools_exit_2_and_say_what_to_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(pa.h2load, "available", lambda: False)
    assert pa.main(["--seconds", "1"]) == 2
    assert "make profile" in capsys.readouterr().err
