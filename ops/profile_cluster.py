"""The cluster's front door measured like one server: what a hop through HAProxy costs per append.

    python -m ops.profile_cluster [--seconds 8] [--rounds 2] [--share 0.5 | --rate N] [--clients 32]
                                  [--storage memory|disk] [--protocol h1|h2c] [--no-sample] [--perf]
                                  [--haproxy-drop REGEX] [--haproxy-defaults LINE]
                                  [--haproxy-replace OLD NEW] [--markdown] [--json FILE]

Issue 26 measured an 8-member `cluster run` on 16 cores: members spent 5-40 µs more CPU per append
through HAProxy than on the same load sent straight to them, and HAProxy 34-43 µs of its own. This
reproduces the mechanism on a 2-core machine. `streamkeep cluster run --processes 1` starts one
member behind HAProxy as `cluster run` generates it today; the member is pinned alone to one CPU,
HAProxy (so one thread), h2load and py-spy to the other. Then, against that one member process:

1. **direct, saturated**: h2load with `--clients` connections, one append in flight each, as fast
   as the member answers: its capacity, and the CPU per append of a member with all the work it can
   take (what `make profile` measures).
2. **direct, paced** and 3. **front door, paced**, alternated `--rounds` times: the same number of
   connections paced by h2load (`--rps`) at the rate a member gets in an 8-member cluster. Issue
   26's members took 57-77k appends/s between 8, 7-10k each, where one process direct did 17-18k:
   about half a member's capacity, hence `--share 0.5` of pass 1's rate (or `--rate`). 32 client
   connections by default: 256 over 8 members.

Per pass and process, from /proc: user and kernel CPU (/proc/PID/stat, which counts threads that
have ended too; the member's main thread apart from /proc/PID/task/PID/stat) and context switches,
voluntary (the thread slept: waited for I/O or a lock) and involuntary (it was preempted), summed
over /proc/PID/task/*/status (threads alive at both reads; a trio worker thread that ended between
them is missed). Everything is divided by the appends answered 2xx. The difference of the two paced
passes is the hop: HAProxy's CPU, plus the member's extra CPU and switches for the same appends at
the same rate. The difference of passes 1 and 2 is what pacing alone costs the member (fewer
requests per wake-up), which a hop can make worse but does not cause.

Then, unless `--no-sample`, each paced path once more while py-spy samples the member (as in
ops/profile_append.py, whose rules attribute the samples): the member's µs per append of the clean
passes are split by component for direct and front door, and the difference says where the
member's extra microseconds go. The member's answers are the same both ways, but HAProxy adds four
request headers (X-Forwarded-For and three Streamkeep-* ones) and keeps its own connections to the
member; the table counts the member's established connections in the middle of each pass.

`--sample-saturated` samples a saturated direct pass too, and splits the member's
saturated µs the same way: the difference with the paced direct pass is what part load costs it.

`--perf` samples HAProxy with Linux perf over one more paced pass of each front door: its hot
symbols, their share of its samples and of its µs per append (no call graphs: HAProxy is C, the
symbol is enough to point at a setting). `--haproxy-drop`, `--haproxy-defaults` and
`--haproxy-replace` start a second HAProxy in front of the same member from the generated
configuration edited so (lines dropped, lines added to `defaults`, text replaced), measured as one
more paced path in every round: what a change to what `cluster run` generates would save, judged in
the same run (`--haproxy-replace 'map(' 'map_int('` shows what c5291c2's `map` saved).

With `--protocol h2c` h2load speaks h2c both ways, but HAProxy speaks HTTP/1.1 to the member: the
member's difference is then h2c's cost against HTTP/1.1's as much as the hop's.

HAProxy's health check (GET /healthz once a second) lands on the member in every pass, direct too:
a few requests among thousands. The figures are for one machine at one moment: compare columns of
the same run (docs/benchmarks.md keeps them with their command).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ops import profile_append as pa
from ops.bench_cluster import children
from ops.loadtest import h2load
from ops.loadtest.servers import pin
from ops.serverproc import ROOT, ServerProcess, launch

CLIENTS = 32  # issue 26's 256 connections over 8 members
STREAMS = 64
BODY_BYTES = 100
SHARE = 0.5  # of a member's direct capacity: what an 8-member cluster gave each (see above)
WARM_UP_SECONDS = 1.0
MEMBER, HAPROXY = "member", "haproxy"
SATURATED, DIRECT, FRONT = "direct, saturated", "direct, paced", "front door, paced"
EDITED = "edited front door, paced"

# ---- /proc -----------------------------------------------------------------------------------


def stat_ticks(text: str) -> tuple[int, int]:
    """(utime, stime) in clock ticks from a /proc/PID/stat or /proc/PID/task/TID/stat line. The
    command name in parentheses may hold spaces and ')', so split after the last one."""
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def switches(text: str) -> tuple[int, int]:
    """(voluntary, involuntary) context switches from a /proc/.../status file."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            found[key] = int(value)
    return found["voluntary_ctxt_switches"], found["nonvoluntary_ctxt_switches"]


