"""Starts the server: storage (recovered, upgraded to the current format), the cold tier, the
service and its background work, then the HTTP edge: the lean edge by default (lean.py,
lean_h2.py: HTTP/1.1, h2c by prior knowledge, TLS with h2) or quart-trio on hypercorn's trio
worker (`--edge quart`). At shutdown, storage syncs what a relaxed fsync policy left."""

from __future__ import annotations

import logging
import signal
import ssl
from pathlib import Path
from types import SimpleNamespace

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from streamkeep.actors.supervisor import Supervisor
from streamkeep.background import supervised
from streamkeep.http import hypercorn_fixes
from streamkeep.http.app import create_app
from streamkeep.http.budget import BodyBudget
from streamkeep.http.edge import EdgeLimits
from streamkeep.http.lean import serve_lean
from streamkeep.service import Service, ServiceOptions
from streamkeep.storage import files, migrate
from streamkeep.storage.archiver import Archiver
from streamkeep.storage.base import ByteBudget
from streamkeep.storage.coldstore import ColdConfig, S3Store
from streamkeep.storage.disk import DiskStorage
from streamkeep.storage.memory import MemoryStorage
from streamkeep.subscriptions.manager import SubscriptionManager
from streamkeep.subscriptions.signing import Keys

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


async def open_storage(
    settings: SimpleNamespace, nursery: trio.Nursery
) -> tuple[MemoryStorage | DiskStorage, Archiver | None]:
    """The configured storage, recovered (and upgraded to the current format if it was older),
    with its background work started; and its cold tier, if one is configured."""
    limits = settings.limits
    if settings.storage.mode == "memory":
        return MemoryStorage(
            max_stream_bytes=limits.max_stream_bytes, max_total_bytes=limits.max_total_bytes
        ), None
    options = settings.storage
    root = Path(options.data_dir)
    cold = ColdConfig.from_settings(settings)
    store = await trio.to_thread.run_sync(S3Store, cold) if cold is not None else None
    if await trio.to_thread.run_sync(migrate.pending_version, files.OS, root):
        await trio.to_thread.run_sync(migrate.upgrade, files.OS, root, store, log.info)
    storage = DiskStorage(
        root,
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
    return storage, archiver


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
        cors_origin=settings.http.cors_origin,
        cache_visibility=settings.http.cache_visibility,
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
        storage, archiver = await open_storage(settings, nursery)
        if isinstance(storage, DiskStorage):
            opened.append(storage)
        service = build_service(settings, nursery, storage)
        service.nursery = nursery
        if isinstance(storage, DiskStorage):
            service.stats_sources["storage"] = storage.stats
        if archiver is not None:
            service.stats_sources["cold"] = archiver.stats
        nursery.start_soon(supervised, "TTL sweep", service.sweep_expired, service.health)
        state = Path(settings.storage.data_dir) if settings.storage.mode == "disk" else None
        keys = await trio.to_thread.run_sync(Keys, None if state is None else state / "keys")
        service.subscriptions = SubscriptionManager(
            service.supervisor,
            keys,
            state_dir=None if state is None else state / "subscriptions",
            allow_loopback_webhooks=settings.server.allow_loopback_webhooks,
        )
        await nursery.start(service.subscriptions.run)
        service.stats_sources["subscriptions"] = service.subscriptions.stats
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

        async def run_http(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
            if settings.server.edge == "lean":
                limits = EdgeLimits(
                    max_body_bytes=settings.limits.max_body_bytes,
                    body_timeout=settings.limits.body_timeout,
                    h2_max_concurrent_streams=settings.server.h2_max_concurrent_streams,
                    budget=budget,
                )
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
        for bind in binds:
            # Tests and scripts read this line to find the port when started with --port 0.
            print(f"streamkeep listening on {bind}", flush=True)
        log.info(
            "edge: %s; storage: %s, fsync=%s",
            settings.server.edge,
            settings.storage.mode,
            settings.storage.fsync,
        )


def run(settings: SimpleNamespace) -> None:
    trio.run(serve, settings)
