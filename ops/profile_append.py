"""Where the microseconds of one append go: server CPU per append, split by component.

    python -m ops.profile_append [--seconds 6] [--storage memory,disk] [--protocols h1,h2c]
                                 [--markdown] [--json FILE] [--nonblocking]

For each storage (memory; disk with `--fsync always`) and protocol (HTTP/1.1; h2c by prior
knowledge) this starts the real server as its own process with all its threads pinned to one CPU,
creates 16 text/plain streams and drives them with h2load (16 connections, one request in flight
each, 100-byte appends) pinned to another CPU, so the server's core does nothing else. After a
one-second warm-up, two passes:

1. A clean pass: the server's CPU time over the pass (user + kernel, all threads, from
   /proc/PID/stat, the fields ops.loadtest.servers.cpu_seconds adds up) divided by the appends
   answered 2xx is the **µs of server CPU per append**. /proc also says how much of it is kernel
   time, and how much is the main thread's (/proc/PID/task/PID/stat); the rest is other threads'
   (disk storage's writer threads).
2. A sampled pass, the same load while `py-spy record --format raw --threads` samples the server
   499 times a second (py-spy on the load's CPU). Each sample goes to one component: walk its
   stack from the innermost frame outward and take the first frame a rule of `RULES` matches (file
   by glob, function by py-spy's qualified name). So a dataclass's generated `__init__` or
   `dataclasses.replace` belongs to whoever called it, and trio's `reschedule` to trio, whoever
   called that. A stack of standard-library frames alone matches nothing: "other".

The clean pass's µs are then split in proportion to samples, in four parts /proc measures apart:
the main thread's kernel time over its samples taken in a syscall (`KERNEL_RULES`: the edge's socket
reads and writes, epoll_ctl, waking a worker thread, storage's writes and syncs), its user time over
its other samples, and the same for the other threads. Their samples are mostly wall time in
pwrite and fdatasync, but their CPU from /proc is what gets split, so that does not inflate them. A
part with no samples is spread over the thread's other samples, or goes to "other" if it has none.
Within a part samples weigh alike, so the worker threads' split is the roughest: a short syscall
(prctl naming the thread for each job) is caught more often than its share against a long one
(fdatasync, asleep on the disk most of the time).

Sampling mode. By default py-spy stops the server for each sample (ptrace) and reads whole,
consistent stacks. That slows the server a few per cent (the table shows appends/s while sampled)
and lands samples on syscalls about twice as often as /proc's kernel time says they take, which the
kernel/user split corrects. `--nonblocking` (py-spy's) reads stacks while the server runs: under this
load 30-45 % of its reads failed and the rest were cut short (6 frames on average against 15), so
deep work shrank to a few per cent (planning and storage, ~14 µs of an in-memory append timed on
their own, came out at 2-3 µs) and shallow frames (the edge's loop) swelled. It is there to compare.

Left out of the split and counted apart: samples with no frames, and samples whose innermost frame
is a wait (`IDLE_RULES`: trio's `EpollIOManager.get_events`, a trio worker thread waiting for a job,
`threading` and `selectors` waits). py-spy without `--idle` should drop threads that are asleep, but
it reports trio's idle worker threads (blocked on a lock, waiting for a job) as running: they are
most of the samples left out, even on memory storage, whose server starts a worker thread or two.
The event loop itself is seldom caught waiting (1-2 % of its samples): under this load trio polls
epoll with a zero timeout while tasks are runnable.

Without `--native` C code has no frames of its own: llhttp's parsing is `RequestReader.feed`'s self
time (streamkeep/http/h1_parser.py), and a syscall is its Python caller's: the edge reads and writes
plain TCP sockets itself (`streamkeep/http/sockets.py`, h1_connection.py's `_send`,
h2_connection.py's `receive` and `write_queued`), which the rules name as socket I/O, as they do
trio's socket methods. The top list ranks functions by that self time (the innermost frame), in µs
per append.

The figures are for one machine at one moment: compare columns of the same run, or runs taken the
same way (docs/benchmarks.md keeps the budget table, before and after optimisations).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from fnmatch import fnmatchcase
from pathlib import Path
from urllib.parse import urlsplit

from ops.loadtest import h2load
from ops.loadtest.servers import pin
from ops.serverproc import ROOT, ServerProcess, start

CLIENTS = 16
BODY_BYTES = 100
SAMPLE_RATE = 499  # a prime, so sampling does not beat in step with anything periodic
WARM_UP_SECONDS = 1.0
STORAGES = ("memory", "disk")
PROTOCOLS = ("h1", "h2c")

# ---- components and the rules that assign frames to them -------------------------------

HTTP1 = "edge: HTTP/1.1 (llhttp parse, encode)"
HTTP2 = "edge: HTTP/2 (h2, hpack, frames)"
GLUE = "edge: request/response glue"
ROUTING = "routing"
AUTH = "auth"
HEADERS = "header parsing"
HANDOFF = "actor hand-off"
PLANNING = "planning"
STORAGE = "storage"
THREADS = "worker-thread hand-off"
PUBLISH = "publish"
RESPONSE = "response building"
METRICS = "metrics"
SOCKET = "socket I/O (syscalls)"
TRIO = "trio scheduling"
OTHER = "other"
COMPONENTS = (
    HTTP1, HTTP2, GLUE, ROUTING, AUTH, HEADERS, HANDOFF, PLANNING, STORAGE, THREADS, PUBLISH, RESPONSE, METRICS,
    SOCKET, TRIO, OTHER,
)  # fmt: skip

# Samples left out of the split (counted apart).
IDLE = "idle wait"
EMPTY = "no frames"


@dataclass(frozen=True)
class Frame:
    function: str  # py-spy's name: the qualified name on 3.11+ ("StreamActor.call")
    file: str  # py-spy's short file name ("streamkeep/server/service.py", "trio/_core/_run.py")
    line: int | None = None


@dataclass(frozen=True)
class Rule:
    """Frames of files matching `file` (a glob on py-spy's short file name), and of a function
    matching one of `functions` (globs on the qualified name), belong to `component`."""

    component: str
    file: str
    functions: tuple[str, ...] = ("*",)

    def matches(self, frame: Frame) -> bool:
        # py-spy shortens paths to the package part; `--full-filenames` would not, hence "*/".
        if not (fnmatchcase(frame.file, self.file) or fnmatchcase(frame.file, "*/" + self.file)):
            return False
        return any(fnmatchcase(frame.function, pattern) for pattern in self.functions)


# StreamActor's mailbox and the inline path that skips it (the handlers are planning).
_MAILBOX = (
    "StreamActor.call", "StreamActor.call_now", "StreamActor.run", "StreamActor._handle",
    "StreamActor._answer_pending", "StreamActor._mailbox",
)  # fmt: skip

# First match wins for each frame, so a file that holds several components lists its functions
# before the rule for the rest of the file. Keep it current as code moves: tests/test_profile_append.py
# checks that every streamkeep function named here still exists; a component that grows
# suspiciously, or "other", is where a missing rule shows.
RULES: tuple[Rule, ...] = (
    # -- files holding several components, by function --
    # The edge reads and writes plain TCP sockets itself (os.read, os.write): without --native a
    # syscall's time is its caller's self time.
    Rule(SOCKET, "streamkeep/http/sockets.py", ("receive", "write_now")),
    Rule(SOCKET, "streamkeep/http/h1_connection.py", ("_send", "ChunkedPush.write")),
    Rule(SOCKET, "streamkeep/http/h2_connection.py", ("_H2Connection.receive", "_H2Connection.write_queued")),
    Rule(HANDOFF, "streamkeep/actors/actor.py", _MAILBOX),
    Rule(PUBLISH, "streamkeep/actors/stream_ops.py", ("StreamOps._notify",)),
    Rule(HEADERS, "streamkeep/protocol/stream.py", ("*.from_request", "*.from_headers")),
    Rule(RESPONSE, "streamkeep/protocol/stream.py", ("AppendOutcome.headers",)),
    Rule(HEADERS, "streamkeep/protocol/model.py", ("Headers.*",)),
    Rule(RESPONSE, "streamkeep/protocol/model.py", ("Response.*",)),
    Rule(RESPONSE, "streamkeep/protocol/offsets.py", ("encode",)),  # Stream-Next-Offset
    Rule(ROUTING, "streamkeep/server/service.py", ("Service._dispatch",)),
    Rule(ROUTING, "streamkeep/registry/entries.py", ("refuse_writes",)),  # a check of every write
    # -- the edge --
    Rule(HTTP1, "streamkeep/http/h1_parser.py"),
    Rule(HTTP1, "streamkeep/http/h1_writer.py"),
    Rule(HTTP1, "streamkeep/http/reasons.py"),  # status lines are cached: seldom seen
    Rule(HTTP1, "httptools/*"),
    Rule(HTTP2, "streamkeep/http/h2_connection.py"),
    Rule(HTTP2, "h2/*"),
    Rule(HTTP2, "hpack/*"),
    Rule(HTTP2, "hyperframe/*"),
    Rule(HTTP2, "streamkeep/http/h2_*.py"),  # the edge's own request checks and response encoder
    Rule(GLUE, "streamkeep/http/*"),  # accept.py, h1_connection.py, edge.py, budget.py
    Rule(GLUE, "streamkeep/protocol/model.py"),  # Request
    # -- the service --
    Rule(ROUTING, "streamkeep/protocol/routes.py"),
    Rule(ROUTING, "streamkeep/protocol/names.py"),
    Rule(AUTH, "streamkeep/auth/*"),
    Rule(HEADERS, "streamkeep/protocol/headers.py"),
    Rule(HEADERS, "streamkeep/protocol/offsets.py"),
    Rule(HANDOFF, "streamkeep/actors/mailbox.py"),
    Rule(HANDOFF, "streamkeep/actors/supervisor.py"),
    Rule(HANDOFF, "trio/_channel.py"),  # the mailbox is a trio memory channel
    Rule(PLANNING, "streamkeep/actors/*"),  # StreamOps.append_now/_existing, PendingAppend
    Rule(PLANNING, "streamkeep/protocol/stream.py"),  # plan_append, apply_append, copy_meta
    Rule(PLANNING, "streamkeep/protocol/jsonmode.py"),
    Rule(STORAGE, "streamkeep/storage/*"),
    Rule(PUBLISH, "streamkeep/server/fanout.py"),
    Rule(PUBLISH, "streamkeep/server/live.py"),
    Rule(PUBLISH, "streamkeep/subscriptions/*"),
    Rule(PUBLISH, "streamkeep/registry/*"),
    Rule(METRICS, "streamkeep/telemetry/*"),
    Rule(RESPONSE, "streamkeep/protocol/*"),  # responses.py, cors.py, errors.py
    Rule(RESPONSE, "streamkeep/server/*"),  # Service.handle, Service._append, Finish.finish
    # -- the runtime --
    Rule(SOCKET, "trio/_socket.py"),
    Rule(SOCKET, "trio/_highlevel_socket.py"),
    Rule(SOCKET, "socket.py"),
    # trio.to_thread (disk storage's writes and syncs): handing work to a thread and its result back.
    Rule(THREADS, "trio/_threads.py"),
    Rule(THREADS, "trio/_core/_thread_cache.py"),
    Rule(THREADS, "trio/_core/_entry_queue.py"),
    Rule(THREADS, "trio/_core/_wakeup_socketpair.py"),
    Rule(TRIO, "trio/*"),
    Rule(TRIO, "outcome/*"),
    Rule(TRIO, "sniffio/*"),
)

# A sample whose innermost frame is one of these waited rather than ran (see the docstring).
IDLE_RULES: tuple[Rule, ...] = (
    Rule(IDLE, "trio/_core/_io_epoll.py", ("EpollIOManager.get_events",)),
    Rule(IDLE, "trio/_core/_thread_cache.py", ("WorkerThread._work",)),  # waiting for a job
    Rule(IDLE, "threading.py", ("*.wait",)),
    Rule(IDLE, "selectors.py", ("*.select",)),
)

# Innermost frames in a syscall (its Python caller, without --native): the thread's kernel time
# from /proc is split over the samples taken here, its user time over the rest (see the docstring).
KERNEL_RULES: tuple[Rule, ...] = (
    *(rule for rule in RULES if rule.component == SOCKET),
    Rule(TRIO, "trio/_core/_io_epoll.py", ("EpollIOManager._update_registrations",)),  # epoll_ctl
    Rule(THREADS, "trio/_core/_wakeup_socketpair.py", ("WakeupSocketpair.wakeup_thread_and_signal_safe",)),
    # A futex wake; naming the worker thread for each job (prctl, through ctypes).
    Rule(THREADS, "trio/_core/_thread_cache.py", ("ThreadCache.start_thread_soon", "*.namefunc")),
    Rule(STORAGE, "streamkeep/storage/disk/writer.py", ("SegmentWriter.write",)),  # fdatasync, fsync
    Rule(STORAGE, "streamkeep/storage/files.py", ("pwrite_all", "write_all", "fsync_dir")),
)


def attribute(frames: Sequence[Frame]) -> str:
    """The component of one sample; `frames` root first, as py-spy writes them."""
    if not frames:
        return EMPTY
    if any(rule.matches(frames[-1]) for rule in IDLE_RULES):
        return IDLE
    for frame in reversed(frames):
        for rule in RULES:
            if rule.matches(frame):
                return rule.component
    return OTHER


def in_kernel(frames: Sequence[Frame]) -> bool:
    return bool(frames) and any(rule.matches(frames[-1]) for rule in KERNEL_RULES)


# ---- py-spy's raw output ------------------------------------------------------------------


@dataclass(frozen=True)
class Stack:
    frames: tuple[Frame, ...]  # root first
    count: int
    thread: str = ""  # py-spy's thread name ("MainThread", "Trio thread 0"); "" without --threads
    tid: int | None = None  # the OS thread id


_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")
_THREAD = re.compile(r"^thread \((?P<tid>0x[0-9a-fA-F]+|\d+)\)(?:: (?P<name>.*))?$")


def parse_frame(text: str) -> Frame:
    match = _FRAME.match(text)
    if match is None:
        return Frame(text, "")
    line = match.group("line")
    return Frame(match.group("function"), match.group("file"), int(line) if line else None)


def parse_raw(text: str) -> list[Stack]:
    """py-spy's `--format raw`: one collapsed stack a line, `frame;frame;...;frame COUNT`."""
    stacks = []
    for line in text.splitlines():
        body, _, count = line.rstrip().rpartition(" ")
        if not body or not count.isdigit():
            continue
        parts = body.split(";")
        thread, tid = "", None
        if parts and (match := _THREAD.match(parts[0])):
            thread = match.group("name") or ""
            tid = int(match.group("tid"), 0)
            parts = parts[1:]
        stacks.append(Stack(tuple(parse_frame(part) for part in parts if part), int(count), thread, tid))
    return stacks


# ---- from samples to microseconds ---------------------------------------------------------


@dataclass
class Breakdown:
    us: dict[str, float]  # component -> µs of server CPU per append
    samples: dict[str, int]  # component -> samples (all threads)
    top: list[tuple[str, int, float]]  # (function (file), self samples, µs), costliest first
    left_out: dict[str, int]  # IDLE / EMPTY -> samples
    threads: dict[str, int]  # thread name -> samples kept
    unsampled_us: float = 0.0  # CPU of a thread pool with no samples to split it by (under "other")
    # component -> its costliest functions by self time, [(function (file), µs)]: what is inside a row
    inside: dict[str, list[tuple[str, float]]] = field(default_factory=dict)


def self_name(frames: Sequence[Frame]) -> str:
    """The innermost frame, as the top list shows it. Generated code (a dataclass's `__init__`,
    file "<string>") is named with its caller, or every dataclass would look the same."""
    inner = frames[-1]
    name = f"{inner.function} ({inner.file})"
    if inner.file.startswith("<") and len(frames) > 1:
        name += f" in {frames[-2].function}"
    return name


@dataclass(frozen=True)
class Cpu:
    """One thread pool's CPU per append, from /proc."""

    us: float  # user + kernel
    sys_us: float = 0.0  # of which kernel time


def breakdown(stacks: Iterable[Stack], pid: int, main: Cpu, other: Cpu, top: int = 8) -> Breakdown:
    """Splits the main thread's and the other threads' µs per append, kernel and user time apart,
    over their own samples (see the docstring)."""
    # (main thread?, in a syscall?) -> (component, self name) -> samples
    kept: dict[tuple[bool, bool], Counter[tuple[str, str]]] = {}
    left_out: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    for stack in stacks:
        component = attribute(stack.frames)
        if component in (IDLE, EMPTY):
            left_out[component] += stack.count
            continue
        is_main = stack.tid == pid if stack.tid is not None else stack.thread in ("", "MainThread")
        part = kept.setdefault((is_main, in_kernel(stack.frames)), Counter())
        part[(component, self_name(stack.frames))] += stack.count
        threads[stack.thread or "?"] += stack.count
    weights: dict[tuple[bool, bool], float] = {}  # µs per sample, by part
    unsampled = 0.0
    for is_main, cpu in ((True, main), (False, other)):
        kernel = sum(kept.get((is_main, True), Counter()).values())
        user = sum(kept.get((is_main, False), Counter()).values())
        kernel_us = min(max(cpu.sys_us, 0.0), cpu.us)
        if kernel and user:
            weights[(is_main, True)] = kernel_us / kernel
            weights[(is_main, False)] = (cpu.us - kernel_us) / user
        elif kernel or user:  # nothing to tell the two apart by: the thread's CPU over its samples
            weights[(is_main, True)] = weights[(is_main, False)] = cpu.us / (kernel + user)
        else:
            unsampled += cpu.us
    us = dict.fromkeys(COMPONENTS, 0.0)
    samples = dict.fromkeys(COMPONENTS, 0)
    self_us: defaultdict[tuple[str, str], float] = defaultdict(float)  # µs: Counter holds ints
    self_samples: Counter[str] = Counter()
    for key, part in kept.items():
        for (component, function), count in part.items():
            us[component] += count * weights[key]
            samples[component] += count
            self_us[(component, function)] += count * weights[key]
            self_samples[function] += count
    us[OTHER] += unsampled
    by_function: defaultdict[str, float] = defaultdict(float)
    inside: dict[str, list[tuple[str, float]]] = {}
    for (component, function), value in sorted(self_us.items(), key=lambda item: -item[1]):
        by_function[function] += value
        if len(inside.setdefault(component, [])) < 5:
            inside[component].append((function, value))
    ranked = sorted(by_function, key=lambda name: (-by_function[name], name))[:top]
    return Breakdown(
        us,
        samples,
        [(name, self_samples[name], by_function[name]) for name in ranked],
        {IDLE: left_out[IDLE], EMPTY: left_out[EMPTY]},
        dict(threads),
        unsampled,
        inside,
    )


# ---- one combination: a server, its streams, two passes ---------------------------------


@dataclass
class Pass:
    ok: int
    failed: int
    seconds: float
    cpu_us: float  # server CPU per append, all threads
    main_us: float  # the main thread's (the event loop's) share
    other_us: float
    sys_us: float = 0.0  # kernel time, all threads
    main_sys_us: float = 0.0

    @property
    def main(self) -> Cpu:
        return Cpu(self.main_us, self.main_sys_us)

    @property
    def other(self) -> Cpu:
        return Cpu(self.other_us, self.sys_us - self.main_sys_us)

    @property
    def per_second(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0


@dataclass
class Combination:
    storage: str
    protocol: str
    clean: Pass
    sampled: Pass
    breakdown: Breakdown
    py_spy: dict[str, int] = field(default_factory=dict)  # samples and errors py-spy reported

    @property
    def name(self) -> str:
        return f"{self.storage} {self.protocol}"


class Progress:
    """Progress lines on stderr, so stdout stays the table a person can paste."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:4.0f} s] {message}", file=sys.stderr, flush=True)


def cpu_times(stat: Path) -> tuple[float, float]:
    """User and kernel seconds from a /proc stat file (a process's, or one thread's under task/)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def start_server(storage: str, data: Path) -> ServerProcess:
    # As ops/loadtest/servers.py starts them for the load tests.
    if storage == "memory":
        return start("--storage", "memory", "--log-level", "warning", "--max-total-bytes", "16GiB")
    durable = ["--storage", "disk", "--data-dir", str(data / "streamkeep"), "--fsync", "always"]
    return start(*durable, "--log-level", "warning")


def create_streams(url: str, count: int, prefix: str = "profile") -> list[str]:
    """`count` text/plain streams, created over one connection as a client would (through a
    cluster's front door too)."""
    address = urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname or "127.0.0.1", address.port, timeout=10)
    paths = [f"/v1/stream/{prefix}-{i}" for i in range(count)]
    try:
        for path in paths:
            connection.request("PUT", path, headers={"Content-Type": "text/plain"})
            response = connection.getresponse()
            response.read()
            if response.status != 201:
                raise RuntimeError(f"PUT {path}: {response.status} {response.reason}")
    finally:
        connection.close()
    return paths


@dataclass(frozen=True)
class Setup:
    seconds: float
    server_cpu: int
    load_cpu: int
    body: Path
    py_spy: str
    nonblocking: bool = False


def load(server: ServerProcess, paths: list[str], protocol: str, setup: Setup, seconds: float) -> Pass:
    pid = server.process.pid
    process, thread = Path(f"/proc/{pid}/stat"), Path(f"/proc/{pid}/task/{pid}/stat")
    before, before_main = cpu_times(process), cpu_times(thread)
    result = h2load.run(
        server, paths, clients=CLIENTS, body=setup.body, content_type="text/plain",
        h2=protocol == "h2c", seconds=seconds, cpus=str(setup.load_cpu),
    )  # fmt: skip
    after, after_main = cpu_times(process), cpu_times(thread)
    if not result.ok:
        raise RuntimeError(f"{protocol}: no append succeeded ({result.failed} failed)")
    user, kernel = after[0] - before[0], after[1] - before[1]
    # Both count clock ticks, rounded apart: the main thread can read a tick above the whole.
    main_user = min(user, after_main[0] - before_main[0])
    main_kernel = min(kernel, after_main[1] - before_main[1])
    per = 1e6 / result.ok
    total, main = (user + kernel) * per, (main_user + main_kernel) * per
    return Pass(
        result.ok, result.failed, result.seconds, total, main, total - main, kernel * per, main_kernel * per
    )


def sampled_load(
    server: ServerProcess, paths: list[str], protocol: str, setup: Setup, out: Path
) -> tuple[Pass, list[Stack], dict[str, int]]:
    """The load while py-spy samples: py-spy first (its attach takes a moment), the load a second
    longer than the sampling, so every sample falls under load."""
    duration = max(1, round(setup.seconds))
    command = [
        "taskset", "-c", str(setup.load_cpu), setup.py_spy, "record", "--format", "raw",
        "--rate", str(SAMPLE_RATE), "--threads", "--pid", str(server.process.pid),
        "--duration", str(duration), "-o", str(out), *(["--nonblocking"] if setup.nonblocking else []),
    ]  # fmt: skip
    spy = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    sampling = threading.Event()

    def pump() -> None:
        assert spy.stdout is not None
        for line in spy.stdout:
            lines.append(line)
            if "Sampling process" in line:
                sampling.set()
        sampling.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    if not sampling.wait(20) or spy.poll() not in (None, 0):
        spy.kill()
        raise RuntimeError("py-spy did not start sampling:\n" + "".join(lines))
    try:
        measured = load(server, paths, protocol, setup, duration + 1.0)
    except BaseException:
        spy.kill()
        raise
    try:
        spy.wait(timeout=30)
    except subprocess.TimeoutExpired:
        spy.kill()
        raise RuntimeError("py-spy did not finish:\n" + "".join(lines)) from None
    reader.join(5)
    if spy.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy failed (exit {spy.returncode}):\n" + "".join(lines))
    counts = re.search(r"Samples: (\d+) Errors: (\d+)", "".join(lines))
    stats = {"samples": int(counts.group(1)), "errors": int(counts.group(2))} if counts else {}
    return measured, parse_raw(out.read_text()), stats


def profile(storage: str, protocol: str, setup: Setup, progress: Progress) -> Combination:
    name = f"{storage} {protocol}"
    with tempfile.TemporaryDirectory(prefix="profile-", dir=ROOT) as tmp:
        work = Path(tmp)
        progress(f"{name}: starting the server (pinned to CPU {setup.server_cpu})")
        server = start_server(storage, work)
        try:
            pin(server.process.pid, setup.server_cpu)
            paths = create_streams(server.url, CLIENTS)
            progress(f"{name}: warm-up, {WARM_UP_SECONDS:g} s")
            load(server, paths, protocol, setup, WARM_UP_SECONDS)
            progress(f"{name}: clean pass, {setup.seconds:g} s of h2load (CPU {setup.load_cpu})")
            clean = load(server, paths, protocol, setup, setup.seconds)
            progress(
                f"{name}: {clean.per_second:,.0f} appends/s, {clean.cpu_us:.1f} µs of server CPU each; "
                f"sampled pass, py-spy at {SAMPLE_RATE}/s"
            )
            sampled, stacks, stats = sampled_load(server, paths, protocol, setup, work / "py-spy.txt")
        finally:
            server.stop()
    result = breakdown(stacks, server.process.pid, clean.main, clean.other)
    progress(
        f"{name}: {sum(result.samples.values()):,} samples kept, {stats.get('errors', '?')} py-spy errors"
    )
    return Combination(storage, protocol, clean, sampled, result, stats)


# ---- output ----------------------------------------------------------------------------------


def percentages(us: dict[str, float]) -> dict[str, float]:
    total = sum(us.values())
    return {component: (value / total * 100 if total else 0.0) for component, value in us.items()}


def format_text(combination: Combination) -> str:
    clean, sampled, result = combination.clean, combination.sampled, combination.breakdown
    spy = combination.py_spy
    lines = [
        f"{combination.name}: {clean.per_second:,.0f} appends/s, {clean.cpu_us:.1f} µs of server CPU per "
        f"append (main thread {clean.main_us:.1f}, other threads {clean.other_us:.1f}; kernel time "
        f"{clean.sys_us:.1f}); {clean.failed} failed",
        f"  sampled pass: {sampled.per_second:,.0f} appends/s, {sampled.cpu_us:.1f} µs per append; "
        f"{sum(result.samples.values()):,} samples kept, left out {result.left_out[IDLE]} idle wait and "
        f"{result.left_out[EMPTY]} without frames; py-spy errors {spy.get('errors', '?')} (stacks that changed as read)",
        f"  samples by thread: {', '.join(f'{name} {count:,}' for name, count in result.threads.items())}",
        f"  {'component':<40} {'µs/append':>10} {'%':>6}",
    ]
    shares = percentages(result.us)
    for component in COMPONENTS:
        lines.append(f"  {component:<40} {result.us[component]:>10.1f} {shares[component]:>6.1f}")
    lines.append(f"  {'total':<40} {sum(result.us.values()):>10.1f} {100.0:>6.1f}")
    if result.unsampled_us:
        lines.append(
            f"  ({result.unsampled_us:.1f} µs of CPU came from threads with no samples: under 'other')"
        )
    lines.append("  top functions by self time (innermost frame):")
    total = sum(result.us.values()) or 1.0
    for function, count, us in result.top:
        lines.append(f"    {us:6.1f} µs {us / total * 100:5.1f} % {count:6,} samples  {function}")
    return "\n".join(lines)


def header(argv: Sequence[str], seconds: float, cpus: tuple[int, int], nonblocking: bool = False) -> str:
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(["python -m ops.profile_append", shlex.join(argv)]).strip()
    return (
        f"date: {date}; machine: {platform.node()}, {os.cpu_count()} CPUs; "
        f"{platform.python_implementation()} {platform.python_version()}; command: `{command}`; "
        f"server on CPU {cpus[0]}, h2load and py-spy on CPU {cpus[1]}; {CLIENTS} connections, "
        f"{BODY_BYTES} B appends, {seconds:g} s per pass, py-spy at {SAMPLE_RATE}/s"
        f"{' --nonblocking' if nonblocking else ''}"
    )


def format_markdown(combinations: Sequence[Combination], head: str) -> str:
    names = [combination.name for combination in combinations]
    lines = [head, "", "| component | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    shares = [percentages(combination.breakdown.us) for combination in combinations]
    for component in COMPONENTS:
        cells = [
            f"{combination.breakdown.us[component]:.1f} µs ({share[component]:.1f} %)"
            for combination, share in zip(combinations, shares, strict=True)
        ]
        lines.append(f"| {component} | " + " | ".join(cells) + " |")
    totals = [f"**{sum(c.breakdown.us.values()):.1f} µs**" for c in combinations]
    lines.append("| **server CPU per append** | " + " | ".join(totals) + " |")
    threads = [f"{c.clean.main_us:.1f} / {c.clean.other_us:.1f} µs" for c in combinations]
    lines.append("| main thread / other threads | " + " | ".join(threads) + " |")
    kernel = [f"{c.clean.sys_us:.1f} µs" for c in combinations]
    lines.append("| of which kernel time | " + " | ".join(kernel) + " |")
    lines.append(
        "| appends/s (clean pass) | " + " | ".join(f"{c.clean.per_second:,.0f}" for c in combinations) + " |"
    )
    sampled = [f"{c.sampled.per_second:,.0f}" for c in combinations]
    lines.append("| appends/s (while sampled) | " + " | ".join(sampled) + " |")
    kept = [
        f"{sum(c.breakdown.samples.values()):,} ({c.py_spy.get('errors', '?')} errors)" for c in combinations
    ]
    lines.append("| py-spy samples kept (errors) | " + " | ".join(kept) + " |")
    lines += ["", "Top functions by self time (innermost frame; µs per append):", ""]
    lines += ["| # | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for rank in range(max((len(c.breakdown.top) for c in combinations), default=0)):
        cells = []
        for combination in combinations:
            top = combination.breakdown.top
            if rank < len(top):
                function, _, us = top[rank]
                cells.append(f"`{function}` {us:.1f}")
            else:
                cells.append("")
        lines.append(f"| {rank + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def as_json(combinations: Sequence[Combination], head: str) -> dict:
    return {
        "header": head,
        "components": list(COMPONENTS),
        "combinations": [
            {
                "storage": c.storage,
                "protocol": c.protocol,
                "clean": {**asdict(c.clean), "per_second": c.clean.per_second},
                "sampled": {**asdict(c.sampled), "per_second": c.sampled.per_second},
                "py_spy": c.py_spy,
                **asdict(c.breakdown),
            }
            for c in combinations
        ],
    }


# ---- command line ----------------------------------------------------------------------------


class Missing(Exception):
    """A tool the profile needs is not installed (exit status 2)."""


def find_py_spy() -> str:
    beside = Path(sys.executable).parent / "py-spy"
    if beside.exists():
        return str(beside)
    found = shutil.which("py-spy")
    if found is None:
        raise Missing(
            "py-spy is missing: `make profile` installs it (.venv's dev extra), or pip install py-spy"
        )
    return found


def check_tools() -> tuple[str, tuple[int, int]]:
    """py-spy's path and the CPUs for the server and the load; raises Missing."""
    if not h2load.available():
        raise Missing(
            "h2load is missing: `make profile` installs it (Debian: apt-get install nghttp2-client)"
        )
    if shutil.which("taskset") is None:
        raise Missing("taskset is missing: install util-linux (Debian: apt-get install util-linux)")
    py_spy = find_py_spy()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise Missing(f"needs two CPUs, one for the server and one for the load; this process may use {cpus}")
    return py_spy, (cpus[0], cpus[1])


def choices(text: str, allowed: Sequence[str]) -> list[str]:
    picked = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in picked if item not in allowed]
    if unknown or not picked:
        raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}")
    return picked


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m ops.profile_append", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="per pass (default 6)")
    parser.add_argument("--storage", type=lambda text: choices(text, STORAGES), default=list(STORAGES))
    parser.add_argument("--protocols", type=lambda text: choices(text, PROTOCOLS), default=list(PROTOCOLS))
    parser.add_argument("--markdown", action="store_true", help="one table, components by combination")
    parser.add_argument("--json", type=Path, help="write the raw numbers here")
    parser.add_argument(
        "--nonblocking",
        action="store_true",
        help="py-spy does not stop the server to sample (biased: see above)",
    )
    args = parser.parse_args(argv)
    try:
        py_spy, cpus = check_tools()
    except Missing as missing:
        print(f"profile_append: {missing}", file=sys.stderr)
        return 2
    progress = Progress()
    head = header(argv, args.seconds, cpus, args.nonblocking)
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "body"
        body.write_bytes(b"x" * BODY_BYTES)
        setup = Setup(args.seconds, cpus[0], cpus[1], body, py_spy, args.nonblocking)
        combinations = [
            profile(storage, protocol, setup, progress)
            for storage in args.storage
            for protocol in args.protocols
        ]
    if args.markdown:
        print(format_markdown(combinations, head))
    else:
        print(head)
        for combination in combinations:
            print()
            print(format_text(combination))
    if args.json is not None:
        args.json.write_text(json.dumps(as_json(combinations, head), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