@dataclass(frozen=True)
class Usage:
    """A process's CPU (seconds) and context switches so far, or between two reads."""

    user: float = 0.0
    sys: float = 0.0
    main_user: float = 0.0  # the main thread's (a member's event loop)
    main_sys: float = 0.0
    voluntary: int = 0
    involuntary: int = 0

    def __sub__(self, before: Usage) -> Usage:
        return self.combine(before, -1)

    def __add__(self, other: Usage) -> Usage:
        return self.combine(other, 1)

    def combine(self, other: Usage, sign: int) -> Usage:
        return Usage(
            self.user + sign * other.user,
            self.sys + sign * other.sys,
            self.main_user + sign * other.main_user,
            self.main_sys + sign * other.main_sys,
            self.voluntary + sign * other.voluntary,
            self.involuntary + sign * other.involuntary,
        )


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError):  # a thread that ended between listing and reading
        return None


def usage(pid: int, proc: Path = Path("/proc")) -> Usage:
    tick = os.sysconf("SC_CLK_TCK")
    user, system = stat_ticks((proc / str(pid) / "stat").read_text())
    main_user, main_sys = stat_ticks((proc / str(pid) / "task" / str(pid) / "stat").read_text())
    voluntary = involuntary = 0
    for task in (proc / str(pid) / "task").iterdir():
        text = _read(task / "status")
        if text is not None:
            v, n = switches(text)
            voluntary, involuntary = voluntary + v, involuntary + n
    return Usage(user / tick, system / tick, main_user / tick, main_sys / tick, voluntary, involuntary)


def socket_inodes(pid: int, proc: Path = Path("/proc")) -> set[int]:
    """The inodes of the sockets a process holds open (its fds' links read "socket:[INODE]")."""
    found = set()
    for fd in (proc / str(pid) / "fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def connections_to(port: int, inodes: set[int], text: str) -> int:
    """Established TCP connections in /proc/net/tcp (its text) to remote port `port` from a socket
    among `inodes`: HAProxy's connections to the member, told apart from h2load's by who holds them."""
    count = 0
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 9 and fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
            count += int(fields[9]) in inodes
    return count


def haproxy_connections(port: int, haproxy: int) -> int:
    inodes = socket_inodes(haproxy)
    tables = (_read(Path("/proc/net") / name) for name in ("tcp", "tcp6"))
    return sum(connections_to(port, inodes, text) for text in tables if text)


# ---- what a pass measured, per append --------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    """One process's CPU (µs) and context switches per append."""

    user_us: float
    sys_us: float
    voluntary: float
    involuntary: float
    main_us: float = 0.0  # the main thread's part of user + sys
    main_sys_us: float = 0.0

    @property
    def cpu_us(self) -> float:
        return self.user_us + self.sys_us

    @property
    def switches(self) -> float:
        return self.voluntary + self.involuntary


def per_append(used: Usage, ok: int) -> Cost:
    per = 1e6 / ok if ok else 0.0
    # Process and thread totals count clock ticks rounded apart: the main thread can read above.
    main_user, main_sys = min(used.main_user, used.user), min(used.main_sys, used.sys)
    count = 1 / ok if ok else 0.0
    return Cost(
        used.user * per,
        used.sys * per,
        used.voluntary * count,
        used.involuntary * count,
        (main_user + main_sys) * per,
        main_sys * per,
    )


@dataclass
class Pass:
    name: str
    ok: int = 0
    failed: int = 0
    seconds: float = 0.0
    used: dict[str, Usage] = field(default_factory=dict)  # role -> CPU and switches over the pass
    latencies_us: list[int] = field(default_factory=list)
    # HAProxy's connections to the member, counted mid-pass, one count per round
    backend_connections: list[int] = field(default_factory=list)
    member_us: list[float] = field(default_factory=list)  # the member's CPU per append, by round

    def add(self, other: Pass) -> None:
        """Pools another round of the same pass: sums, so the per-append figures weigh appends alike."""
        self.ok += other.ok
        self.failed += other.failed
        self.seconds += other.seconds
        for role, used in other.used.items():
            self.used[role] = self.used.get(role, Usage()) + used
        self.latencies_us += other.latencies_us
        self.backend_connections += other.backend_connections
        if (cost := other.cost(MEMBER)) is not None:
            self.member_us.append(cost.cpu_us)

    @property
    def per_second(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    def cost(self, role: str) -> Cost | None:
        return per_append(self.used[role], self.ok) if role in self.used else None

    def latency_ms(self, fraction: float) -> float:
        """The `fraction` quantile (1.0: the worst) of the appends' latencies, in ms."""
        ordered = sorted(self.latencies_us)
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))] / 1e3


