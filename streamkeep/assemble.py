"""The composition root: the whole server built from settings, in one place.

`Server` builds every part from the settings (storage, auth, the cluster's front door, metrics,
the service) and `recover` brings streams up: storage recovered (upgraded to the current format
first), the cold tier, compaction, the registry, retention, the TTL sweep and subscriptions. `serve`
(what `streamkeep serve` runs) starts the HTTP edge before recovery, so probes can tell a long
recovery (/healthz 200, /readyz 503) from a hung process while streams answer 503.

The simulation (ops/torture/sim.py) runs this same wiring with `Injected` parts: its simulated
disk and bucket, and its own thread runner. At shutdown, storage syncs what a relaxed fsync policy
left.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import trio

from streamkeep import collector
from streamkeep.actors.expiry import sweep_expired
from streamkeep.actors.supervisor import Supervisor
from streamkeep.auth import setup as auth_setup
from streamkeep.background import MemoryGiveBack, supervised
from streamkeep.cluster import registry_setup as cluster_registry
from streamkeep.cluster.forks import RemoteForks
from streamkeep.cluster.forward import Forwarder
from streamkeep.cluster.peers import Peers
from streamkeep.cluster.placement import SLOTS, Member, Placement
from streamkeep.cluster.subscriptions import SubscriptionPeers
from streamkeep.cluster.subscriptions_view import RemoteStreams
from streamkeep.compaction import Compactor
from streamkeep.health import Health
from streamkeep.http.listen import listen
from streamkeep.registry import keeper as registry_keeper
from streamkeep.registry.keeper import RegistryKeeper
from streamkeep.server.forwarding import FrontDoor
from streamkeep.server.probes import Readiness, Sections
from streamkeep.server.service import Recovered, Service, ServiceOptions
from streamkeep.storage import files
from streamkeep.storage.base import ByteBudget
from streamkeep.storage.cold import migrate
from streamkeep.storage.cold.archiver import Archiver
from streamkeep.storage.cold.store import ColdConfig, ObjectStore, S3Store
from streamkeep.storage.disk.retention import Retention, RetentionRule
from streamkeep.storage.disk.storage import READ_CACHE_BYTES, DiskStorage
from streamkeep.storage.files import FileSystem
from streamkeep.storage.memory import MemoryStorage
from streamkeep.subscriptions.manager import SubscriptionManager
from streamkeep.subscriptions.signing import Keys
from streamkeep.telemetry import prometheus
from streamkeep.telemetry.accesslog import AccessLog
from streamkeep.telemetry.prometheus import Sources
from streamkeep.telemetry.requests import RequestStats
from streamkeep.ui import UiFiles, exposure_warning

log = logging.getLogger("streamkeep")

RECOVERING = "recovering streams from the data directory"
RunSync = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class Injected:
    """Parts put in place of what the settings would build; the defaults are the real ones."""

    # The file system disk storage writes through, and the size of each log's tail cache: the
    # simulation's disk is simulated, and its cache small so that reads go to that disk.
    fs: FileSystem = files.OS
    read_cache_bytes: int = READ_CACHE_BYTES
    cold_config: ColdConfig | None = None  # None: from the settings (`--cold-url`)
    object_store: Callable[[ColdConfig], ObjectStore] = S3Store
    run_sync: RunSync | None = None  # where blocking work runs; None: trio's worker threads
    # Whether signing keys, subscription state and the /readyz probe file live in the data
    # directory (False: in memory and unchecked, for a data directory that is not on the real disk).
    state_on_disk: bool = True
    subscriptions: bool = True
    # Asked when storage fails to start, with the error and the attempt (from 0): True retries.
    retry_start: Callable[[OSError, int], Awaitable[bool]] | None = None
    # A replica's coordinator (streamkeep/replica.py), shown in /stats and metrics: `describe()`.
    replication: Any = None
    # Called once streams are served (maybe before all are read: --read-before-serving): a
    # replica takes its follower from then on.
    on_serving: Callable[[], None] | None = None
    # Streams read in the background between two checkpoints (None: as many as 5 ms allow); the
    # simulation counts them, so that its runs replay.
    read_slice_streams: int | None = None
    # Write descriptors kept open at most (None: half the process's limit); the simulation keeps
    # a few, so that giving them back and opening them again meets every fault it makes.
    write_descriptors: int | None = None


def make_storage(settings: SimpleNamespace, injected: Injected | None = None) -> MemoryStorage | DiskStorage:
    """The configured storage, not yet recovered (nothing read from disk yet)."""
    limits = settings.limits
    if settings.storage.mode == "memory":
        return MemoryStorage(max_stream_bytes=limits.max_stream_bytes, max_total_bytes=limits.max_total_bytes)
    options = settings.storage
    injected = Injected() if injected is None else injected
    return DiskStorage(
        Path(options.data_dir),
        budget=ByteBudget(max_stream_bytes=limits.max_stream_bytes, max_total_bytes=limits.max_total_bytes),
        fsync=options.fsync,
        fsync_interval=options.fsync_interval,
        segment_max_bytes=options.segment_max_bytes,
        segment_max_messages=options.segment_max_messages,
        segment_max_age=options.segment_max_age,
        io_threads=options.io_threads,
        sync_method=options.sync_method,
        min_free_bytes=options.min_free_bytes,
        fs=injected.fs,
        run_sync=injected.run_sync,
        cache_bytes=injected.read_cache_bytes,
        read_slice_streams=injected.read_slice_streams,
        write_descriptors=injected.write_descriptors,
    )


def service_options(settings: SimpleNamespace) -> ServiceOptions:
    return ServiceOptions(
        long_poll_timeout=settings.server.long_poll_timeout,
        sse_close_after=settings.server.sse_close_after,
        read_chunk_bytes=settings.limits.read_chunk_bytes,
        live_window_bytes=settings.limits.live_window_bytes,
        send_stall_timeout=settings.server.send_stall_timeout,
        cors_origins=settings.http.cors_origins,
        # With auth on, a shared cache must not hand one client's read to another (PROTOCOL §12.2).
        cache_visibility="private" if auth_setup.enabled(settings) else settings.http.cache_visibility,
    )


class Server:
    """Every part of one server process, built from `settings`; streams wait for `recover`."""

    def __init__(
        self, settings: SimpleNamespace, nursery: trio.Nursery, injected: Injected | None = None
    ) -> None:
        self.settings = settings
        self.nursery = nursery
        self.injected = injected = Injected() if injected is None else injected
        self.run_sync: RunSync = injected.run_sync or trio.to_thread.run_sync
        self.storage = storage = make_storage(settings, injected)
        self.supervisor = supervisor = Supervisor(
            storage,
            nursery,
            mailbox_size=settings.server.mailbox_size,
            hibernate_after=settings.server.hibernate_after,
        )
        self.data_dir = storage.root if isinstance(storage, DiskStorage) else None
        self.state_dir = self.data_dir if injected.state_on_disk else None
        self.storage_fs = injected.fs  # state files (keys, subscriptions) go where streams go
        self.gate = gate = auth_setup.build_gate(settings, self.state_dir, fs=injected.fs)
        # /stats sections, filled in as their parts start (same order as the parts come up).
        self.sections: Sections = {}
        self.cluster = self._front_door()
        health = Health()  # the background work's failures, the service's own and the access log's
        access_log = None
        if settings.log.access_log:
            access_log = AccessLog(
                settings.log.access_log, json_lines=settings.log.format == "json", health=health
            )
            nursery.start_soon(access_log.run)
        request_stats = (
            RequestStats(access_log) if settings.metrics.enabled or access_log is not None else None
        )
        self.sources = Sources(service=None, storage=storage, gate=gate, replication=injected.replication)
        if injected.replication is not None:
            self.sections["replication"] = injected.replication.describe
        self.metrics_page = prometheus.page(self.sources) if settings.metrics.enabled else None
        self.service = Service(
            supervisor,
            service_options(settings),
            gate=gate,
            request_stats=request_stats,
            ui=UiFiles() if settings.ui.enabled else None,
            cluster=self.cluster,
            readiness=Readiness(
                data_dir=self.state_dir,
                min_free_bytes=settings.storage.min_free_bytes if self.state_dir is not None else 0,
                jwks_loaded=auth_setup.jwks_readiness(gate),
            ),
            metrics_page=self.metrics_page if settings.metrics.port is None else None,
            spawn=nursery.start_soon,
            health=health,
            sections=self.sections,
            recovering=RECOVERING,
        )
        self.sources.service = self.service
        if gate is not None and gate.jwks is not None:
            nursery.start_soon(gate.jwks.run)

    def _front_door(self) -> FrontDoor | None:
        """In a cluster: who owns which stream, and which member this process is (None: alone)."""
        settings = self.settings
        cluster = settings.cluster
        if not cluster.member:
            return None
        members = [Member(member_id, address) for member_id, address in cluster.members]
        placement = Placement.of(members, cluster.epoch)
        if not cluster.secret:
            door = FrontDoor(placement, cluster.member, cluster.secret)
            self.sections["cluster"] = door.stats
        else:
            live = max(settings.server.long_poll_timeout, settings.server.sse_close_after)
            peers = Peers(placement, cluster.member, cluster.secret)
            forwarder = Forwarder(cluster.member, cluster.secret, live + 30)
            door = FrontDoor(placement, cluster.member, cluster.secret, forwarder=forwarder, peers=peers)
            self.sections["cluster"] = door.stats
            remote_forks = RemoteForks(peers, self.supervisor)
            self.storage.remote = remote_forks  # before recovery: it links forks to their sources
            remote_forks.register(door.peer_ops)
            self.sections["cluster_forks"] = remote_forks.stats
        log.info(
            "cluster member %r of %d (placement epoch %d): serving %d of %d slots",
            cluster.member,
            len(members),
            cluster.epoch,
            placement.slots_of(cluster.member),
            SLOTS,
        )
        return door

    async def recover(self) -> None:
        """Recovers storage and starts what needs it, then serves streams."""
        settings, nursery, storage, supervisor = self.settings, self.nursery, self.storage, self.supervisor
        archiver = await self._recover_storage()
        self.sources.archiver = archiver
        if isinstance(storage, DiskStorage):
            self.sections["storage"] = storage.stats
        if archiver is not None:
            self.sections["cold"] = archiver.stats
        compactor = None
        if isinstance(storage, DiskStorage):
            compactor = Compactor(supervisor, nursery)
            self.sections["compaction"] = compactor.stats
        registry, registry_later = await self._start_registry()
        rules = [RetentionRule(**rule) for rule in settings.retention.rules]
        if registry is not None and isinstance(storage, DiskStorage):  # kept here
            rules.insert(0, registry_keeper.RETENTION_RULE)  # first: no user rule may drop its entries
        if isinstance(storage, DiskStorage) and rules:
            assert compactor is not None

            def notify(name: str) -> None:
                for listener in list(supervisor.listeners):
                    listener(name)

            retention = Retention(
                storage,
                rules,
                interval=settings.retention.interval,
                notify=notify,
                compact=compactor.start_due,
            )
            self.sources.retention = retention
            self.sections["retention"] = retention.stats
            nursery.start_soon(supervised, "retention", retention.run, retention.health)
        nursery.start_soon(supervised, "TTL sweep", partial(sweep_expired, supervisor), self.service.health)
        if isinstance(storage.remote, RemoteForks):
            nursery.start_soon(supervised, "fork pin reconcile", storage.remote.run, storage.remote.health)
        subscriptions = await self._start_subscriptions() if self.injected.subscriptions else None
        if self.gate is not None:
            self.sections["auth"] = self.gate.stats
        self.service.serve_streams(Recovered(registry, compactor, subscriptions))
        if registry_later is not None:
            nursery.start_soon(registry_later)  # a relay's repair: the keeper calls us back

    async def _recover_storage(self) -> Archiver | None:
        """Recovers disk storage (upgraded to the current format first if it was older) and starts
        its background work; returns its cold tier, if one is configured."""
        storage = self.storage
        if not isinstance(storage, DiskStorage):
            return None
        root = storage.root
        cold = self.injected.cold_config or ColdConfig.from_settings(self.settings)
        store = await self.run_sync(self.injected.object_store, cold) if cold is not None else None
        if await self.run_sync(migrate.pending_version, storage.fs, root):
            await self.run_sync(migrate.upgrade, storage.fs, root, store, log.info)
        log.info("recovering streams from %s ...", root.resolve())
        attempt = 0
        while (
            True
        ):  # a retry is the injected policy's (the simulation's faults); the real disk's errors end the start
            try:
                report = await storage.start(
                    self.nursery, serve_after=self.settings.storage.read_before_serving
                )
                break
            except OSError as error:
                if self.injected.retry_start is None or not await self.injected.retry_start(error, attempt):
                    raise
                attempt += 1
        unread = storage.unread()
        if unread:
            log.info(
                "read %d streams in %.2f s; serving now, the other %d are read in the background "
                "(each at once when asked for)",
                report.streams,
                report.seconds,
                unread,
            )
        else:
            log.info("%s", report.summary())
        if store is None or cold is None:
            return None
        archiver = Archiver(storage, store, cold, run_sync=self.injected.run_sync)
        storage.cold = archiver
        self.nursery.start_soon(supervised, "cold tier", archiver.run, archiver.health)
        return archiver

    async def _start_registry(self) -> tuple[RegistryKeeper | None, Callable[[], Awaitable[None]] | None]:
        """The keeper of `__registry__` (None: off, or another cluster member keeps it), and what to
        start once streams are served."""
        if not self.settings.registry.enabled:
            return None, None
        cluster = self.cluster
        if cluster is not None:
            # One registry for the cluster, on the member owning the name; the others relay to it.
            part = await cluster_registry.start(
                self.supervisor,
                cluster.placement,
                cluster.member_id,
                cluster.peers,
                cluster.peer_ops,
                self.nursery,
            )
            if part.stats is not None:
                self.sections["registry"] = part.stats
            return part.keeper, part.later
        # Before streams are served: it lists what recovery found (a crash may have come between
        # a create or delete and its entry), or stops the server over a stream it cannot adopt
        # (RegistryConflict).
        registry = RegistryKeeper(self.supervisor)
        self.supervisor.lifecycle = registry
        await registry.start()
        self.sections["registry"] = registry.stats
        self.nursery.start_soon(supervised, "registry", registry.run, registry.health)
        return registry, None

    async def _start_subscriptions(self) -> SubscriptionManager:
        # In a cluster with a secret, subscriptions follow every member's streams and every member
        # signs webhooks with the one key derived from the secret (streamkeep/cluster/subscriptions.py).
        state = self.state_dir
        cluster = self.cluster
        peers = None if cluster is None else cluster.peers
        shared = None if peers is None else self.settings.cluster.secret
        keys = await self.run_sync(
            partial(
                Keys, None if state is None else state / "keys", cluster_secret=shared, fs=self.storage_fs
            )
        )
        view = None if peers is None else RemoteStreams(peers.placement, peers.member, self.storage)
        subscriptions = SubscriptionManager(
            self.supervisor,
            keys,
            state_dir=None if state is None else state / "subscriptions",
            allow_loopback_webhooks=self.settings.server.allow_loopback_webhooks,
            view=view,
            fs=self.storage_fs,
        )
        if cluster is not None and peers is not None and view is not None:
            subscriptions.attach(
                SubscriptionPeers(
                    subscriptions,
                    view,
                    peers,
                    cluster.peer_ops,
                    cluster.forwarder,
                    self.settings.cluster.secret,
                )
            )
        await self.nursery.start(subscriptions.run)
        self.sources.subscriptions = subscriptions
        self.sections["subscriptions"] = subscriptions.stats
        return subscriptions


async def serve(settings: SimpleNamespace, injected: Injected | None = None) -> None:
    opened: list[DiskStorage] = []
    try:
        await _serve(settings, opened, injected)
    finally:
        for storage in opened:  # after every task ended: sync what fsync=interval/never left, close
            with trio.CancelScope(shield=True):
                await storage.stop()


async def _serve(settings: SimpleNamespace, opened: list[DiskStorage], injected: Injected | None) -> None:
    async with trio.open_nursery() as nursery:
        server = Server(settings, nursery, injected)
        service = server.service
        shutdown = trio.Event()

        async def watch_signals() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("%s: ending live reads, finishing requests", signal.Signals(signum).name)
                    service.begin_shutdown()
                    shutdown.set()
                    return

        nursery.start_soon(watch_signals)
        # Here, not in Server: the simulation runs Server on a mock clock and replays seeds exactly.
        give_back = MemoryGiveBack()
        server.supervisor.many_hibernated = give_back.soon
        nursery.start_soon(supervised, "memory trim", give_back.run, service.health)
        # The edge listens from the start, so probes can tell a long recovery from a hung process.
        binds = await listen(settings, service, server.metrics_page, nursery, shutdown)
        if isinstance(server.storage, DiskStorage):
            opened.append(server.storage)
        await server.recover()
        if server.injected.on_serving is not None:
            server.injected.on_serving()
        for bind in binds:
            # Tests and scripts read this line to find the port when started with --port 0; it
            # comes once streams are served.
            print(f"streamkeep listening on {bind}", flush=True)
        metrics_page = server.metrics_page
        log.info(
            "edge: %s; storage: %s, fsync=%s; auth: %s; metrics: %s",
            settings.server.edge,
            settings.storage.mode,
            settings.storage.fsync,
            auth_setup.describe(server.gate),
            "off"
            if metrics_page is None
            else f"port {settings.metrics.port}"
            if settings.metrics.port
            else "/metrics",
        )
        if service.ui is not None:
            log.info("stream browser at %s/ui/", binds[0])
            warning = exposure_warning(settings.server.host, ui_on=True, auth_on=server.gate is not None)
            if warning is not None:
                log.warning("%s", warning)


def run(settings: SimpleNamespace) -> None:
    collector.tune()  # the process's, so here and not in `serve`, which tests run in theirs
    trio.run(serve, settings)


__all__ = ["Injected", "Server", "make_storage", "run", "serve", "service_options"]
