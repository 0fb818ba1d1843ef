"""The deterministic tier: the whole server in one process, on simulated time, disk and bucket.

    python -m ops.torture sim --seed 7 --ops 2000 [--fsync always|interval|never] [--sync-method ...]

The server runs as `streamkeep serve` assembles it (streamkeep/assemble.py: the same actors,
storage, cold tier, registry, retention, compaction and TTL sweep), inside one trio run on a
`MockClock`, on `SimFileSystem` (ops/torture/simfs.py: every call can fail with ENOSPC, EIO, a
short write or a failed fsync, and a power cut keeps an adversarial part of what was not synced) and `SimS3` (down,
slow, failing, wiped, refusing deletes). Worker threads are `SimThreads` (run inline between seeded
yields), and the server's clocks and randomness are seeded (`simthreads.deterministic`), so one
seed replays exactly: the same operations, the same interleavings, the same faults, the same
verdict. A failing seed prints the command that replays it.

The clients are the black box's (ops/torture/operations): the same generators pick what to do,
the same `Call`s go to `Service.handle` instead of a socket (`SimTransport`), and the same history
and checker (ops/torture/checker.py, model.py) judge every answer. Subscriptions are left to the
black box: their webhooks need a real network. A fault task meanwhile fails disk calls, fills the
disk and frees it, takes the bucket down, slows it, makes it fail, wipes it, and ends epochs: a
process crash (every task cancelled, the page cache kept), a power cut (only what was synced
survives, and some of what was not) or a clean stop; the next epoch starts the server again on
what is left. At the end, with the faults healed, every stream is read in full.

Power cuts are on by default only under `--fsync always`, where the promise is that they lose
nothing acknowledged. Under `interval` and `never` a power cut may take back the last sync window
(or everything unsynced) of acknowledged appends, and later appends then reuse those offsets: the
contract allows it (docs/segment-format.md), and the checker cannot tell that from a bug, so those
modes run with crashes and clean stops (which lose nothing in every mode). `--power-cuts` forces
them on, to look at what such a loss looks like.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import logging
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlencode

import trio

from ops.torture import retention as torture_retention
from ops.torture import simthreads
from ops.torture.checker import Checker, Summary
from ops.torture.history import AMBIGUOUS, Call, History, Outcome, classify, keep_headers, to_bytes, to_text
from ops.torture.model import Finding, RunConfig
from ops.torture.operations import REGISTRY, ClientView, GenContext, Planned, all_names
from ops.torture.operations.registry import REGISTRY_STREAM
from ops.torture.simfs import FaultPlan, SimFileSystem
from ops.torture.sims3 import SimS3, SimS3Error
from ops.torture.transport import SseParser
from streamkeep import config as settings_config
from streamkeep.assemble import Injected, Server
from streamkeep.protocol.model import Headers, Request
from streamkeep.server.service import Service
from streamkeep.storage import files
from streamkeep.storage.cold.store import ColdConfig
from streamkeep.storage.disk.storage import DiskStorage

ROOT = Path("/data")
OP_TIMEOUT = 120.0  # mock seconds; an operation taking longer is a hang, and a finding
# The black box's operations, less those that need a real network or process (subscriptions with
# their webhook receiver, descriptor probes of /proc, the real client's sessions).
KINDS = [
    kind for kind, op in REGISTRY.items() if op.weight > 0 and not kind.startswith("sub_") and not op.driven
]


@dataclass
class SimConfig:
    seed: int = 1
    ops: int = 1000
    workers: int = 5
    fsync: str = "always"
    sync_method: str = "fdatasync"
    fsync_interval: float = 1.0
    capacity: int = 8 << 20  # the disk fills only when the fault task says so (a ballast file)
    power_cuts: bool | None = None  # None: only under --fsync always (see the module's docstring)
    real_time_limit: float = 0.0  # seconds; 0: max(60, ops / 50), ten times any seed's run
    cold: bool = True
    retention: bool = True  # retention rules and compaction (ops/torture/retention.py)
    segment_max_bytes: int = 4096
    segment_max_messages: int = 6
    segment_max_age: float = 3.0
    min_free_bytes: int = 8192

    def __post_init__(self) -> None:
        if self.power_cuts is None:
            self.power_cuts = self.fsync == "always"

    def command(self) -> str:
        return (
            f"python -m ops.torture sim --seed {self.seed} --ops {self.ops} --workers {self.workers} "
            f"--fsync {self.fsync} --sync-method {self.sync_method}"
            + self._power_cuts_flag()
            + ("" if self.cold else " --no-cold")
            + ("" if self.retention else " --no-retention")
        )

    def _power_cuts_flag(self) -> str:
        if self.power_cuts == (self.fsync == "always"):
            return ""
        return " --power-cuts" if self.power_cuts else " --no-power-cuts"


@dataclass
class SimResult:
    config: SimConfig
    summary: Summary
    faults: dict[str, int]
    digest: str
    epochs: int
    trace: list[str] = field(default_factory=list, repr=False)

    @property
    def findings(self) -> list[Finding]:
        return self.summary.findings

    @property
    def ok(self) -> bool:
        return not self.summary.findings


class SimStore:
    """`ObjectStore` (streamkeep.storage.cold.store) over `SimS3`."""

    def __init__(self, s3: SimS3, config: ColdConfig) -> None:
        self.s3 = s3
        self.config = config

    def ensure_bucket(self) -> None:
        try:
            self.s3.head_bucket()
        except SimS3Error as error:
            if error.code != "NoSuchBucket":
                raise
            self.s3.create_bucket()

    def upload(self, reader: Any, key: str, size: int, sha256: str) -> None:
        reader.seek(0)
        data = reader.read(size)
        try:
            self.s3.put(key, data, {"sha256": sha256})
        except SimS3Error as error:
            if error.code != "NoSuchBucket":
                raise
            self.s3.create_bucket()
            self.s3.put(key, data, {"sha256": sha256})
        found = self.head(key)
        if found != (size, sha256):
            raise OSError(f"object {key} does not match what was uploaded: {found}")

    def head(self, key: str) -> tuple[int, str | None] | None:
        try:
            size, metadata = self.s3.head(key)
        except SimS3Error as error:
            if error.code == "NoSuchKey":
                return None
            raise
        return size, metadata.get("sha256")

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data = self.s3.get_range(key, start, length)
        if len(data) != length:
            raise OSError(f"short read from {key}: {len(data)} of {length} bytes")
        return data

    def delete(self, keys: list[str]) -> list[str]:
        return self.s3.delete(keys)

    def list_objects(self, prefix: str) -> list[tuple[str, float]]:
        return [(key, 0.0) for key in self.s3.list(prefix)]

    def copy(self, source: str, target: str) -> None:
        data, metadata = self.s3._object(source)
        self.s3.put(target, data, metadata)


class SimTransport:
    """Sends a torture `Call` to `Service.handle`, as the HTTP edge would, and returns what a client
    would have seen. A client that vanishes mid-request is the request cut off (its body never
    complete: the server never saw it) or left behind (the server goes on, the client hears nothing)."""

    def __init__(self, simulation: Simulation) -> None:
        self.sim = simulation

    async def send(self, call: Call) -> Outcome:
        world = self.sim.world
        if world is None:
            return Outcome(None, error="refused: the server is down", verdict=classify(None, "refused"))
        if call.mode == "cut_body":
            return Outcome(None, error="body_cut", verdict=classify(None, "body_cut"))
        request = Request(
            call.method,
            call.path,
            urlencode(call.query),
            Headers(list(call.headers.items())),
            to_bytes(call.body),
        )
        if call.mode == "send_and_vanish":
            world.nursery.start_soon(world.service.handle, request)
            return Outcome(None, error="vanished", verdict=AMBIGUOUS)
        with trio.move_on_after(OP_TIMEOUT) as scope:
            response = await world.service.handle(request)
        if scope.cancelled_caught:
            self.sim.hang(call)
            return Outcome(None, error="timeout: the server did not answer", verdict=AMBIGUOUS)
        headers = keep_headers(response.headers)
        if response.stream is None:
            body = to_text(response.body)
            if call.mode == "vanish":  # the client took a few bytes of the answer and reset
                return Outcome(
                    response.status,
                    headers,
                    body[: int(call.limit)],
                    verdict=classify(response.status, body=body),
                    partial=True,
                )
            return Outcome(response.status, headers, body, verdict=classify(response.status, body=body))
        parser = SseParser(headers.get("stream-sse-data-encoding", "").lower() == "base64", time.time)
        limit = call.limit if call.mode == "sse" else 0.5
        try:
            with trio.move_on_after(limit):
                async for chunk in response.stream:
                    parser.feed(bytes(chunk))
                    if parser.closed:
                        break
        finally:
            with trio.CancelScope(shield=True):
                aclose = getattr(response.stream, "aclose", None)
                if aclose is not None:
                    await aclose()
        return Outcome(response.status, headers, "", parser.chunks, verdict=classify(response.status))


@dataclass
class World:
    """One epoch of the server: storage, cold tier, actors and service on the shared sim state."""

    storage: DiskStorage
    service: Service
    nursery: trio.Nursery  # the server's: a request whose client vanished goes on there


class Simulation:
    def __init__(self, config: SimConfig, determinism: simthreads.Determinism) -> None:
        self.config = config
        self.det = determinism
        self.fault_rng = determinism.rng("faults")
        self.trace: list[str] = []
        self.fs = SimFileSystem(
            capacity=config.capacity,
            faults=FaultPlan(determinism.rng("fs-faults"), rates={}, enabled=False),
            trace=self.trace,
        )
        self.s3 = SimS3(determinism.rng("s3"), trace=self.trace)
        # The server's wall clock in the simulation (simthreads.deterministic: EPOCH + mock time):
        # the clients write Stream-Expires-At by it, and the model judges expiry by event times.
        self.history = History(
            clock=_ticking(time.time),
            meta={"tier": "sim", "seed": config.seed, "retention": str(config.retention)},
        )
        self.checker = Checker(RunConfig(config.fsync, config.fsync_interval, config.cold, config.retention))
        self.view = ClientView()
        self.transport = SimTransport(self)
        self.locks = {name: trio.Lock() for name in all_names()}
        self.faults: dict[str, int] = {}
        self.epochs = 0
        self.done_ops = 0
        self.world: World | None = None
        self.ballast = False
        self._fed = 0
        self.extra_findings: list[Finding] = []

    # ---- the run ----------------------------------------------------------------------

    async def run(self) -> None:
        while self.done_ops < self.config.ops:
            ending = await self._epoch()
            self.epochs += 1
            self.trace.append(f"== {ending} at {trio.current_time():.3f}")
            if ending == "power_cut":
                self.fs = self.fs.power_cut(self.fault_rng)
                self.fs.faults.enabled = False
            else:
                self.fs.crash()
        self._heal()
        await self._final()

    async def _epoch(self) -> str:
        """Runs the server and the workers until the fault task ends the epoch; returns how."""
        result: list[str] = []
        async with trio.open_nursery() as outer:
            self.world = await self._start(outer)
            outer.start_soon(self._restarted, self.world)
            stop = trio.Event()
            async with trio.open_nursery() as workers:
                for number in range(self.config.workers):
                    workers.start_soon(self._worker, number, stop)
                workers.start_soon(self._fault_task, stop, result)
                await stop.wait()
                workers.cancel_scope.cancel()
            ending = result[0] if result else "term"
            self._event(self.history.fault(ending))
            outer.cancel_scope.cancel()  # the server's tasks end here, as in a crash
        world, self.world = self.world, None
        if ending == "term" and world is not None:
            with trio.CancelScope(shield=True):
                await world.storage.stop()
        self._end_faults()
        return ending

    async def _start(self, nursery: trio.Nursery) -> World:
        """The server as `streamkeep serve` assembles it, on the simulated disk and bucket."""
        config = self.config
        cold = None
        if config.cold:
            cold = ColdConfig(
                "archive", "sim", None, None, create_bucket=True, high_water_bytes=60_000, cache_bytes=2048
            )
        injected = Injected(
            fs=self.fs,
            read_cache_bytes=512,
            cold_config=cold,
            object_store=partial(SimStore, self.s3),
            run_sync=self.det.threads.run_sync,
            # The data directory is on the simulated disk: keys and the readiness probe stay off the
            # real one, and subscriptions (their webhooks need a real network) are not run.
            state_on_disk=False,
            subscriptions=False,
            retry_start=self._retry_start,
            read_slice_streams=1,  # counted, not timed, so that a seed replays
            write_descriptors=3,  # descriptors given back and opened again under every fault
        )
        server = Server(_settings(config), nursery, injected)
        await server.recover()
        assert isinstance(server.storage, DiskStorage)
        return World(server.storage, server.service, nursery)

    async def _restarted(self, world: World) -> None:
        """Counts the restart once every stream is read again, as the black-box rig does (it waits
        for `/readyz`): the server serves after reading one stream, and until it read them all a
        delete answers 503 `recovering`, which only a restart's window explains."""
        await world.storage.recovered()
        self._event(self.history.fault("restart"))

    async def _retry_start(self, error: OSError, attempt: int) -> bool:
        """A start can fail on an injected fault: not a finding, retry it with the faults off."""
        self.trace.append(f"start failed: {error}")
        self.fs.faults.enabled = False
        await trio.sleep(1.0)
        return attempt < 49

    # ---- workers ----------------------------------------------------------------------

    async def _worker(self, number: int, stop: trio.Event) -> None:
        name = f"w{number}"
        ctx = GenContext(name, self.det.rng(f"worker-{number}-{self.epochs}"), self.view)
        weights = [REGISTRY[kind].weight for kind in KINDS]
        while not stop.is_set():
            if self.done_ops >= self.config.ops:
                stop.set()
                return
            self.done_ops += 1
            kind = ctx.rng.choices(KINDS, weights)[0]
            planned = REGISTRY[kind].generate(ctx)
            if planned is not None:
                await self.execute(name, planned, ctx)
            await trio.sleep(ctx.rng.uniform(0, 0.2))

    async def execute(self, worker: str, planned: Planned, ctx: GenContext) -> Outcome:
        """Runs one operation: locks the names whose state it changes, records its start and end
        (without an answer if the epoch ends first: it may or may not have happened)."""
        locks = [self.locks[n] for n in sorted(set(planned.locks)) if n in self.locks]
        outcome = Outcome(None, error="closed: the server went down", verdict=AMBIGUOUS)
        async with _all(locks):
            started = self.history.start(planned.op, worker, planned.name, planned.params, planned.call)
            self._feed()
            try:
                outcome = await self.transport.send(planned.call)
            finally:
                self.history.end(started, outcome)
                self._feed()
                # Also when the epoch's end cancels the call: the client learns its answer was
                # lost (a producer then retries the same body and seq, as a real one would).
                if planned.name is None or planned.name in self.view.streams:
                    REGISTRY[planned.op].after(ctx, planned, outcome)
        if planned.call.mode in ("vanish", "cut_body", "send_and_vanish"):
            self._event(self.history.fault("client_vanish", op=started.id, mode=planned.call.mode))
        return outcome

    def hang(self, call: Call) -> None:
        self.extra_findings.append(
            Finding(
                "hang",
                f"{call.method} {call.path} took more than {OP_TIMEOUT} mock seconds",
                [],
                trio.current_time(),
            )
        )

    # ---- history ----------------------------------------------------------------------

    def _event(self, _event: object) -> None:
        self._feed()

    def _feed(self) -> None:
        events = self.history.since(self._fed)
        self._fed += len(events)
        self.checker.observe_all(events)

    # ---- faults -----------------------------------------------------------------------

    async def _fault_task(self, stop: trio.Event, result: list[str]) -> None:
        rng = self.fault_rng
        while not stop.is_set():
            await trio.sleep(rng.uniform(0.2, 2.0))
            roll = rng.random()
            if roll < 0.15:
                self._toggle_disk_faults(rng)
            elif roll < 0.27:
                self._toggle_ballast(rng)
            elif roll < 0.37 and self.config.cold:
                self._toggle_s3(rng)
            elif roll < 0.50:
                ending = rng.choice(
                    ["kill", "power_cut", "term"] if self.config.power_cuts else ["kill", "term"]
                )
                self._count(ending)
                result.append(ending)
                stop.set()

    def _count(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1

    def _fault(self, kind: str, counted: str | None = None) -> None:
        self._event(self.history.fault(kind))
        if counted:
            self._count(counted)

    def _toggle_disk_faults(self, rng: random.Random) -> None:
        plan = self.fs.faults
        if plan.enabled:
            plan.enabled = False
            self._fault("disk_healed")
            return
        kinds = rng.sample(["enospc", "short", "eio", "fsync_enospc", "edquot"], rng.randint(1, 3))
        plan.rates = {kind: rng.choice([0.02, 0.1, 0.3]) for kind in kinds}
        plan.enabled = True
        self._fault("disk_faults", "disk faults")

    def _toggle_ballast(self, rng: random.Random) -> None:
        path = ROOT / "ballast"
        if self.ballast:
            self._remove_ballast()
            self._fault("disk_freed")
            return
        size = max(0, self.fs.free_bytes(ROOT) - rng.randint(0, 20_000))
        plan = self.fs.faults
        enabled, plan.enabled = plan.enabled, False
        try:
            fd = self.fs.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                files.pwrite_all(self.fs, fd, b"\0" * size, 0)
            finally:
                self.fs.close(fd)
        except OSError:
            pass
        finally:
            plan.enabled = enabled
        self.ballast = True
        self._fault("disk_full", "disk full")

    def _remove_ballast(self) -> None:
        """The operator frees the disk: for good (a power cut after an unsynced unlink would bring
        the ballast back, a full disk no fault event explains), and past any injected EIO."""
        plan = self.fs.faults
        enabled, plan.enabled = plan.enabled, False
        try:
            files.unlink_quietly(self.fs, ROOT / "ballast")
            files.fsync_dir(self.fs, ROOT)
        finally:
            plan.enabled = enabled
        self.ballast = False

    def _toggle_s3(self, rng: random.Random) -> None:
        s3 = self.s3
        roll = rng.random()
        if s3.down or s3.delay or s3.fail_rate or s3.delete_fail_rate:
            s3.down, s3.delay, s3.fail_rate, s3.delete_fail_rate = False, 0.0, 0.0, 0.0
            self._fault("s3_start")
        elif roll < 0.4:
            s3.down = True
            self._fault("s3_stop", "s3 down")
        elif roll < 0.6:
            s3.delay = rng.uniform(0.5, 5.0)
            self._fault("s3_stop", "s3 slow")  # calls that hang: for a client, the bucket is away
        elif roll < 0.8:
            s3.fail_rate = s3.delete_fail_rate = 0.3
            self._fault("s3_stop", "s3 flaky")
        else:
            s3.wipe()
            self._fault("s3_wipe", "s3 wiped")

    def _end_faults(self) -> None:
        """Faults do not outlive an epoch (the next one starts on a healthy disk and bucket)."""
        if self.fs.faults.enabled:
            self.fs.faults.enabled = False
            self._fault("disk_healed")
        s3 = self.s3
        if s3.down or s3.delay or s3.fail_rate or s3.delete_fail_rate:
            s3.down, s3.delay, s3.fail_rate, s3.delete_fail_rate = False, 0.0, 0.0, 0.0
            self._fault("s3_start")

    def _heal(self) -> None:
        self._end_faults()
        if self.ballast:
            self._remove_ballast()
            self._fault("disk_freed")

    # ---- the end ----------------------------------------------------------------------

    async def _final(self) -> None:
        """Every fault healed, the server started again: a quiet spell, then every stream read in
        full (the reads the checker judges the whole run by), and no descriptor left on a deleted
        stream."""
        async with trio.open_nursery() as nursery:
            self.world = await self._start(nursery)
            await self._restarted(self.world)
            await trio.sleep(90.0)  # backoffs expire, the archiver catches up
            ctx = GenContext("final", random.Random(0), self.view)
            for name in all_names():
                await self.execute(
                    "final", Planned("head", name, {}, Call("HEAD", f"/v1/stream/{name}")), ctx
                )
                await self._read_all(name, ctx)
            await self._read_all(REGISTRY_STREAM, ctx, op="registry_read")
            leaked = {
                fd: path for fd, path in self.fs.open_fds().items() if path.startswith(str(ROOT / "trash"))
            }
            if leaked:
                self.extra_findings.append(
                    Finding(
                        "fd-leak", f"descriptors open on deleted streams: {leaked}", [], trio.current_time()
                    )
                )
            nursery.cancel_scope.cancel()
        self._event(self.history.fault("term"))
        self.world = None

    async def _read_all(self, name: str, ctx: GenContext, op: str = "read") -> None:
        offset = "-1"
        for _ in range(10_000):
            call = Call("GET", f"/v1/stream/{name}", query={"offset": offset})
            outcome = await self.execute(
                "final", Planned(op, name, {"offset": offset, "final": True}, call), ctx
            )
            if outcome.status != 200:
                return
            offset = outcome.headers.get("stream-next-offset", offset)
            if outcome.headers.get("stream-up-to-date") == "true":
                return


def _settings(config: SimConfig) -> SimpleNamespace:
    """The settings `streamkeep serve` would run with, sized for the simulation: short live
    reads, small reads and live windows, actors that hibernate soon, retention every second."""
    settings = settings_config.load(None, env={})
    settings.storage.mode = "disk"
    settings.storage.data_dir = str(ROOT)
    settings.storage.fsync = config.fsync
    settings.storage.fsync_interval = config.fsync_interval
    settings.storage.sync_method = config.sync_method
    settings.storage.segment_max_bytes = config.segment_max_bytes
    settings.storage.segment_max_messages = config.segment_max_messages
    settings.storage.segment_max_age = config.segment_max_age
    settings.storage.min_free_bytes = config.min_free_bytes
    settings.storage.io_threads = 4
    # Serve before reading any stream: every restart then reads streams in the background and on
    # first use, under the same faults as everything else.
    settings.storage.read_before_serving = 0.0
    settings.limits.max_stream_bytes = 1 << 20
    settings.limits.max_total_bytes = 1 << 24
    settings.server.hibernate_after = 5.0
    settings.server.long_poll_timeout = 2.0
    settings.server.sse_close_after = 4.0
    settings.limits.read_chunk_bytes = 700
    settings.limits.live_window_bytes = 2048
    settings.retention.interval = 1.0
    settings.retention.rules = torture_retention.rules(config.segment_max_bytes) if config.retention else []
    return settings


def _ticking(clock: Callable[[], float]) -> Callable[[], float]:
    """`clock`, made strictly increasing by a microsecond where it stands still. Mock time stands
    still between checkpoints, so a delete and the create after it would share an instant, and
    the model orders operations by time (a wall clock never ties at its resolution)."""
    last = [0.0]

    def now() -> float:
        last[0] = max(clock(), last[0] + 1e-6)
        return last[0]

    return now


class _all:
    """Holds several trio locks (in a fixed order, so two holders cannot deadlock)."""

    def __init__(self, locks: list[trio.Lock]) -> None:
        self.locks = locks

    async def __aenter__(self) -> None:
        taken: list[trio.Lock] = []
        try:
            for lock in self.locks:
                await lock.acquire()
                taken.append(lock)
        except BaseException:
            # Cancelled (the epoch ended) while waiting for a later lock: a lock kept by a task
            # that is gone breaks every later acquire (seeds 2393, 2434).
            for lock in reversed(taken):
                lock.release()
            raise

    async def __aexit__(self, *_: object) -> None:
        for lock in reversed(self.locks):
            lock.release()


class RanTooLong(Exception):
    """A seed ran far longer in real time than any seed takes: a livelock (tasks that keep
    running without ever waiting, so mock time stands still and no timeout can fire)."""


@contextmanager
def _real_time_limit(seconds: float) -> Iterator[None]:
    """Raises RanTooLong into the run after `seconds` of real time (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(_signum: int, _frame: object) -> None:
        raise RanTooLong(f"the seed ran for {seconds:.0f} s of real time without ending: a livelock?")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run(config: SimConfig) -> SimResult:
    """One seed, start to verdict. Deterministic: the same config gives the same result."""
    logging.disable(logging.CRITICAL)  # the server logs every injected fault; the verdict is ours
    # The cycle collector runs when allocations say so, and what it collects can act (an async
    # generator a vanished client left is finalized on trio's loop): after an earlier seed in the
    # same process it would act at other moments. Collected before the run and off during it.
    gc.collect()
    gc.disable()
    try:
        with simthreads.deterministic(config.seed) as determinism:
            simulation = Simulation(config, determinism)
            crashed = None
            try:
                with _real_time_limit(config.real_time_limit or max(60.0, config.ops * 0.02)):
                    trio.run(simulation.run, clock=simthreads.mock_clock())
            except BaseException as error:  # the server (or the harness) died: a finding in itself
                crashed = "".join(traceback.format_exception(error))[-3000:]
            simulation._feed()
            simulation.checker.finish()
    finally:
        logging.disable(logging.NOTSET)
        gc.enable()
    summary = simulation.checker.summary()
    summary.findings.extend(simulation.extra_findings)
    if crashed is not None:
        summary.findings.append(
            Finding("server-down", f"the run ended with an exception:\n{crashed}", [], 0.0)
        )
    digest = hashlib.sha256("\n".join(simulation.trace).encode()).hexdigest()[:16]
    return SimResult(config, summary, dict(simulation.faults), digest, simulation.epochs, simulation.trace)


def report(result: SimResult) -> str:
    config, summary = result.config, result.summary
    kinds = summary.op_kinds()
    lines = [
        f"seed {config.seed} ({config.fsync}/{config.sync_method}): {sum(kinds.values())} operations, "
        f"{result.epochs} epochs, faults {dict(sorted(result.faults.items()))}, trace {result.digest}: "
        + ("ok" if result.ok else f"{len(summary.findings)} findings")
    ]
    for finding in summary.findings[:20]:
        lines.append(f"  - {finding}")
    if not result.ok:
        lines.append(f"  replay: {config.command()}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    parser.add_argument("--seeds", type=int, default=1, help="run this many seeds from --seed on")
    parser.add_argument("--ops", type=int, default=1500)
    parser.add_argument("--workers", type=int, default=5)
    parser.add_argument("--fsync", choices=("always", "interval", "never"), default="always")
    parser.add_argument("--sync-method", choices=("fdatasync", "syncfs"), default="fdatasync")
    cuts = parser.add_mutually_exclusive_group()
    cuts.add_argument("--no-power-cuts", action="store_true")
    cuts.add_argument(
        "--power-cuts", action="store_true", help="also under --fsync interval|never (see above)"
    )
    parser.add_argument("--no-cold", action="store_true")
    parser.add_argument(
        "--no-retention",
        action="store_true",
        help="no retention rules (the registry is still compacted, as when served)",
    )
    parser.add_argument(
        "--trace", metavar="TEXT", help="print the file system and S3 calls that mention TEXT"
    )


def config_from(args: argparse.Namespace, seed: int) -> SimConfig:
    return SimConfig(
        seed=seed,
        ops=args.ops,
        workers=args.workers,
        fsync=args.fsync,
        sync_method=args.sync_method,
        power_cuts=args.power_cuts or (not args.no_power_cuts and args.fsync == "always"),
        cold=not args.no_cold,
        retention=not args.no_retention,
    )


def main(args: argparse.Namespace) -> int:
    failed = 0
    for seed in range(args.seed, args.seed + args.seeds):
        result = run(config_from(args, seed))
        if args.trace:
            for line in result.trace:
                if args.trace in line or line.startswith("=="):
                    print(line)
        print(report(result), flush=True)
        failed += not result.ok
    return 1 if failed else 0


if __name__ == "__main__":
    simthreads.reexec_with_hash_seed()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