@dataclass(frozen=True)
class Hop:
    """What the front door costs per append over the same rate sent direct."""

    haproxy_user_us: float
    haproxy_sys_us: float
    member_user_us: float  # the member's extra, front door minus direct
    member_sys_us: float
    member_voluntary: float
    member_involuntary: float

    @property
    def member_us(self) -> float:
        return self.member_user_us + self.member_sys_us

    @property
    def total_us(self) -> float:
        return self.haproxy_user_us + self.haproxy_sys_us + self.member_us


def hop(direct: Cost, front: Cost, haproxy: Cost) -> Hop:
    return Hop(
        haproxy.user_us,
        haproxy.sys_us,
        front.user_us - direct.user_us,
        front.sys_us - direct.sys_us,
        front.voluntary - direct.voluntary,
        front.involuntary - direct.involuntary,
    )


# ---- h2load, paced ---------------------------------------------------------------------------


def h2load_command(
    uris: Path, body: Path, *, clients: int, seconds: float, rate: float | None, h2: bool, cpu: int, log: Path
) -> list[str]:
    """h2load with `clients` connections, one append in flight each; with `rate` (appends/s in all)
    each connection is paced at its share (h2load's --rps is per client and takes fractions)."""
    command = ["taskset", "-c", str(cpu), "h2load", "-c", str(clients), "-m", "1", "-d", str(body)]
    command += ["-i", str(uris), "-H", "Content-Type: text/plain", "-D", f"{round(seconds * 1000)}ms"]
    command += ["--log-file", str(log)]
    if rate is not None:
        command += ["--rps", f"{rate / clients:.3f}"]
    if not h2:
        command.append("--h1")
    return command


# ---- the cluster of one ----------------------------------------------------------------------


@dataclass
class Cluster:
    server: ServerProcess  # `cluster run`; its url is the front door's
    member_url: str
    member: int  # pids
    haproxy: int
    config: Path  # the haproxy.cfg `cluster run` generated

    @property
    def member_port(self) -> int:
        return int(self.member_url.rsplit(":", 1)[1])


def member_url(output: Iterable[str]) -> str:
    """The member's own address from `cluster run`'s "member m0 at http://HOST:PORT: ..." line."""
    for line in output:
        if match := re.match(r"member m0 at (http://[^\s]+?):? ", line):
            return match.group(1)
    raise RuntimeError("`cluster run` did not say where its member listens:\n" + "".join(output))


def start_cluster(storage: str, data: Path, load_cpu: int) -> Cluster:
    """`cluster run --processes 1` started on the load's CPU, so HAProxy sees one CPU and runs one
    thread there; the caller pins the member away from it."""
    serve = ["--storage", storage, "--log-level", "warning"]
    serve += ["--max-total-bytes", "16GiB"] if storage == "memory" else ["--fsync", "always"]
    command = ["taskset", "-c", str(load_cpu), sys.executable, "-m", "streamkeep", "cluster", "run"]
    command += ["--processes", "1", "--port", "0", "--data-dir", str(data), *serve]
    server = launch(command, timeout=60)
    try:
        pids = children(server.process.pid)
        comm = {pid: (_read(Path(f"/proc/{pid}/comm")) or "").strip() for pid in pids}
        haproxy = next(pid for pid in pids if comm[pid] == "haproxy")
        member = next(
            pid for pid in pids if "--cluster-member" in (_read(Path(f"/proc/{pid}/cmdline")) or "")
        )
        return Cluster(server, member_url(server.output), member, haproxy, data / "haproxy" / "haproxy.cfg")
    except BaseException:
        server.stop()
        raise


def edit_config(
    text: str,
    *,
    drop: Sequence[str],
    defaults: Sequence[str],
    port: int,
    replace: Sequence[tuple[str, str]] = (),
) -> str:
    """The generated configuration less the lines matching a regular expression of `drop`, with
    `defaults` added to its defaults section and each (old, new) of `replace` replaced as text,
    listening on `port` (the two front doors run side by side; `cluster run --processes 1` binds one
    address, its frontend's)."""
    for old, new in replace:
        text = text.replace(old, new)
    lines = []
    for line in text.splitlines():
        if any(re.search(pattern, line) for pattern in drop):
            continue
        lines.append(re.sub(r"^(\s+bind \S+):\d+", rf"\g<1>:{port}", line))
        if line.strip() == "defaults":
            lines += [f"    {extra}" for extra in defaults]
    return "\n".join(lines) + "\n"


@dataclass
class Edited:
    """A second HAProxy in front of the same member with an edited configuration (`--haproxy-drop`,
    `--haproxy-defaults`): what a change to what `cluster run` generates would save, measured."""

    process: subprocess.Popen[str]
    url: str
    config: str


