"""Starts the server: storage (recovered, upgraded to the current format), the cold tier, the
service and its background work, then the HTTP edge: the lean edge by default (lean.py,
lean_h2.py: HTTP/1.1, h2c by prior knowledge, TLS with h2) or quart-trio on hypercorn's trio
worker (`--edge quart`). At shutdown, storage syncs what a relaxed fsync policy left."""

from __future__ import annotations

import logging
import signal
import ssl
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from streamkeep.actors.supervisor import Supervisor
from streamkeep.auth import setup as auth_setup
from streamkeep.background import supervised
from streamkeep.cluster import registry_setup as cluster_registry
from streamkeep.cluster.forks import RemoteForks
from streamkeep.cluster.forward import Forwarder
from streamkeep.cluster.peers import Peers
from streamkeep.cluster.placement import SLOTS, Member, Placement
from streamkeep.cluster.subscriptions import SubscriptionPeers
from streamkeep.cluster.subscriptions_view import RemoteStreams
from streamkeep.compaction import Compactor
from streamkeep.http import hypercorn_fixes
from streamkeep.http.app import create_app
from streamkeep.http.budget import BodyBudget
from streamkeep.http.edge import EdgeLimits
from streamkeep.http.lean import serve_lean
from streamkeep.http.metrics_port import MetricsEndpoint
from streamkeep.readiness import Readiness
from streamkeep.registry import keeper as registry_keeper
from streamkeep.service import Service, ServiceOptions
from streamkeep.storage import files, migrate
from streamkeep.storage.archiver import Archiver
from streamkeep.storage.base import ByteBudget
from streamkeep.storage.coldstore import ColdConfig, S3Store
from streamkeep.storage.disk import DiskStorage
from streamkeep.storage.memory import MemoryStorage
from streamkeep.storage.retention import Retention, RetentionRule
from streamkeep.subscriptions.manager import SubscriptionManager
from streamkeep.subscriptions.signing import Keys
from streamkeep.telemetry import prometheus
from streamkeep.telemetry.accesslog import AccessLog
from streamkeep.telemetry.prometheus import Sources
from streamkeep.telemetry.requests import RequestStats
from streamkeep.ui import UiFiles, exposure_warning

log = logging.getLogger("streamkeep")


def hypercorn_config(settings: SimpleNamespace) -> Config:
    server = settings.server
    config = Config()
    host = f"[{server.host}]" if ":" in server.host else server.host
    config.bind = [f"{host}:{server.port}"]
    config.backlog = server.backlog
    # hypercorn closes a keep-alive connection after 1,000 requests by default; a busy producer
    # or an HTTP/2 client multiplexing thousands of appends should not be cut off.
    config.keep_alive_max_requests = 1 << 62
    config.h2_max_concurrent_streams = server.h2_max_concurrent_streams
    config.graceful_timeout = server.shutdown_grace
    config.include_server_header = False
    config.accesslog = None
    if settings.tls.cert:
        config.certfile = settings.tls.cert
        config.keyfile = settings.tls.key
        config.alpn_protocols = ["h2", "http/1.1"]
    return config


def make_storage(settings: SimpleNamespace) -> MemoryStorage | DiskStorage:
    """The configured storage, not yet recovered (nothing read from disk yet)."""
    limits = settings.limits
    if settings.storage.mode == "memory":
        return MemoryStorage(max_stream_bytes=limits.max_stream_bytes, max_total_bytes=limits.max_total_bytes)
    options = settings.storage
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
    )


async def recover_storage(
    settings: SimpleNamespace, storage: MemoryStorage | DiskStorage, nursery: trio.Nursery
) -> Archiver | None:
    """Recovers disk storage (upgraded to the current format first if it was older) and starts its
    background work; returns its cold tier, if one is configured."""
    if not isinstance(storage, DiskStorage):
        return None
    root = storage.root
    cold = ColdConfig.from_settings(settings)
    store = await trio.to_thread.run_sync(S3Store, cold) if cold is not None else None
    if await trio.to_thread.run_sync(migrate.pending_version, files.OS, root):
        await trio.to_thread.run_sync(migrate.upgrade, files.OS, root, store, log.info)
    log.info("recovering streams from %s ...", root.resolve())
    report = await storage.start(nursery)
    log.info(
        "recovered %d streams (%d appends, %d bytes) in %.2f s; %d repaired, %d skipped",
        report.streams,
        report.records,
        report.bytes,
        report.seconds,
        len(report.repaired),
        len(report.skipped),
    )
    archiver = None
    if store is not None and cold is not None:
        archiver = Archiver(storage, store, cold)
        storage.cold = archiver
        nursery.start_soon(supervised, "cold tier", archiver.run, archiver.health)
    return archiver


