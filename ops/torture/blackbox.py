"""The black-box tier: a real `streamkeep serve` process under a seeded schedule of operations and
faults, every answer judged against the model (ops/torture/model.py) as it comes.

    python -m ops.torture blackbox --seed 7 --duration 60 [--fsync interval] [--disk ext4] [--no-cold]

What runs: the server on disk storage (on a small tmpfs, an ext4 loop image, or the plain file
system), with the cold tier on a real `moto_server` behind a proxy of ours, small segments (by
size, count and age) so rotation, sealing and upload happen constantly, short long-poll/SSE/
hibernation timers, and loopback webhooks allowed. Several client workers (threads) run the
operations of ops/torture/operations concurrently; the driver locks a stream name only for the
operations that change its state (create, fork, close, delete), so appends and reads race them
freely. A probe asks GET /healthz every 0.3 s. A fault thread kills the server (SIGKILL), restarts
it (SIGTERM), fills and frees the disk, stops, freezes, thaws and wipes S3; workers also vanish
mid-request on their own. At the end: every fault undone, a quiet spell and a look at the server's
open descriptors, one last kill -9, then a full read of every stream, and the checker's verdict.

Determinism: everything is derived from the seed (each worker's choices and payloads, the fault
schedule, the webhook receiver's answers), but real time decides how operations interleave, so two
runs of one seed are alike, not identical. A failing seed prints the command that replays it and
the history is dumped (JSON lines) so the checker can judge it again offline
(`python -m ops.torture check FILE`); the in-process tier (`sim`) is the deterministic one.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from ops.torture import retention as torture_retention
from ops.torture.checker import Checker, Summary
from ops.torture.history import Call, History, OpStarted, Outcome
from ops.torture.model import RunConfig
from ops.torture.operations import REGISTRY, ClientView, GenContext, Planned, all_names
from ops.torture.operations.base import SUB_HOOK, SUB_PULL, SUBS, WAKE_STREAM
from ops.torture.operations.registry import REGISTRY_STREAM
from ops.torture.operations.subscriptions import sub_config
from ops.torture.rig import CREDENTIALS, S3, Disk, Server, WebhookReceiver
from ops.torture.transport import HttpTransport


class Timed(Protocol):
    at: float  # seconds since the run began


P = TypeVar("P", bound=Timed)
VANISHING = ("vanish", "cut_body", "send_and_vanish")
SEGMENT_BYTES = 16384


@dataclass
class Options:
    seed: int
    duration: float
    fsync: str = "always"
    sync_method: str = "fdatasync"
    disk: str = "tmpfs"
    cold: bool = True
    retention: bool = True  # retention rules and compaction (ops/torture/retention.py)
    workers: int = 6
    fsync_interval: float = 0.5
    dump_dir: Path = Path(tempfile.gettempdir()) / "torture-runs"
    # Extra `streamkeep serve` flags, appended last (they override ours): for investigating a
    # finding, e.g. "--segment-max-age 0" to take one trigger away.
    server_args: tuple[str, ...] = ()
    cluster: int = 0  # members behind HAProxy (ops/torture/cluster.py); 0: one server
    replicas: int = 0  # 2: each member on two replicas, etcd, replica faults (ops/torture/replicated.py)
    replica_faults: tuple[str, ...] = ()  # with replicas: the fault kinds to use (): all of them

    def replay(self) -> str:
        command = (
            f"python -m ops.torture blackbox --seed {self.seed} --duration {self.duration:g} "
            f"--fsync {self.fsync} --sync-method {self.sync_method} --disk {self.disk} --workers {self.workers}"
        )
        extra = f" --server-args='{' '.join(self.server_args)}'" if self.server_args else ""
        extra += f" --cluster {self.cluster}" if self.cluster else ""
        extra += f" --replicas {self.replicas}" if self.replicas else ""
        extra += f" --replica-faults {','.join(self.replica_faults)}" if self.replica_faults else ""
        return (
            command
            + ("" if self.cold else " --no-cold")
            + ("" if self.retention else " --no-retention")
            + extra
        )


@dataclass
class Result:
    options: Options
    summary: Summary
    elapsed: float
    dumped: Path | None = None
    server_output: str = ""
    cold_objects: int = 0  # most objects seen in the bucket at once (segments uploaded)
    cluster: dict[str, int] = field(default_factory=dict)  # a cluster run's counts (cluster.py)


@dataclass
class FaultPlan:
    at: float  # seconds after the workload starts
    kind: str
    duration: float = 0.0


def fault_schedule(options: Options, rng: random.Random) -> list[FaultPlan]:
    """Every available fault kind once, in a seeded order, then seeded picks until the end."""
    kinds = ["kill", "term"]
    if options.disk in ("tmpfs", "ext4"):
        kinds.append("disk_full")
    if options.cold:
        kinds += ["s3_stop", "s3_freeze", "s3_wipe"]
    order = rng.sample(kinds, len(kinds))
    plan: list[FaultPlan] = []
    at = 2.5
    while at < options.duration - 3:
        kind = order.pop(0) if order else rng.choice(kinds)
        duration = {
            "disk_full": rng.uniform(1.5, 3.5),
            "s3_stop": rng.uniform(1.5, 4),
            "s3_freeze": rng.uniform(1, 3),
        }
        plan.append(FaultPlan(at, kind, duration.get(kind, 0.0)))
        calm = rng.uniform(1.0, 2.5) if order else rng.uniform(1.5, 4.0)  # the first round is brisk
        at += plan[-1].duration + calm + (1.0 if kind in ("kill", "term") else 0)
    return plan


class Run:
    def __init__(self, options: Options, log: Callable[[str], None]) -> None:
        self.options = options
        self.log = log
        self.root = Path(tempfile.mkdtemp(prefix=f"torture-{options.seed}-"))
        self.history = History(meta={"tier": "blackbox", **{k: str(v) for k, v in asdict(options).items()}})
        config = RunConfig(
            fsync=options.fsync,
            fsync_interval=options.fsync_interval,
            cold=options.cold,
            retention=options.retention,
        )
        self.checker = Checker(config)
        self.view = ClientView()
        self.disk = Disk(options.disk, self.root)
        self.s3 = S3() if options.cold else None
        self.receiver = WebhookReceiver(self.history, random.Random(f"{options.seed}/receiver"))
        self.view.webhook_url = self.receiver.url
        self.server: Server | None = None
        self.stop = threading.Event()
        self.up = threading.Event()  # the server is listening (workers wait while it is not)
        self.server_lock = threading.Lock()  # held while the fault thread stops or starts it
        self.expect_down = False
        self.locks = {name: threading.Lock() for name in [*all_names(), WAKE_STREAM]}
        self.in_flight = 0
        self.counter_lock = threading.Lock()
        self.checker_error: str | None = None
        self.dead = False  # the server would not start again: the run ends early
        self.bricks = 0
        self.disk_full = False
        self.cold_objects = 0
        self.crashes: list[float] = []
        self._fed = 0

    # ---- setup and teardown -------------------------------------------------------------

    def server_args(self, data: Path) -> list[str]:
        o = self.options
        args = [
            "--storage", "disk", "--data-dir", str(data),
            "--fsync", o.fsync, "--sync-method", o.sync_method, "--fsync-interval", str(o.fsync_interval),
            "--segment-max-bytes", str(SEGMENT_BYTES), "--segment-max-messages", "40", "--segment-max-age", "2",
            "--read-chunk-bytes", "65536",
            "--long-poll-timeout", "1.5", "--sse-close-after", "4", "--hibernate-after", "3",
            "--shutdown-grace", "3", "--send-stall-timeout", "3",
            "--allow-loopback-webhooks", "--log-level", "warning",
        ]  # fmt: skip
        if self.s3 is not None:
            args += [
                "--cold-url", "s3://torture/run", "--cold-endpoint", self.s3.url, "--cold-create-bucket",
                "--cold-high-water-bytes", str(1 << 20), "--cold-cache-bytes", str(256 << 10),
            ]  # fmt: skip
        if o.retention:
            rules = self.root / "retention.toml"
            rules.write_text(torture_retention.toml(SEGMENT_BYTES))
            args += ["--config", str(rules), "--retention-interval", "0.5"]
        return [*args, *o.server_args]

    def setup(self) -> None:
        data = self.disk.setup()
        if self.s3 is not None:
            self.s3.setup()
        self.server = Server(self.server_args(data), CREDENTIALS)
        self.server.start()
        self.receiver.server_url = self.server.url
        self.up.set()
        self.initialize()

    def initialize(self) -> None:
        """What a fresh server needs before the workload: the wake stream and the subscriptions."""
        transport = HttpTransport(self.client_url(), self.history.clock)
        try:
            create = Call(
                "PUT", f"/v1/stream/{WAKE_STREAM}", headers={"Content-Type": "application/json"}, body="[]"
            )
            params = {
                "content_type": "application/json",
                "ttl": None,
                "expires_at": None,
                "closed": False,
                "foreign": True,
            }
            self.execute(transport, "setup", Planned("create", WAKE_STREAM, params, create, (WAKE_STREAM,)))
            for sub_id in (SUB_PULL, SUB_HOOK):
                body = json.dumps(sub_config(sub_id, self.view))
                call = Call("PUT", SUBS + sub_id, headers={"Content-Type": "application/json"}, body=body)
                self.execute(transport, "setup", Planned("sub_put", None, {"sub": sub_id}, call))
        finally:
            transport.close()

    def client_url(self) -> str:
        """Where clients send requests: the server (a cluster run: the front door)."""
        assert self.server is not None
        return self.server.url

    def teardown(self) -> None:
        for part in (
            lambda: self.server and self.server.kill(signal.SIGTERM),
            self.receiver.close,
            lambda: self.s3 and self.s3.close(),
            self.disk.close,
        ):
            try:
                part()
            except Exception as error:  # keep tearing down: mounts must go
                self.log(f"teardown: {error!r}")

    # ---- operations -----------------------------------------------------------------------

    def execute(
        self, transport: HttpTransport, worker: str, planned: Planned, ctx: GenContext | None = None
    ) -> Outcome:
        locks = [self.locks[n] for n in sorted(set(planned.locks)) if n in self.locks]
        for lock in locks:
            lock.acquire()
        with self.counter_lock:
            self.in_flight += 1
        try:
            started = self.history.start(planned.op, worker, planned.name, planned.params, planned.call)
            op = REGISTRY.get(planned.op)
            if op is not None and op.driven:  # a real client's session (operations/client.py)
                outcome = op.drive(self.history, transport.base_url, worker, planned)
            else:
                outcome = transport.send(planned.call)
            self.history.end(started, outcome)
        finally:
            with self.counter_lock:
                self.in_flight -= 1
            for lock in reversed(locks):
                lock.release()
        if planned.call.mode in VANISHING:
            self.history.fault("client_vanish", op=started.id, mode=planned.call.mode)
        if planned.name is None or planned.name in self.view.streams:  # not the wake stream
            ctx = ctx or GenContext(worker, random.Random(0), self.view)
            REGISTRY[planned.op].after(ctx, planned, outcome)
        return outcome

    def worker(self, number: int) -> None:
        name = f"w{number}"
        ctx = GenContext(name, random.Random(f"{self.options.seed}/worker/{number}"), self.view)
        kinds = [k for k, op in REGISTRY.items() if op.weight > 0]
        weights = [REGISTRY[k].weight for k in kinds]
        assert self.server is not None
        transport = HttpTransport(self.server.url, self.history.clock)
        try:
            while not self.stop.is_set():
                if not self.up.wait(0.5):
                    continue
                kind = ctx.rng.choices(kinds, weights)[0]
                planned = REGISTRY[kind].generate(ctx)
                if planned is None:
                    continue
                outcome = self.execute(transport, name, planned, ctx)
                if outcome.error and outcome.error.startswith("refused"):
                    time.sleep(0.2)  # the server is down: the probe will notice
                time.sleep(ctx.rng.uniform(0, 0.01))
        finally:
            transport.close()

    def probe(self) -> None:
        assert self.server is not None
        transport = HttpTransport(self.server.url, self.history.clock, timeout=2.0)
        try:
            for round_number in itertools.count():
                if self.stop.is_set():
                    break
                started = self.history.start("healthz", "probe", None, {}, Call("GET", "/healthz"))
                outcome = transport.send(started.call)
                self.history.end(started, outcome)
                self.watch_server()
                if round_number % 7 == 6:
                    self.probe_fds(quiet=False)
                time.sleep(0.3)
        finally:
            transport.close()

    def probe_fds(self, quiet: bool) -> None:
        assert self.server is not None
        if self.server.alive:
            call = Call("GET", f"/proc/{self.server.pid}/fd")
            started = self.history.start("fd_probe", "probe", None, {"quiet": quiet}, call)
            self.history.end(started, Outcome(200, body=json.dumps(self.server.open_fds()), verdict="ok"))

    def watch_server(self) -> None:
        """A server that exited with nobody killing it is a finding; it is started again."""
        with self.server_lock:
            server = self.server
            if server is None or server.alive or self.expect_down:
                return
            self.up.clear()
            self.crashes.append(time.monotonic())
            self.history.fault("crash", output=server.output_tail(80))
            self.log(f"server exited on its own:\n{server.output_tail(20)}")
            server.kill()
            while self.disk_full and not self.stop.is_set():
                time.sleep(0.1)  # an operator frees the disk before starting it again
            self.restart_locked()

    def restart_locked(self) -> bool:
        """Starts the server again. One that will not start (three tries) or keeps dying is a
        finding; then the operator's way out: its data directory is kept aside for post-mortem
        and it starts on an empty one ("disk_replaced"), so the run goes on finding other bugs.
        After three such bricks the run ends."""
        assert self.server is not None
        if self.dead:
            return False
        last = ""
        bricked = not self.disk_full and len([t for t in self.crashes if t > time.monotonic() - 20]) >= 3
        for attempt in range(0 if bricked else 3):
            try:
                self.server.start()
                break
            except RuntimeError as error:
                self.log(f"restart {attempt + 1} failed: {str(error)[-600:]}")
                last = str(error)
                time.sleep(1)
                if self.disk_full:  # it may need the space to start: that is a finding, not a brick
                    if attempt == 0:
                        self.history.fault("start_failed", output=last[-3000:], disk_full=True)
                    while self.disk_full and not self.stop.is_set():
                        time.sleep(0.1)
        else:
            self.history.fault("start_failed", output=(last or self.server.output_tail(80))[-3000:])
            self.bricks += 1
            if self.bricks > 3 or not self.replace_data():
                self.dead = True
                self.stop.set()
                return False
        self.history.fault("restart")
        self.up.set()
        return True

    def replace_data(self) -> bool:
        assert self.server is not None
        data = self.disk.data
        kept = self.root / f"bricked-{self.bricks}"
        shutil.copytree(data, kept, dirs_exist_ok=True)
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir()
        self.crashes.clear()
        self.history.fault("disk_replaced", kept=str(kept))
        self.log(f"the server is bricked: its data directory is kept in {kept}; starting on an empty one")
        try:
            self.server.start()
        except RuntimeError as error:
            self.log(f"it does not start on an empty data directory either: {str(error)[-600:]}")
            return False
        self.history.fault("restart")
        self.initialize()
        return True

    # ---- faults -----------------------------------------------------------------------------

    def faults(self, began: float) -> None:
        rng = random.Random(f"{self.options.seed}/faults")
        self.follow(fault_schedule(self.options, rng), began, lambda plan: self.fault(plan, rng))

    def follow(self, plans: Iterable[P], began: float, apply: Callable[[P], object]) -> None:
        """Applies each planned fault (anything with `at`, seconds since `began`) at its time,
        until the run stops."""
        for plan in plans:
            while not self.stop.is_set() and time.monotonic() - began < plan.at:
                time.sleep(0.05)
            if self.stop.is_set():
                return
            apply(plan)

    def fault(self, plan: FaultPlan, rng: random.Random) -> None:
        kind = plan.kind
        if kind in ("kill", "term"):
            assert self.server is not None
            with self.server_lock:
                self.expect_down = True
                self.up.clear()
                self.history.fault(kind)
                self.server.kill(signal.SIGKILL if kind == "kill" else signal.SIGTERM)
                self.restart_locked()
                self.expect_down = False
        elif kind == "disk_full":
            self.history.fault("disk_full")
            self.disk_full = True
            left = self.disk.fill(rng)
            self.log(f"disk full ({left} bytes left) for {plan.duration:.1f} s")
            self.sleep(plan.duration)
            self.disk.free()
            self.disk_full = False
            self.crashes.clear()  # crashes on a full disk say nothing of a brick
            self.history.fault("disk_freed")
        elif kind in ("s3_stop", "s3_freeze") and self.s3 is not None:
            self.history.fault(kind)
            (self.s3.stop if kind == "s3_stop" else self.s3.freeze)()
            self.sleep(plan.duration)
            (self.s3.start if kind == "s3_stop" else self.s3.thaw)()
            self.history.fault("s3_start" if kind == "s3_stop" else "s3_thaw")
        elif kind == "s3_wipe" and self.s3 is not None:
            self.cold_objects = max(self.cold_objects, self.s3.count_objects())
            self.history.fault(kind)
            self.s3.wipe()

    def sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.stop.is_set():
            time.sleep(0.05)

    # ---- checking ---------------------------------------------------------------------------

    def feed_checker(self) -> None:
        events = self.history.since(self._fed)
        self._fed += len(events)
        for event in events:
            if self.checker_error is not None:
                return
            try:
                self.checker.observe(event)
            except Exception:
                self.checker_error = traceback.format_exc()
                self.log(f"CHECKER ERROR:\n{self.checker_error}")

    def checking(self) -> None:
        while not self.stop.is_set():
            self.feed_checker()
            time.sleep(0.1)

    # ---- the end ------------------------------------------------------------------------------

    def final(self) -> None:
        """A quiet spell and a look at open descriptors, a last kill -9, then every stream read."""
        assert self.server is not None
        time.sleep(3.5)  # past --hibernate-after: every idle actor has let go of its files
        self.probe_fds(quiet=True)
        with self.server_lock:
            self.expect_down = True
            self.history.fault("kill")
            self.server.kill(signal.SIGKILL)
            started = self.restart_locked()
            self.expect_down = False
        if not started:
            return
        # The probe goes on during the reads: a server that exits now is found and started again.
        probe = threading.Thread(target=self.probe, daemon=True)
        probe.start()
        transport = HttpTransport(self.server.url, self.history.clock, timeout=30)
        ctx = GenContext("final", random.Random(0), self.view)
        try:
            self.read_everything(transport, ctx)
        finally:
            transport.close()
            self.stop.set()
            probe.join(10)

    def read_everything(self, transport: HttpTransport, ctx: GenContext, subscriptions: bool = True) -> None:
        """The final reads the checker judges the run by: every stream whole, the registry, and
        the subscriptions (unless left out)."""
        for name in [*all_names(), WAKE_STREAM]:
            head = Planned("head", name, {}, Call("HEAD", f"/v1/stream/{name}"))
            self.execute(transport, "final", head, ctx)
            self.read_all(transport, name, ctx)
        self.read_all(transport, REGISTRY_STREAM, ctx, op="registry_read")
        for sub_id in (SUB_PULL, SUB_HOOK) if subscriptions else ():
            call = Call("GET", SUBS + sub_id)
            self.execute(transport, "final", Planned("sub_get", None, {"sub": sub_id}, call), ctx)

    def read_all(self, transport: HttpTransport, name: str, ctx: GenContext, op: str = "read") -> None:
        """Reads a stream from its start to its tail (the final read the checker judges the
        whole run by), waiting out a server restart or a cold tier catching up, a little."""
        offset, down, unavailable = "-1", 0, 0
        for _ in range(2000):
            if self.dead:
                return
            call = Call("GET", f"/v1/stream/{name}", query={"offset": offset})
            params = {"offset": offset, "final": True}
            outcome = self.execute(transport, "final", Planned(op, name, params, call), ctx)
            if outcome.status is None and down < 5:
                down += 1
                self.up.wait(30)  # the probe notices an exit and starts the server again
                time.sleep(0.5)
                continue
            if outcome.status == 503 and unavailable < 5:
                unavailable += 1
                time.sleep(1)
                continue
            if outcome.status != 200:
                return
            offset = outcome.headers.get("stream-next-offset", offset)
            if outcome.headers.get("stream-up-to-date") == "true":
                return

    # ---- the whole run -------------------------------------------------------------------------

    def run(self) -> Result:
        began_wall = time.monotonic()
        threads: list[threading.Thread] = []
        try:
            self.setup()
            checking = threading.Thread(target=self.checking, daemon=True)
            checking.start()
            began = time.monotonic()
            threads = [
                threading.Thread(target=self.worker, args=(i,), daemon=True)
                for i in range(self.options.workers)
            ]
            threads += [
                threading.Thread(target=self.probe, daemon=True),
                threading.Thread(target=self.faults, args=(began,), daemon=True),
            ]
            for thread in threads:
                thread.start()
            next_report = began + 5
            while not self.workload_done(time.monotonic() - began) and not self.dead:
                time.sleep(0.2)
                if time.monotonic() >= next_report:
                    next_report += 5
                    self.progress(time.monotonic() - began)
            self.stop.set()
            for thread in threads:
                thread.join(60)
            self.stop.clear()
            self.undo_faults()
            if self.s3 is not None:
                self.cold_objects = max(self.cold_objects, self.s3.count_objects())
            if not self.dead:
                self.final()
            self.stop.set()
            checking.join(30)
            self.feed_checker()
            if self.checker_error is None:
                try:
                    self.checker.finish()
                except Exception:
                    self.checker_error = traceback.format_exc()
        finally:
            self.stop.set()
            output = self.all_output()
            self.teardown()
        summary = self.checker.summary()
        if self.checker_error is not None:
            from ops.torture.model import Finding

            summary.findings.append(Finding("checker-error", self.checker_error[-1500:], [], 0.0))
        result = Result(self.options, summary, time.monotonic() - began_wall, server_output=output)
        result.cold_objects = self.cold_objects
        self.add_results(result)
        if summary.findings:
            self.options.dump_dir.mkdir(parents=True, exist_ok=True)
            result.dumped = self.options.dump_dir / f"{self.dump_stem()}.jsonl"
            self.history.dump(result.dumped)
            result.dumped.with_suffix(".server.log").write_text(output)
            for kept in sorted(self.root.glob("bricked-*")):
                shutil.copytree(kept, result.dumped.with_suffix(f".{kept.name}"), dirs_exist_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)
        return result

    def all_output(self) -> str:
        return self.server.all_output() if self.server else ""

    def workload_done(self, elapsed: float) -> bool:
        """Whether the workload (and its faults) may end, `elapsed` seconds after it began."""
        return elapsed >= self.options.duration

    def dump_stem(self) -> str:
        return f"blackbox-seed{self.options.seed}-{self.options.fsync}-{self.options.disk}"

    def add_results(self, result: Result) -> None:
        """What a kind of run adds to its result (the cluster run: its counts)."""

    def undo_faults(self) -> None:
        if self.disk_full:
            self.disk.free()
            self.disk_full = False
            self.history.fault("disk_freed")
        if self.s3 is not None:
            if self.s3.frozen:
                self.s3.thaw()
                self.history.fault("s3_thaw")
            if self.s3.proxy._listener is None:
                self.s3.start()
                self.history.fault("s3_start")

    def progress(self, elapsed: float) -> None:
        ops = sum(1 for e in self.history.events if isinstance(e, OpStarted))
        faults = sum(self.checker.model.faults.counts.values())
        self.log(
            f"[seed {self.options.seed} {elapsed:5.1f}s] {ops} ops ({ops / max(elapsed, 0.1):.0f}/s), "
            f"{faults} faults, {len(self.checker.findings)} findings so far"
        )


def run(options: Options, log: Callable[[str], None] = print) -> Result:
    """One single-server run (a cluster run is ops/torture/cluster.py's `run`)."""
    if options.cluster:
        raise ValueError("a cluster run: call ops.torture.cluster.run")
    return Run(options, log).run()


def format_summary(result: Result) -> str:
    s, o = result.summary, result.options
    lines = [
        f"seed {o.seed}: {o.duration:g} s, --fsync {o.fsync} ({o.sync_method}), disk {o.disk}, cold {'on' if o.cold else 'off'}"
        + (f", {o.cluster} members behind HAProxy" if o.cluster else "")
        + (f", {o.replicas} replicas each" if o.replicas else "")
    ]
    kinds = s.op_kinds()
    lines.append("operations: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    verdicts: dict[str, int] = {}
    for key, n in s.ops.items():
        verdict = key.split()[1]
        verdicts[verdict] = verdicts.get(verdict, 0) + n
    lines.append("outcomes: " + ", ".join(f"{k} {n}" for k, n in sorted(verdicts.items())))
    lines.append("faults: " + ", ".join(f"{k} {n}" for k, n in sorted(s.faults.items())))
    if o.cold:
        lines.append(f"cold tier: up to {result.cold_objects} objects in the bucket at once")
    if result.cluster:
        lines.append("cluster: " + ", ".join(f"{k} {n}" for k, n in result.cluster.items()))
    lines.append("checks: " + ", ".join(f"{k} {n}" for k, n in sorted(s.checks.items())))
    counted = ", ".join(f"{k} {n}" for k, n in sorted(s.occurrences.items()))
    lines.append(f"findings: {len(s.findings)}" + (f" (occurrences: {counted})" if counted else ""))
    for finding in s.findings:
        lines.append(f"  - {finding}")
    if s.findings:
        lines.append(f"  replay: {o.replay()}")
        if result.dumped:
            lines.append(
                f"  history: {result.dumped} (re-check: python -m ops.torture check {result.dumped})"
            )
    return "\n".join(lines)


__all__ = ["Options", "Result", "format_summary", "run"]