def start_edited(cluster: Cluster, args: argparse.Namespace, work: Path, load_cpu: int) -> Edited:
    port = free_port()
    replace = [(old, new) for old, new in args.haproxy_replace]
    text = edit_config(cluster.config.read_text(), drop=args.haproxy_drop, defaults=args.haproxy_defaults,
                       port=port, replace=replace)  # fmt: skip
    path = work / "haproxy-edited.cfg"
    path.write_text(text)
    checked = subprocess.run(["haproxy", "-c", "-q", "-f", str(path)], capture_output=True, text=True)
    if checked.returncode != 0:
        raise RuntimeError(
            f"haproxy refused the edited configuration:\n{checked.stdout}{checked.stderr}\n{text}"
        )
    command = ["taskset", "-c", str(load_cpu), "haproxy", "-db", "-f", str(path)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return Edited(process, f"http://127.0.0.1:{port}", text)
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("the edited HAProxy did not listen") from None
            time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Setup:
    seconds: float
    clients: int
    h2: bool
    member_cpu: int
    load_cpu: int
    work: Path  # body and URI files
    py_spy: str | None


def run_load(cluster: Cluster, url: str, paths: list[str], setup: Setup, seconds: float,
             rate: float | None, name: str, haproxy: int | None = None) -> Pass:  # fmt: skip
    """One pass of h2load at `url`, with the member's and HAProxy's /proc read around it."""
    body, uris, log = setup.work / "body", setup.work / f"uris-{name}", setup.work / f"log-{name}"
    log.unlink(missing_ok=True)  # h2load appends to its log file
    uris.write_text("".join(url + path + "\n" for path in paths))
    command = h2load_command(uris, body, clients=setup.clients, seconds=seconds, rate=rate, h2=setup.h2,
                             cpu=setup.load_cpu, log=log)  # fmt: skip
    haproxy = cluster.haproxy if haproxy is None else haproxy
    roles = {MEMBER: cluster.member, HAPROXY: haproxy}
    counted: list[int] = []
    # Counted mid-pass: at the end HAProxy may keep or drop idle connections as its clients leave.
    timer = threading.Timer(
        seconds / 2, lambda: counted.append(haproxy_connections(cluster.member_port, haproxy))
    )
    before = {role: usage(pid) for role, pid in roles.items()}
    timer.start()
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 120)
    after = {role: usage(pid) for role, pid in roles.items()}
    timer.join()
    result = h2load.parse(done.stdout + done.stderr)
    if not result.ok:
        raise RuntimeError(f"{name}: no append succeeded ({result.failed} failed)")
    latencies = h2load.parse_latencies(log.read_text()) if log.exists() else []
    used = {role: after[role] - before[role] for role in roles}
    return Pass(name, result.ok, result.failed, result.seconds, used, latencies, counted)


# ---- where the member's extra microseconds go (py-spy) ---------------------------------------


def sampled(pid: int, setup: Setup, out: Path, load: Callable[[float], object]) -> list[pa.Stack]:
    """py-spy on the member (on the load's CPU) for a whole number of seconds while `load(seconds)`
    runs a second longer, so every sample falls under load."""
    assert setup.py_spy is not None
    duration = max(1, round(setup.seconds))
    command = ["taskset", "-c", str(setup.load_cpu), setup.py_spy, "record", "--format", "raw",
               "--rate", str(pa.SAMPLE_RATE), "--threads", "--pid", str(pid), "--duration", str(duration),
               "-o", str(out)]  # fmt: skip
    spy = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    started = threading.Event()

    def pump() -> None:
        assert spy.stdout is not None
        for line in spy.stdout:
            lines.append(line)
            if "Sampling process" in line:
                started.set()
        started.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not started.wait(20) or spy.poll() not in (None, 0):
            raise RuntimeError("py-spy did not start sampling:\n" + "".join(lines))
        load(duration + 1.0)
        spy.wait(timeout=30)
    finally:
        if spy.poll() is None:
            spy.kill()
    if spy.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy failed (exit {spy.returncode}):\n" + "".join(lines))
    return pa.parse_raw(out.read_text())


def split(stacks: list[pa.Stack], pid: int, cost: Cost) -> pa.Breakdown:
    """The member's clean-pass µs per append split over its samples (profile_append's method)."""
    main = pa.Cpu(cost.main_us, cost.main_sys_us)
    other = pa.Cpu(cost.cpu_us - cost.main_us, cost.sys_us - cost.main_sys_us)
    # Every function, so the difference of two passes does not read a function one list cut off as 0.
    return pa.breakdown(stacks, pid, main, other, top=1_000_000)


