"""The HTTP edges' start-up: the lean edge by default (accept.py, h1_connection.py, h2_connection.py:
HTTP/1.1, h2c by prior knowledge, TLS with h2) or quart-trio on hypercorn's trio worker
(`--edge quart`), and the metrics port when it has one of its own."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from streamkeep.http import hypercorn_fixes
from streamkeep.http.accept import serve_lean
from streamkeep.http.budget import BodyBudget
from streamkeep.http.edge import EdgeLimits
from streamkeep.http.metrics_port import MetricsEndpoint
from streamkeep.http.quart_app import create_app
from streamkeep.server.service import Service


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


def tls_context(settings: SimpleNamespace) -> ssl.SSLContext | None:
    if not settings.tls.cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(settings.tls.cert, settings.tls.key)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # RFC 9113 requires TLS 1.2+ for HTTP/2
    context.set_alpn_protocols(["h2", "http/1.1"])
    return context


async def listen(
    settings: SimpleNamespace,
    service: Service,
    metrics_page: Callable[[], bytes] | None,
    nursery: trio.Nursery,
    shutdown: trio.Event,
) -> list[str]:
    """Starts the edge (and the metrics port, if `metrics_page` is served on one) in `nursery`;
    returns the addresses it listens on. When the edge ends (after `shutdown`, once in-flight
    requests finished or the grace period ran out) it cancels `nursery`."""
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
        nursery.cancel_scope.cancel()

    binds: list[str] = await nursery.start(run_http)
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
    return binds


__all__ = ["hypercorn_config", "listen", "tls_context"]