def build_service(
    settings: SimpleNamespace, nursery: trio.Nursery, storage: MemoryStorage | DiskStorage
) -> Service:
    limits = settings.limits
    supervisor = Supervisor(
        storage,
        nursery,
        mailbox_size=settings.server.mailbox_size,
        hibernate_after=settings.server.hibernate_after,
    )
    options = ServiceOptions(
        long_poll_timeout=settings.server.long_poll_timeout,
        sse_close_after=settings.server.sse_close_after,
        read_chunk_bytes=limits.read_chunk_bytes,
        live_window_bytes=limits.live_window_bytes,
        send_stall_timeout=settings.server.send_stall_timeout,
        cors_origins=settings.http.cors_origins,
        # With auth on, a shared cache must not hand one client's read to another (PROTOCOL §12.2).
        cache_visibility="private" if auth_setup.enabled(settings) else settings.http.cache_visibility,
    )
    return Service(supervisor, options)


def tls_context(settings: SimpleNamespace) -> ssl.SSLContext | None:
    if not settings.tls.cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(settings.tls.cert, settings.tls.key)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # RFC 9113 requires TLS 1.2+ for HTTP/2
    context.set_alpn_protocols(["h2", "http/1.1"])
    return context


async def serve(settings: SimpleNamespace) -> None:
    opened: list[DiskStorage] = []
    try:
        await _serve(settings, opened)
    finally:
        for storage in opened:  # after every task ended: sync what fsync=interval/never left, close
            with trio.CancelScope(shield=True):
                await storage.stop()