def differences(direct: dict[str, float], front: dict[str, float]) -> list[tuple[str, float, float, float]]:
    """(name, direct, front door, front door - direct) for every name in either, largest gain first."""
    names = set(direct) | set(front)
    rows = [(name, direct.get(name, 0.0), front.get(name, 0.0)) for name in names]
    return sorted(((n, d, f, f - d) for n, d, f in rows), key=lambda row: (-row[3], row[0]))


def by_function(result: pa.Breakdown) -> dict[str, float]:
    return {name: us for name, _, us in result.top}


# ---- where HAProxy's microseconds go (perf) ----------------------------------------------------

_PERF_LINE = re.compile(r"^\s*([\d.]+)%\s+(\S+)\s+\[[.k]\]\s+(.+?)\s*$")


def parse_perf(text: str) -> list[tuple[str, float]]:
    """(symbol (object), % of samples) from `perf report --stdio --sort dso,sym`, largest first."""
    rows = [(f"{m.group(3)} ({m.group(2)})", float(m.group(1))) for line in text.splitlines()
            if (m := _PERF_LINE.match(line))]  # fmt: skip
    return sorted(rows, key=lambda row: -row[1])


def perf_profile(
    pid: int, setup: Setup, out: Path, load: Callable[[float], object]
) -> list[tuple[str, float]]:
    """perf's samples of HAProxy (on the load's CPU) while `load(seconds)` runs: its hot symbols."""
    command = [
        "taskset",
        "-c",
        str(setup.load_cpu),
        "perf",
        "record",
        "-F",
        "999",
        "-p",
        str(pid),
        "-o",
        str(out),
    ]
    record = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)  # perf attaches
        load(setup.seconds)
    finally:
        record.send_signal(signal.SIGINT)
        _, errors = record.communicate(timeout=30)
    if record.returncode not in (0, -signal.SIGINT) or not out.exists():
        raise RuntimeError(f"perf record failed (exit {record.returncode}): {errors}")
    report = [
        "perf",
        "report",
        "-i",
        str(out),
        "--no-children",
        "--sort",
        "dso,sym",
        "--stdio",
        "--percent-limit",
        "1",
    ]
    done = subprocess.run(report, capture_output=True, text=True, timeout=60)
    return parse_perf(done.stdout)


# ---- the run ---------------------------------------------------------------------------------


@dataclass
class Report:
    head: str
    rate: float  # the paced passes' target, appends/s
    passes: dict[str, Pass]
    components: list[tuple[str, float, float, float]] = field(default_factory=list)
    functions: list[tuple[str, float, float, float]] = field(default_factory=list)
    # The same, direct: saturated against paced (what part load costs the member), with --sample-saturated
    pacing_components: list[tuple[str, float, float, float]] = field(default_factory=list)
    pacing_functions: list[tuple[str, float, float, float]] = field(default_factory=list)
    samples: dict[str, int] = field(default_factory=dict)  # path -> samples kept
    end: str = ""  # the machine's contention when the passes were done
    edited: str = ""  # the edited HAProxy's configuration, where there is one
    haproxy_symbols: dict[str, list[tuple[str, float]]] = field(
        default_factory=dict
    )  # front door -> perf's %

    def hop(self, name: str = FRONT) -> Hop:
        direct, front = self.passes[DIRECT].cost(MEMBER), self.passes[name].cost(MEMBER)
        haproxy = self.passes[name].cost(HAPROXY)
        assert direct is not None and front is not None and haproxy is not None
        return hop(direct, front, haproxy)

    @property
    def fronts(self) -> list[str]:
        """The paced passes through a front door: the generated one, and the edited one if any."""
        return [name for name in (FRONT, EDITED) if name in self.passes]


def profile(args: argparse.Namespace, setup: Setup, progress: pa.Progress, head: str) -> Report:
    with tempfile.TemporaryDirectory(prefix="profile-cluster-", dir=ROOT) as tmp:
        progress(f"starting `cluster run --processes 1` ({args.storage}), HAProxy on CPU {setup.load_cpu}")
        cluster = start_cluster(args.storage, Path(tmp) / "cluster", setup.load_cpu)
        edited = None
        try:
            pin(cluster.member, setup.member_cpu)
            paths = pa.create_streams(cluster.server.url, STREAMS, prefix="profile-cluster")
            if args.haproxy_drop or args.haproxy_defaults or args.haproxy_replace:
                edited = start_edited(cluster, args, setup.work, setup.load_cpu)
            return measure(cluster, paths, args, setup, progress, head, edited)
        finally:
            if edited is not None:
                edited.process.terminate()
                edited.process.wait(10)
            cluster.server.stop()


