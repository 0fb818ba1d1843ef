"""The deterministic tier: the whole server in one process, on simulated time, disk and bucket.

    python -m ops.torture.sim --seed 7 --ops 2000 [--fsync always|interval|never] [--sync-method ...]

The real actors, storage, archiver and service run inside one trio run on a `MockClock`, on
`SimFileSystem` (ops/torture/simfs.py: every call can fail with ENOSPC, EIO, a short write or a
failed fsync, and a power cut keeps an adversarial part of what was not synced) and `SimS3`
(down, slow, wiped, refusing deletes). Worker threads are `SimThreads` (run inline between seeded
yields), and the server's clocks and randomness are seeded (`simthreads.deterministic`), so one
seed replays exactly: the same operations, the same interleavings, the same faults, the same
verdict. A failing seed prints the command that replays it.

Clients (several tasks, one shared pool of stream names so that everything collides) create,
append (plain, and as idempotent producers that retry on no answer), close, delete, re-create,
fork, read (catch-up, long-poll, SSE) and HEAD, through `Service.handle`, exactly as the HTTP edge
would. A fault task meanwhile switches disk faults on and off, fills the disk and frees it, takes
the bucket down, slows it, wipes it, and ends epochs: a process crash (every task cancelled, the
page cache kept), a power cut (only what was synced survives, and some of what was not), or a
clean stop. After each restart every stream is read back and judged against the fsync mode's
contract; at the end, with the faults healed, every stream is read in full. `ops/torture/model.py`
judges every answer.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from ops.torture import simthreads
from ops.torture.sim_model import Checker, Event, json_message, stored_json, text_body
from ops.torture.simfs import FaultPlan, SimFileSystem
from ops.torture.sims3 import SimS3, SimS3Error
from streamkeep.actors.supervisor import Supervisor
from streamkeep.protocol.model import Headers, Request, Response
from streamkeep.service import Service, ServiceOptions
from streamkeep.storage import files
from streamkeep.storage.archiver import Archiver
from streamkeep.storage.base import ByteBudget
from streamkeep.storage.coldstore import ColdConfig
from streamkeep.storage.disk import DiskStorage

ROOT = Path("/data")
NAMES = ("a", "b", "c/d", "e", "json1", "json2")
FORKS = ("fork1", "fork2")
OP_TIMEOUT = 120.0  # mock seconds; an operation taking longer is a hang, and a finding


@dataclass
class SimConfig:
    seed: int = 1
    ops: int = 1000
    clients: int = 5
    fsync: str = "always"
    sync_method: str = "fdatasync"
    fsync_interval: float = 1.0
    capacity: int = 400_000
    power_cuts: bool = True
    cold: bool = True
    segment_max_bytes: int = 4096
    segment_max_messages: int = 6
    segment_max_age: float = 3.0
    min_free_bytes: int = 8192

    def command(self) -> str:
        return (
            f"python -m ops.torture.sim --seed {self.seed} --ops {self.ops} --clients {self.clients} "
            f"--fsync {self.fsync} --sync-method {self.sync_method}"
            + ("" if self.power_cuts else " --no-power-cuts")
            + ("" if self.cold else " --no-cold")
        )


@dataclass
class SimResult:
    config: SimConfig
    findings: list[str]
    summary: dict[str, Any]
    faults: dict[str, int]
    digest: str
    epochs: int
    crashed: str | None = None
    trace: list[str] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return not self.findings and self.crashed is None


class SimStore:
    """`ObjectStore` (streamkeep.storage.coldstore) over `SimS3`."""

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


@dataclass
class World:
    """One epoch of the server: storage, cold tier, actors and service on the shared sim state."""

    storage: DiskStorage
    service: Service
    archiver: Archiver | None


class EpochEnd(Exception):
    pass


@dataclass
class Stream:
    """What a client needs to remember about a name (not the truth: the checker has that)."""

    json_mode: bool = False
    producer_seq: dict[int, int] = field(default_factory=dict)


class Simulation:
    def __init__(self, config: SimConfig, determinism: simthreads.Determinism) -> None:
        self.config = config
        self.det = determinism
        self.rng = determinism.rng("workload")
        self.fault_rng = determinism.rng("faults")
        self.trace: list[str] = []
        self.fs = SimFileSystem(
            capacity=config.capacity,
            faults=FaultPlan(determinism.rng("fs-faults"), rates={}, enabled=False),
            trace=self.trace,
        )
        self.s3 = SimS3(determinism.rng("s3"), trace=self.trace)
        self.checker = Checker(config.fsync, config.fsync_interval)
        self.faults: dict[str, int] = {}
        self.epochs = 0
        self.done_ops = 0
        self.next_id = 0
        self.streams: dict[str, Stream] = {}
        self.world: World | None = None
        self.ballast = 0

    # ---- the run ----------------------------------------------------------------------

    async def run(self) -> None:
        config = self.config
        while self.done_ops < config.ops:
            ending = await self._epoch()
            self.epochs += 1
            now = trio.current_time()
            self.trace.append(f"== {ending} at {now:.3f}")
            if ending == "power cut":
                self.fs = self.fs.power_cut(self.fault_rng)
                self.fs.faults.enabled = False
            else:
                self.fs.crash()
            await self._recovery_reads(power_cut=ending == "power cut", cut_at=now)
        await self._heal()
        await self._final_reads()

    async def _epoch(self) -> str:
        """Runs the server and the clients until the fault task ends the epoch; returns how."""
        ending = "clean stop"
        async with trio.open_nursery() as outer:
            world = await self._start(outer)
            self.world = world
            stop = trio.Event()
            result: list[str] = []
            async with trio.open_nursery() as clients:
                for number in range(self.config.clients):
                    clients.start_soon(self._client, number, stop)
                clients.start_soon(self._fault_task, stop, result)
                await stop.wait()
                clients.cancel_scope.cancel()
            ending = result[0] if result else "clean stop"
            outer.cancel_scope.cancel()  # the server's tasks end here, as in a crash
        if ending == "clean stop":
            with trio.CancelScope(shield=True):
                await world.storage.stop()
        self.world = None
        self._end_faults()
        return ending

    async def _start(self, nursery: trio.Nursery) -> World:
        config = self.config
        storage = DiskStorage(
            ROOT,
            budget=ByteBudget(max_stream_bytes=1 << 20, max_total_bytes=1 << 24),
            fs=self.fs,
            run_sync=self.det.threads.run_sync,
            fsync=config.fsync,
            fsync_interval=config.fsync_interval,
            sync_method=config.sync_method,
            segment_max_bytes=config.segment_max_bytes,
            segment_max_messages=config.segment_max_messages,
            segment_max_age=config.segment_max_age,
            cache_bytes=512,
            io_threads=4,
            min_free_bytes=config.min_free_bytes,
        )
        for attempt in range(50):  # starting can fail on injected faults: that is not a finding
            try:
                await storage.start(nursery)
                break
            except OSError as error:
                self.trace.append(f"start failed: {error}")
                self.fs.faults.enabled = False
                await trio.sleep(1.0)
                if attempt == 49:
                    raise
        archiver = None
        if config.cold:
            cold = ColdConfig(
                "archive", "sim", None, None, create_bucket=True, high_water_bytes=60_000, cache_bytes=2048
            )
            archiver = Archiver(storage, SimStore(self.s3, cold), cold, run_sync=self.det.threads.run_sync)
            storage.cold = archiver
            from streamkeep.background import supervised

            nursery.start_soon(supervised, "cold tier", archiver.run, archiver.health)
        supervisor = Supervisor(storage, nursery, hibernate_after=5.0)
        service = Service(
            supervisor,
            ServiceOptions(
                long_poll_timeout=2.0, sse_close_after=4.0, read_chunk_bytes=700, live_window_bytes=2048
            ),
        )
        service.nursery = nursery
        nursery.start_soon(service.sweep_expired)
        return World(storage, service, archiver)

    # ---- clients ----------------------------------------------------------------------

    async def _client(self, number: int, stop: trio.Event) -> None:
        rng = self.det.rng(f"client-{number}-{self.epochs}")
        while not stop.is_set():
            if self.done_ops >= self.config.ops:
                stop.set()
                return
            self.done_ops += 1
            choice = rng.random()
            name = rng.choice(NAMES + FORKS)
            if choice < 0.40:
                await self._append(number, name, rng)
            elif choice < 0.55:
                await self._catch_up(number, name, rng)
            elif choice < 0.60:
                await self._long_poll(number, name, rng)
            elif choice < 0.65:
                await self._sse(number, name, rng)
            elif choice < 0.75:
                if name in FORKS:
                    await self._fork(number, name, rng)
                else:
                    await self._create(number, name, rng)
            elif choice < 0.82:
                await self._simple(number, "delete", name, "DELETE")
            elif choice < 0.85:
                await self._close(number, name, rng)
            else:
                await self._simple(number, "head", name, "HEAD")
            await trio.sleep(rng.uniform(0, 0.2))

    def _id(self, client: int) -> str:
        self.next_id += 1
        return f"c{client}.{self.next_id}"

    async def _call(self, request: Request, impatient: float = 0.0) -> Response | None:
        """One request through the service; None if there was no answer: the epoch ended first (a
        crash), or (with `impatient`, the probability) the client gave up waiting while the
        server went on with it, as a client whose connection dropped. A request that takes longer
        than OP_TIMEOUT mock seconds is a hang: reported, and counted as no answer."""
        world = self.world
        if world is None:
            return None
        if impatient and self.rng.random() < impatient:
            answers: list[Response] = []

            async def in_background() -> None:
                answers.append(await world.service.handle(request))

            assert world.service.nursery is not None
            world.service.nursery.start_soon(in_background)
            await trio.sleep(self.rng.uniform(0, 0.02))
            self.faults["client gave up"] = self.faults.get("client gave up", 0) + 1
            return answers[0] if answers and self.rng.random() < 0.5 else None
        with trio.move_on_after(OP_TIMEOUT) as scope:
            return await world.service.handle(request)
        if scope.cancelled_caught:
            self.checker.findings.append(
                f"request hung for {OP_TIMEOUT} mock seconds: {request.method} {request.raw_path}"
            )
        return None

    def _record(self, event: Event) -> None:
        event.ended = trio.current_time()
        self.checker.observe(event)

    async def _do(self, event: Event, request: Request, impatient: float = 0.0) -> Response | None:
        """Sends `request` and records `event` with its answer, or without one if the epoch ends
        first: an operation cut off by a crash may or may not have happened."""
        response = None
        try:
            response = await self._call(request, impatient)
        finally:
            self._answer(event, response)
            self._record(event)
        return response

    async def _create(self, client: int, name: str, rng: random.Random) -> None:
        json_mode = name.startswith("json")
        headers = [("Content-Type", "application/json" if json_mode else "text/plain")]
        note = ""
        if rng.random() < 0.1:
            headers.append(("Stream-TTL", str(rng.choice([3, 30]))))
            note = "ttl"
        closed = rng.random() < 0.05
        if closed:
            headers.append(("Stream-Closed", "true"))
        ids, body, data = [], b"", b""
        if rng.random() < 0.5:
            append_id = self._id(client)
            ids = [append_id]
            body = data = (
                json_message(append_id, "x" * rng.randint(0, 40))
                if json_mode
                else text_body(append_id, "y" * rng.randint(0, 60))
            )
        event = Event(
            "create",
            name,
            client,
            trio.current_time(),
            0.0,
            None,
            json_mode=json_mode,
            append_ids=ids,
            data=data,
            note=note,
        )
        response = await self._do(event, Request("PUT", f"/v1/stream/{name}", "", Headers(headers), body))
        if response is not None and response.status == 201:
            self.streams[name] = Stream(json_mode)

    async def _fork(self, client: int, name: str, rng: random.Random) -> None:
        source = rng.choice(NAMES + FORKS)
        headers = [("Stream-Forked-From", f"/v1/stream/{source}")]
        event = Event(
            "fork",
            name,
            client,
            trio.current_time(),
            0.0,
            None,
            fork_of=source,
            json_mode=self.streams.get(source, Stream()).json_mode,
        )
        response = await self._do(event, Request("PUT", f"/v1/stream/{name}", "", Headers(headers), b""))
        if response is not None and response.status == 201:
            self.streams[name] = Stream(event.json_mode)

    async def _append(self, client: int, name: str, rng: random.Random) -> None:
        stream = self.streams.get(name, Stream(name.startswith("json")))
        json_mode = stream.json_mode
        count = 2 if json_mode and rng.random() < 0.3 else 1
        ids = [self._id(client) for _ in range(count)]
        messages = [
            json_message(i, "j" * rng.randint(0, 30))
            if json_mode
            else text_body(i, "z" * rng.randint(0, 300))
            for i in ids
        ]
        data = b"".join(messages)
        body = (b"[" + b",".join(messages) + b"]") if count > 1 else data
        headers = [("Content-Type", "application/json" if json_mode else "text/plain")]
        producer = rng.random() < 0.5
        seq = stream.producer_seq.get(client, 0)
        if producer:
            headers += [("Producer-Id", f"p{client}"), ("Producer-Epoch", "0"), ("Producer-Seq", str(seq))]
        for _attempt in range(6):
            event = Event(
                "append",
                name,
                client,
                trio.current_time(),
                0.0,
                None,
                json_mode=json_mode,
                append_ids=ids,
                data=data,
            )
            if producer:
                event.producer = (f"p{client}", 0, seq)
                event.duplicate = True  # until answered otherwise: a 204 to a producer is a duplicate
            request = Request("POST", f"/v1/stream/{name}", "", Headers(headers), body)
            response = await self._do(event, request, impatient=0.1)
            # Producers retry what got no answer, or 503/507 (Retry-After), with the same seq and
            # body: the server must store it once. Plain appends are never retried.
            if producer and self.world is not None and (response is None or response.status in (503, 507)):
                await trio.sleep(rng.uniform(0, 0.3))
                continue
            break
        if producer and response is not None:
            if response.status in (200, 204):
                stream.producer_seq[client] = seq + 1
            elif response.status == 409 and response.header("Producer-Expected-Seq"):
                stream.producer_seq[client] = int(response.header("Producer-Expected-Seq") or 0)
            elif response.status in (404, 410):
                stream.producer_seq[client] = 0
        self.streams.setdefault(name, stream)

    async def _close(self, client: int, name: str, rng: random.Random) -> None:
        event = Event(
            "close",
            name,
            client,
            trio.current_time(),
            0.0,
            None,
            json_mode=self.streams.get(name, Stream()).json_mode,
        )
        await self._do(
            event, Request("POST", f"/v1/stream/{name}", "", Headers([("Stream-Closed", "true")]), b"")
        )

    async def _simple(self, client: int, op: str, name: str, method: str) -> None:
        event = Event(op, name, client, trio.current_time(), 0.0, None)
        await self._do(event, Request(method, f"/v1/stream/{name}", "", Headers(), b""))

    async def _catch_up(self, client: int, name: str, rng: random.Random) -> None:
        """Reads from the beginning (or a random known offset) to the tail, chunk by chunk."""
        offset = "-1"
        for _ in range(20):
            event = Event("read", name, client, trio.current_time(), 0.0, None, start=offset)
            response = await self._do(
                event, Request("GET", f"/v1/stream/{name}", f"offset={offset}", Headers(), b"")
            )
            if response is None or response.status != 200 or response.header("Stream-Up-To-Date"):
                return
            offset = response.header("Stream-Next-Offset") or "-1"

    async def _long_poll(self, client: int, name: str, rng: random.Random) -> None:
        head = await self._call(Request("HEAD", f"/v1/stream/{name}", "", Headers(), b""))
        if head is None or head.status != 200:
            return
        offset = head.header("Stream-Next-Offset") or "now"
        event = Event("read", name, client, trio.current_time(), 0.0, None, start=offset)
        await self._do(
            event, Request("GET", f"/v1/stream/{name}", f"offset={offset}&live=long-poll", Headers(), b"")
        )

    async def _sse(self, client: int, name: str, rng: random.Random) -> None:
        event = Event("read", name, client, trio.current_time(), 0.0, None, start="-1")
        response = None
        try:
            response = await self._call(
                Request("GET", f"/v1/stream/{name}", "offset=-1&live=sse", Headers(), b"")
            )
            if response is not None and response.stream is not None:
                event.status = response.status
                event.json_mode = self.streams.get(name, Stream()).json_mode
                with trio.move_on_after(rng.uniform(0.5, 6.0)):
                    await self._consume_sse(event, response)
            else:
                self._answer(event, response)
        finally:
            aclose = getattr(response.stream, "aclose", None) if response is not None else None
            if aclose is not None:
                with trio.CancelScope(shield=True):
                    await aclose()
            self._record(event)

    async def _consume_sse(self, event: Event, response: Response) -> None:
        """Turns SSE events into (start, bytes, next offset) chunks for the checker."""
        assert response.stream is not None
        base64_mode = response.header("Stream-SSE-Data-Encoding") == "base64"
        position = 0
        pending: bytes | None = None
        buffer = b""
        try:
            async for chunk in response.stream:
                buffer += bytes(chunk)
                while b"\n\n" in buffer:
                    raw, buffer = buffer.split(b"\n\n", 1)
                    kind, payload = _sse_event(raw)
                    if kind == "data":
                        text = payload.encode()
                        pending = (
                            base64.b64decode(text)
                            if base64_mode
                            else (stored_json(text) if event.json_mode else text)
                        )
                    elif kind == "control":
                        token = json.loads(payload).get("streamNextOffset")
                        if pending is not None:
                            event.chunks.append((position, pending, token))
                            pending = None
                        if token and len(token) == 33:
                            position = int(token[17:])
        except trio.Cancelled:
            raise
        except Exception as error:  # the stream itself failed: a finding
            self.checker.findings.append(f"SSE on {event.stream} failed: {error!r}")

    def _answer(self, event: Event, response: Response | None) -> None:
        if response is None:
            return
        event.status = response.status
        if event.producer is not None:
            event.duplicate = response.status == 204
        event.next_offset = response.header("Stream-Next-Offset")
        event.closed = response.header("Stream-Closed") == "true"
        if response.status >= 400 and response.body:
            try:
                event.code = json.loads(response.body)["error"]["code"]
            except (ValueError, KeyError, TypeError):
                event.code = "?"
        if event.op == "read" and response.status == 200:
            content_type = response.header("Content-Type") or ""
            event.json_mode = content_type.startswith("application/json")
            try:
                event.data = stored_json(response.body) if event.json_mode else response.body
            except ValueError:
                self.checker.findings.append(
                    f"a JSON read answered a body that is not JSON: {response.body[:300]!r}: {event.describe()}"
                )
                event.next_offset = None

    # ---- faults -----------------------------------------------------------------------

    async def _fault_task(self, stop: trio.Event, result: list[str]) -> None:
        rng = self.fault_rng
        while not stop.is_set():
            await trio.sleep(rng.uniform(0.2, 2.0))
            roll = rng.random()
            if roll < 0.15:
                self._toggle_disk_faults(rng)
            elif roll < 0.27:
                await self._toggle_ballast(rng)
            elif roll < 0.37 and self.config.cold:
                self._toggle_s3(rng)
            elif roll < 0.42:
                self._count("crash")
                result.append("crash")
                stop.set()
            elif roll < 0.47 and self.config.power_cuts:
                self._count("power cut")
                result.append("power cut")
                stop.set()
            elif roll < 0.50:
                self._count("clean stop")
                result.append("clean stop")
                stop.set()

    def _count(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1

    def _begin(self, kind: str) -> None:
        self.checker.fault_began(kind, trio.current_time())
        self._count(kind)

    def _end(self, kind: str) -> None:
        self.checker.fault_ended(kind, trio.current_time())

    def _end_faults(self) -> None:
        for kind in list(self.checker.open_faults):
            if kind != "s3 wiped":
                self._end(kind)
        self.fs.faults.enabled = False
        self.s3.down = False
        self.s3.delay = 0.0
        self.s3.fail_rate = 0.0
        self.s3.delete_fail_rate = 0.0

    def _toggle_disk_faults(self, rng: random.Random) -> None:
        plan = self.fs.faults
        if plan.enabled:
            plan.enabled = False
            self._end("disk faults")
            return
        kinds = rng.sample(["enospc", "short", "eio", "fsync_enospc", "edquot"], rng.randint(1, 3))
        plan.rates = {kind: rng.choice([0.02, 0.1, 0.3]) for kind in kinds}
        plan.enabled = True
        self._begin("disk faults")

    async def _toggle_ballast(self, rng: random.Random) -> None:
        path = ROOT / "ballast"
        if self.ballast:
            files.unlink_quietly(self.fs, path)
            self.ballast = 0
            self._end("disk full")
            return
        free = self.fs.free_bytes(ROOT)
        size = max(0, free - rng.randint(0, 20_000))
        if size <= 0:
            return
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
        self.ballast = size
        self._begin("disk full")

    def _toggle_s3(self, rng: random.Random) -> None:
        s3 = self.s3
        roll = rng.random()
        if s3.down or s3.delay or s3.fail_rate or s3.delete_fail_rate:
            s3.down, s3.delay, s3.fail_rate, s3.delete_fail_rate = False, 0.0, 0.0, 0.0
            self._end("s3")
        elif roll < 0.4:
            s3.down = True
            self._begin("s3")
            self._count("s3 down")
        elif roll < 0.6:
            s3.delay = rng.uniform(0.5, 5.0)
            self._begin("s3")
            self._count("s3 slow")
        elif roll < 0.8:
            s3.fail_rate = 0.3
            s3.delete_fail_rate = 0.3
            self._begin("s3")
            self._count("s3 flaky")
        else:
            s3.wipe()  # a bucket that lost everything: cold reads of what it held fail for good
            self._count("s3 wiped")
            self._begin("s3 wiped")  # never ends: those segments are gone

    async def _heal(self) -> None:
        self._end_faults()
        if self.ballast:
            files.unlink_quietly(self.fs, ROOT / "ballast")
            self.ballast = 0

    # ---- reading everything back ------------------------------------------------------

    async def _read_whole(self, world: World, name: str) -> tuple[int, bytes | None, str | None, bool]:
        """(status, content or None, last offset, json) of a full catch-up read from the start."""
        offset, parts, json_mode, token = "-1", [], False, None
        for _ in range(100_000):
            response = await world.service.handle(
                Request("GET", f"/v1/stream/{name}", f"offset={offset}", Headers(), b"")
            )
            if response.status != 200:
                return response.status, None, None, json_mode
            json_mode = (response.header("Content-Type") or "").startswith("application/json")
            parts.append(stored_json(response.body) if json_mode else response.body)
            token = response.header("Stream-Next-Offset")
            if response.header("Stream-Up-To-Date"):
                break
            offset = token or "-1"
        return 200, b"".join(parts), token, json_mode

    async def _recovery_reads(self, *, power_cut: bool, cut_at: float) -> None:
        async with trio.open_nursery() as nursery:
            world = await self._start(nursery)
            self.world = world
            for name in NAMES + FORKS:
                head = await world.service.handle(Request("HEAD", f"/v1/stream/{name}", "", Headers(), b""))
                status, content, _, _ = await self._read_whole(world, name)
                self.checker.recovered(
                    name,
                    head.header("Stream-Next-Offset"),
                    content if status == 200 else None,  # a bucket that is down cannot serve all of it
                    exists=head.status == 200,
                    closed=head.header("Stream-Closed") == "true",
                    at=trio.current_time(),
                    power_cut=power_cut,
                    cut_at=cut_at,
                )
            nursery.cancel_scope.cancel()
        with trio.CancelScope(shield=True):
            await world.storage.stop()
        self.world = None

    async def _final_reads(self) -> None:
        async with trio.open_nursery() as nursery:
            world = await self._start(nursery)
            self.world = world
            await trio.sleep(90.0)  # let the archiver and backoffs settle, the faults healed
            for name in NAMES + FORKS:
                status, content, token, json_mode = await self._read_whole(world, name)
                if status == 200:
                    self.checker.final(name, token, content, json_mode)
                elif status not in (404, 410) and "s3 wiped" not in self.faults:
                    self.checker.findings.append(
                        f"{name}: the final read answered {status} with every fault healed"
                    )
            leaked = {
                fd: path for fd, path in self.fs.open_fds().items() if path.startswith(str(ROOT / "trash"))
            }
            if leaked:
                self.checker.findings.append(f"descriptors open on deleted streams: {leaked}")
            nursery.cancel_scope.cancel()
        with trio.CancelScope(shield=True):
            await world.storage.stop()
        self.world = None


def _sse_event(raw: bytes) -> tuple[str, str]:
    kind, lines = "", []
    for line in raw.decode(errors="replace").split("\n"):
        if line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            lines.append(line[5:])
    return kind, "\n".join(lines)


def run(config: SimConfig) -> SimResult:
    """One seed, start to verdict. Deterministic: the same config gives the same result."""
    logging.disable(logging.CRITICAL)  # the server logs every injected fault; the verdict is ours
    crashed = None
    try:
        with simthreads.deterministic(config.seed) as determinism:
            simulation = Simulation(config, determinism)
            try:
                trio.run(simulation.run, clock=simthreads.mock_clock())
            except BaseException as error:  # the server (or the harness) died: a finding in itself
                crashed = f"the run ended with {error!r}\n" + "".join(traceback.format_exception(error))
    finally:
        logging.disable(logging.NOTSET)
    trace_digest = hashlib.sha256("\n".join(simulation.trace).encode()).hexdigest()[:16]
    return SimResult(
        config,
        list(simulation.checker.findings),
        simulation.checker.summary(),
        dict(simulation.faults),
        trace_digest,
        simulation.epochs,
        crashed,
        simulation.trace,
    )


def report(result: SimResult) -> str:
    lines = [
        f"seed {result.config.seed} ({result.config.fsync}/{result.config.sync_method}): "
        f"{result.summary['events']} operations, {result.epochs} epochs, faults {result.faults}, "
        f"trace {result.digest}: " + ("ok" if result.ok else f"{len(result.findings)} findings")
    ]
    if result.crashed:
        lines.append(f"  {result.crashed}")
    for finding in result.findings[:20]:
        lines.append(f"  - {finding}")
    if not result.ok:
        lines.append(f"  replay: {result.config.command()}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    simthreads.reexec_with_hash_seed()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    parser.add_argument("--seeds", type=int, default=1, help="run this many seeds from --seed on")
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--fsync", choices=("always", "interval", "never"), default="always")
    parser.add_argument("--sync-method", choices=("fdatasync", "syncfs"), default="fdatasync")
    parser.add_argument("--no-power-cuts", action="store_true")
    parser.add_argument("--no-cold", action="store_true")
    parser.add_argument(
        "--trace", metavar="TEXT", help="print the file system and S3 calls that mention TEXT"
    )
    args = parser.parse_args(argv)
    failed = 0
    for seed in range(args.seed, args.seed + args.seeds):
        config = SimConfig(
            seed=seed,
            ops=args.ops,
            clients=args.clients,
            fsync=args.fsync,
            sync_method=args.sync_method,
            power_cuts=not args.no_power_cuts,
            cold=not args.no_cold,
        )
        result = run(config)
        if args.trace:
            for line in result.trace:
                if args.trace in line or line.startswith("=="):
                    print(line)
        print(report(result), flush=True)
        failed += not result.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