async def _serve(settings: SimpleNamespace, opened: list[DiskStorage]) -> None:
    async with trio.open_nursery() as nursery:
        storage = make_storage(settings)
        service = build_service(settings, nursery, storage)
        service.nursery = nursery
        # The edge listens from the start, so probes can tell a long recovery (/healthz 200,
        # /readyz 503 "recovering") from a hung process; streams answer 503 until it is done.
        service.not_ready = "recovering streams from the data directory"
        data_dir = storage.root if isinstance(storage, DiskStorage) else None
        gate = auth_setup.build_gate(settings, data_dir)
        service.gate = gate
        if settings.ui.enabled:
            service.ui = UiFiles()
        if settings.cluster.member:
            members = [Member(member_id, address) for member_id, address in settings.cluster.members]
            service.placement = Placement.of(members, settings.cluster.epoch)
            service.member_id = settings.cluster.member
            service.cluster_secret = settings.cluster.secret
            service.stats_sources["cluster"] = service.cluster_stats
            if settings.cluster.secret:
                live = max(settings.server.long_poll_timeout, settings.server.sse_close_after)
                service.forwarder = Forwarder(settings.cluster.member, settings.cluster.secret, live + 30)
                service.peers = Peers(service.placement, settings.cluster.member, settings.cluster.secret)
                remote_forks = RemoteForks(service.peers, service.supervisor)
                storage.remote = remote_forks  # before recovery: it links forks to their sources
                remote_forks.register(service.peer_ops)
                service.stats_sources["cluster_forks"] = remote_forks.stats
            log.info(
                "cluster member %r of %d (placement epoch %d): serving %d of %d slots",
                service.member_id,
                len(members),
                settings.cluster.epoch,
                service.placement.slots_of(service.member_id),
                SLOTS,
            )
        access_log = None
        if settings.log.access_log:
            access_log = AccessLog(
                settings.log.access_log, json_lines=settings.log.format == "json", health=service.health
            )
            nursery.start_soon(access_log.run)
        if settings.metrics.enabled or access_log is not None:
            service.request_stats = RequestStats(access_log)
        else:
            service.request_stats = None
        sources = Sources(service=service, storage=storage, gate=gate)
        metrics_page = prometheus.page(sources) if settings.metrics.enabled else None
        if settings.metrics.port is None:
            service.metrics_page = metrics_page
        service.readiness = Readiness(
            data_dir=data_dir,
            min_free_bytes=settings.storage.min_free_bytes if data_dir is not None else 0,
            jwks_loaded=auth_setup.jwks_readiness(gate),
        )
        if gate is not None and gate.jwks is not None:
            nursery.start_soon(gate.jwks.run)
        shutdown = trio.Event()

        async def watch_signals() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("%s: ending live reads, finishing requests", signal.Signals(signum).name)
                    service.begin_shutdown()
                    shutdown.set()
                    return

        nursery.start_soon(watch_signals)
        budget = BodyBudget(settings.limits.max_inflight_body_bytes)
        limits = EdgeLimits(
            max_body_bytes=settings.limits.max_body_bytes,
            body_timeout=settings.limits.body_timeout,
            h2_max_concurrent_streams=settings.server.h2_max_concurrent_streams,
            budget=budget,
        )

        async def run_http(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
            if settings.server.edge == "lean":
                await serve_lean(
                    service,
                    host=settings.server.host,
                    port=settings.server.port,
                    backlog=settings.server.backlog,
                    limits=limits,
                    ssl_context=tls_context(settings),
                    shutdown_grace=settings.server.shutdown_grace,
                    shutdown=shutdown,
                    task_status=task_status,
                )
            else:
                hypercorn_fixes.apply()
                app = create_app(
                    service,
                    max_body_bytes=settings.limits.max_body_bytes,
                    body_timeout=settings.limits.body_timeout,
                    budget=budget,
                )
                config = hypercorn_config(settings)
                await hypercorn_serve(app, config, shutdown_trigger=shutdown.wait, task_status=task_status)
            # The edge returns once in-flight requests finished (or the grace period ran out).
            nursery.cancel_scope.cancel()

        binds = await nursery.start(run_http)
        if settings.metrics.port is not None and metrics_page is not None:
            metrics_binds = await nursery.start(
                partial(
                    serve_lean,
                    MetricsEndpoint(service, metrics_page),
                    host=settings.metrics.host,
                    port=settings.metrics.port,
                    backlog=64,
                    limits=limits,
                    ssl_context=None,
                    shutdown_grace=1.0,
                    shutdown=shutdown,
                )
            )
            for bind in metrics_binds:
                print(f"streamkeep metrics on {bind}/metrics", flush=True)

        if isinstance(storage, DiskStorage):
            opened.append(storage)
        archiver = await recover_storage(settings, storage, nursery)
        sources.archiver = archiver
        if isinstance(storage, DiskStorage):
            service.stats_sources["storage"] = storage.stats
        if archiver is not None:
            service.stats_sources["cold"] = archiver.stats
        if isinstance(storage, DiskStorage):
            service.compactor = Compactor(service.supervisor, nursery)
            service.stats_sources["compaction"] = service.compactor.stats
        registry_once_ready = None
        if settings.registry.enabled and service.placement is not None:
            # One registry for the cluster, on the member owning the name; the others relay to it.
            registry_once_ready = await cluster_registry.start(service, nursery)
        elif settings.registry.enabled:
            # Before streams are served: it lists what recovery found (a crash may have come
            # between a create or delete and its entry), or stops the server over a stream it
            # cannot adopt (RegistryConflict).
            registry = registry_keeper.RegistryKeeper(service.supervisor)
            service.supervisor.lifecycle = registry
            await registry.start()
            service.registry = registry
            service.stats_sources["registry"] = registry.stats
            nursery.start_soon(supervised, "registry", registry.run, registry.health)
        rules = [RetentionRule(**rule) for rule in settings.retention.rules]
        if service.registry is not None and isinstance(storage, DiskStorage):  # kept here
            rules.insert(0, registry_keeper.RETENTION_RULE)  # first: no user rule may drop its entries
        if isinstance(storage, DiskStorage) and rules:
            supervisor = service.supervisor
            retention = Retention(
                storage,
                rules,
                interval=settings.retention.interval,
                notify=lambda name: [listener(name) for listener in list(supervisor.listeners)],
                compact=service.compactor.start_due,
            )
            sources.retention = retention
            service.stats_sources["retention"] = retention.stats
            nursery.start_soon(supervised, "retention", retention.run, retention.health)
        nursery.start_soon(supervised, "TTL sweep", service.sweep_expired, service.health)
        if isinstance(storage.remote, RemoteForks):
            nursery.start_soon(supervised, "fork pin reconcile", storage.remote.run, storage.remote.health)
        state = data_dir
        # In a cluster with a secret, subscriptions follow every member's streams and every member
        # signs webhooks with the one key derived from the secret (streamkeep/cluster/subscriptions.py).
        peers = service.peers
        shared = None if peers is None else settings.cluster.secret
        keys = await trio.to_thread.run_sync(partial(Keys, None if state is None else state / "keys", cluster_secret=shared))
        view = None if peers is None else RemoteStreams(peers.placement, peers.member, storage)
        service.subscriptions = SubscriptionManager(
            service.supervisor,
            keys,
            state_dir=None if state is None else state / "subscriptions",
            allow_loopback_webhooks=settings.server.allow_loopback_webhooks,
            view=view,
        )
        if peers is not None and view is not None:
            service.subscriptions.attach(
                SubscriptionPeers(
                    service.subscriptions, view, peers, service.peer_ops, service.forwarder, settings.cluster.secret
                )
            )
        await nursery.start(service.subscriptions.run)
        sources.subscriptions = service.subscriptions
        service.stats_sources["subscriptions"] = service.subscriptions.stats
        if gate is not None:
            service.stats_sources["auth"] = gate.stats
        service.not_ready = None
        if registry_once_ready is not None:
            nursery.start_soon(registry_once_ready)  # a relay's repair: the keeper calls us back
        for bind in binds:
            # Tests and scripts read this line to find the port when started with --port 0; it
            # comes once streams are served.
            print(f"streamkeep listening on {bind}", flush=True)
        log.info(
            "edge: %s; storage: %s, fsync=%s; auth: %s; metrics: %s",
            settings.server.edge,
            settings.storage.mode,
            settings.storage.fsync,
            auth_setup.describe(gate),
            "off" if metrics_page is None else f"port {settings.metrics.port}" if settings.metrics.port else "/metrics",
        )
        if service.ui is not None:
            log.info("stream browser at %s/ui/", binds[0])
            warning = exposure_warning(settings.server.host, ui_on=True, auth_on=gate is not None)
            if warning is not None:
                log.warning("%s", warning)


def run(settings: SimpleNamespace) -> None:
    trio.run(serve, settings)