def measure(cluster: Cluster, paths: list[str], args: argparse.Namespace, setup: Setup,
            progress: pa.Progress, head: str, edited: Edited | None = None) -> Report:  # fmt: skip
    front, direct = cluster.server.url, cluster.member_url
    # (url, name, HAProxy's pid) of each paced path, alternated in every round.
    paced = [(direct, DIRECT, cluster.haproxy), (front, FRONT, cluster.haproxy)]
    if edited is not None:
        paced.append((edited.url, EDITED, edited.process.pid))
    for url, _, haproxy in paced:
        run_load(cluster, url, paths, setup, WARM_UP_SECONDS, None, "warm-up", haproxy)
    saturated = run_load(cluster, direct, paths, setup, setup.seconds / 2, None, SATURATED)
    rate = args.rate or saturated.per_second * args.share
    progress(
        f"direct, saturated: {saturated.per_second:,.0f} appends/s; pacing at {rate:,.0f}/s "
        f"({setup.clients} connections at {rate / setup.clients:.1f}/s each)"
    )
    passes = {SATURATED: saturated, **{name: Pass(name) for _, name, _ in paced}}
    for round_ in range(args.rounds):
        for url, name, haproxy in paced:
            done = run_load(cluster, url, paths, setup, setup.seconds, rate, name, haproxy)
            cost = done.cost(MEMBER)
            assert cost is not None
            progress(
                f"round {round_ + 1}, {name}: {done.per_second:,.0f}/s, member {cost.cpu_us:.1f} µs/append"
            )
            passes[name].add(done)
    report = Report(head, rate, passes, end=contention(), edited=edited.config if edited else "")
    if args.perf:
        for url, name, haproxy in paced[1:]:
            progress(f"{name}: perf on HAProxy")

            def perf_load(seconds: float, url: str = url, name: str = name, haproxy: int = haproxy) -> object:
                return run_load(cluster, url, paths, setup, seconds, rate, name, haproxy)

            out = setup.work / f"perf-{len(report.haproxy_symbols)}.data"
            report.haproxy_symbols[name] = perf_profile(haproxy, setup, out, perf_load)
    if setup.py_spy is None:
        return report
    results: dict[str, pa.Breakdown] = {}
    sampled_paths = [(direct, DIRECT, rate), (front, FRONT, rate)]
    if args.sample_saturated:
        sampled_paths.append((direct, SATURATED, None))
    for url, name, pace in sampled_paths:
        progress(f"{name}: sampled pass, py-spy at {pa.SAMPLE_RATE}/s on the member")

        def load(seconds: float, url: str = url, name: str = name, pace: float | None = pace) -> object:
            return run_load(cluster, url, paths, setup, seconds, pace, name)

        stacks = sampled(cluster.member, setup, setup.work / f"py-spy-{len(results)}.txt", load)
        cost = passes[name].cost(MEMBER)
        assert cost is not None
        results[name] = split(stacks, cluster.member, cost)
        report.samples[name] = sum(results[name].samples.values())
    report.components = differences(results[DIRECT].us, results[FRONT].us)
    report.functions = differences(by_function(results[DIRECT]), by_function(results[FRONT]))
    if SATURATED in results:
        report.pacing_components = differences(results[SATURATED].us, results[DIRECT].us)
        report.pacing_functions = differences(by_function(results[SATURATED]), by_function(results[DIRECT]))
    return report


# ---- output ----------------------------------------------------------------------------------


def _cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def cost_rows(passes: Sequence[Pass]) -> list[tuple[str, list[float | None], int]]:
    """(label, a value per pass, digits) for the per-append table."""

    def each(role: str, get: Callable[[Cost], float]) -> list[float | None]:
        return [None if (cost := p.cost(role)) is None else get(cost) for p in passes]

    def total(p: Pass) -> float:
        return sum(cost.cpu_us for role in (MEMBER, HAPROXY) if (cost := p.cost(role)) is not None)

    return [
        ("appends/s", [p.per_second for p in passes], 0),
        ("member user µs", each(MEMBER, lambda c: c.user_us), 1),
        ("member sys µs", each(MEMBER, lambda c: c.sys_us), 1),
        ("**member CPU µs**", each(MEMBER, lambda c: c.cpu_us), 1),
        ("HAProxy user µs", each(HAPROXY, lambda c: c.user_us), 1),
        ("HAProxy sys µs", each(HAPROXY, lambda c: c.sys_us), 1),
        ("**all processes µs**", [total(p) for p in passes], 1),
        ("member voluntary switches / append", each(MEMBER, lambda c: c.voluntary), 3),
        ("member involuntary switches / append", each(MEMBER, lambda c: c.involuntary), 3),
        ("HAProxy voluntary switches / append", each(HAPROXY, lambda c: c.voluntary), 3),
        ("HAProxy involuntary switches / append", each(HAPROXY, lambda c: c.involuntary), 3),
        ("HAProxy's connections to the member", [max(p.backend_connections, default=0) for p in passes], 0),
        ("latency p50 ms", [p.latency_ms(0.5) for p in passes], 2),
        ("latency p99 ms", [p.latency_ms(0.99) for p in passes], 2),
        ("latency max ms", [p.latency_ms(1.0) for p in passes], 2),
        ("failed", [float(p.failed) for p in passes], 0),
    ]


def format_markdown(report: Report) -> str:
    names = [SATURATED, DIRECT, *report.fronts]
    passes = [report.passes[name] for name in names]
    lines = [report.head, "", f"Paced passes at {report.rate:,.0f} appends/s.", ""]
    titles = [f"{name.split(',')[0]} - direct (paced)" for name in report.fronts]
    lines += ["| per append | " + " | ".join(names + titles) + " |", "|---" * (len(names + titles) + 1) + "|"]
    for label, values, digits in cost_rows(passes):
        direct = values[1]
        # Counts of things, not costs: their difference says nothing per append.
        uncounted = label in ("appends/s", "failed") or "connections" in label
        differences = [
            None if direct is None or front is None or uncounted else front - direct for front in values[2:]
        ]
        cells = [_cell(value, digits) for value in values + differences]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    by_round = "; ".join(
        f"{name} {', '.join(f'{us:.1f}' for us in report.passes[name].member_us)}" for name in names[1:]
    )
    lines += [
        "",
        f"Member CPU µs per append by round: {by_round}. At the end of the paced passes: {report.end}.",
    ]
    for name in report.fronts:
        h = report.hop(name)
        lines += [
            "",
            f"The hop ({name.split(',')[0]}) costs **{h.total_us:.1f} µs per append**: HAProxy "
            f"{h.haproxy_user_us:.1f} user + {h.haproxy_sys_us:.1f} sys, the member {h.member_user_us:+.1f} user "
            f"and {h.member_sys_us:+.1f} sys ({h.member_voluntary:+.3f} voluntary, "
            f"{h.member_involuntary:+.3f} involuntary switches per append).",
        ]
    for name, symbols in report.haproxy_symbols.items():
        cost = report.passes[name].cost(HAPROXY)
        assert cost is not None
        lines += ["", f"Where HAProxy's µs go ({name}; perf samples, symbols of 1 % or more, "
                  "over the clean passes' CPU):", "", "| symbol | % | µs per append |", "|---|---|---|"]  # fmt: skip
        lines += [
            f"| `{symbol}` | {share:.1f} | {share / 100 * cost.cpu_us:.1f} |"
            for symbol, share in symbols[:12]
        ]
    if report.edited:
        lines += ["", "The edited HAProxy's configuration:", "", "```", report.edited.rstrip(), "```"]
    if report.components:
        lines += ["", "Where the member's µs per append go (py-spy samples over the clean passes' CPU; "
                  f"samples kept: {', '.join(f'{k} {v:,}' for k, v in report.samples.items())}):", ""]  # fmt: skip
        lines += _difference_table("component", report.components)
        lines += ["", "Functions by self time (innermost frame), largest gain first, then largest loss:", ""]
        lines += _difference_table("function", _extremes(report.functions), code=True)
    if report.pacing_components:
        columns = ("direct saturated µs", "direct paced µs")
        lines += [
            "",
            "What part load costs the member, direct (the same split, saturated against paced):",
            "",
        ]
        lines += _difference_table("component", report.pacing_components, columns)
        lines += ["", "Functions by self time, largest gain first, then largest loss:", ""]
        lines += _difference_table("function", _extremes(report.pacing_functions), columns, code=True)
    return "\n".join(lines)


def _extremes(rows: list[tuple[str, float, float, float]]) -> list[tuple[str, float, float, float]]:
    """The 8 largest gains and the 4 largest losses of a ranked difference list."""
    return [row for row in rows if row[3] > 0][:8] + [row for row in rows if row[3] < 0][-4:]


def _difference_table(
    what: str,
    rows: list[tuple[str, float, float, float]],
    columns: tuple[str, str] = ("direct µs", "front door µs"),
    code: bool = False,
) -> list[str]:
    lines = [f"| {what} | {columns[0]} | {columns[1]} | difference µs |", "|---|---|---|---|"]
    for name, direct, front, difference in rows:
        shown = f"`{name}`" if code else name
        lines.append(f"| {shown} | {direct:.1f} | {front:.1f} | {difference:+.1f} |")
    return lines


def as_json(report: Report) -> dict[str, Any]:
    passes = {}
    for name, p in report.passes.items():
        costs = {role: asdict(cost) for role in (MEMBER, HAPROXY) if (cost := p.cost(role)) is not None}
        passes[name] = {
            "ok": p.ok, "failed": p.failed, "seconds": p.seconds, "per_second": p.per_second,
            "used": {role: asdict(used) for role, used in p.used.items()}, "per_append": costs,
            "latency_ms": {q: p.latency_ms(f) for q, f in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))},
            "backend_connections": p.backend_connections,
            "member_us_by_round": p.member_us,
        }  # fmt: skip
    return {
        "header": report.head,
        "rate": report.rate,
        "passes": passes,
        "hops": {
            name: {**asdict(report.hop(name)), "total_us": report.hop(name).total_us}
            for name in report.fronts
        },
        "edited_config": report.edited,
        "haproxy_symbols": report.haproxy_symbols,
        "components": report.components,
        "functions": report.functions,
        "pacing_components": report.pacing_components,
        "pacing_functions": report.pacing_functions,
    }


def version(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except OSError:
        return "?"
    return (done.stdout + done.stderr).strip().splitlines()[0] if (done.stdout + done.stderr).strip() else "?"


def pressure(text: str) -> float | None:
    """The share of the last minute some runnable task waited for a CPU (%), from /proc/pressure/cpu."""
    for line in text.splitlines():
        if line.startswith("some "):
            return float(dict(part.split("=") for part in line.split()[1:])["avg60"])
    return None


def contention() -> str:
    """How busy the machine is besides us: the load average, and CPU pressure where the kernel keeps it."""
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    text = _read(Path("/proc/pressure/cpu"))
    waited = pressure(text) if text else None
    return f"load average {load}" + (
        f", CPU pressure (some, avg60) {waited:.0f} %" if waited is not None else ""
    )


def header(argv: Sequence[str], setup: Setup, storage: str) -> str:
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    commit = version(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    command = " ".join(["python -m ops.profile_cluster", shlex.join(argv)]).strip()
    return (
        f"date: {date}; commit {commit}; machine: {platform.node()}, {os.cpu_count()} CPUs, {contention()} "
        f"at the start; {platform.python_implementation()} {platform.python_version()}; "
        f"{version(['haproxy', '-v'])}; {version(['h2load', '--version'])}; command: `{command}`; member on "
        f"CPU {setup.member_cpu}, HAProxy, h2load{' and py-spy' if setup.py_spy else ''} on CPU "
        f"{setup.load_cpu}; {storage} storage, {'h2c' if setup.h2 else 'HTTP/1.1'} from h2load, "
        f"{setup.clients} connections, {STREAMS} streams, {BODY_BYTES} B appends, {setup.seconds:g} s per pass"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m ops.profile_cluster", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per paced pass (default 8)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="direct/front door pairs, alternated (default 2)"
    )
    parser.add_argument("--share", type=float, default=SHARE, help="of the direct capacity (default 0.5)")
    parser.add_argument("--rate", type=float, help="appends/s of the paced passes, instead of --share")
    parser.add_argument("--clients", type=int, default=CLIENTS, help="h2load connections (default 32)")
    parser.add_argument("--storage", choices=("memory", "disk"), default="memory")
    parser.add_argument("--protocol", choices=("h1", "h2c"), default="h1")
    parser.add_argument("--no-sample", action="store_true", help="skip the py-spy passes")
    parser.add_argument("--perf", action="store_true", help="also sample HAProxy with perf (Linux perf)")
    parser.add_argument(
        "--sample-saturated",
        action="store_true",
        help="also sample the member direct and saturated: where part load's extra µs go",
    )
    parser.add_argument(
        "--haproxy-drop",
        action="append",
        default=[],
        metavar="REGEX",
        help="also measure a second HAProxy without the generated lines matching REGEX (repeatable)",
    )
    parser.add_argument(
        "--haproxy-defaults",
        action="append",
        default=[],
        metavar="LINE",
        help="also measure a second HAProxy with LINE added to the defaults section (repeatable)",
    )
    parser.add_argument(
        "--haproxy-replace",
        action="append",
        nargs=2,
        default=[],
        metavar=("OLD", "NEW"),
        help="also measure a second HAProxy with the text OLD of the generated configuration as NEW",
    )
    parser.add_argument("--markdown", action="store_true", help="(the only format; kept for `make`)")
    parser.add_argument("--json", type=Path, help="write the raw numbers here")
    args = parser.parse_args(argv)
    try:
        py_spy, (member_cpu, load_cpu) = pa.check_tools()
        if shutil.which("haproxy") is None:
            raise pa.Missing("haproxy is missing: `make system-tools` installs it (apt-get install haproxy)")
        if args.perf and shutil.which("perf") is None:
            raise pa.Missing("perf is missing (--perf): apt-get install linux-perf")
    except pa.Missing as missing:
        print(f"profile_cluster: {missing}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "body").write_bytes(b"x" * BODY_BYTES)
        setup = Setup(args.seconds, args.clients, args.protocol == "h2c", member_cpu, load_cpu, work,
                      None if args.no_sample else py_spy)  # fmt: skip
        head = header(argv, setup, args.storage)
        report = profile(args, setup, pa.Progress(), head)
    print(format_markdown(report))
    if args.json is not None:
        args.json.write_text(json.dumps(as_json(report), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
