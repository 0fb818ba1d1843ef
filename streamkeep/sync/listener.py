"""The sync process's own two pages: `/metrics` (Prometheus text) and `/healthz` (JSON, 503 while a
mapping is stopped). h11 speaks HTTP/1.1 (bytes in, events out); a scrape needs nothing more, and
the process stays free of the server's edge."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import h11
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from streamkeep.sync.stats import STATES, MappingStats

log = logging.getLogger("streamkeep.sync")
REQUEST_LIMIT = 16 << 10


class SyncCollector(Collector):
    def __init__(self, stats: Sequence[MappingStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterable[Metric]:
        labels = ["mapping", "direction"]
        rows = CounterMetricFamily(
            "streamkeep_sync_rows",
            "Rows appended to a stream, or messages applied to Postgres",
            labels=labels,
        )
        batches = CounterMetricFamily(
            "streamkeep_sync_batches", "Appends made, or Postgres transactions committed", labels=labels
        )
        retries = CounterMetricFamily(
            "streamkeep_sync_retries",
            "Transient failures retried (Postgres or streamkeep unreachable...)",
            labels=labels,
        )
        lag_bytes = GaugeMetricFamily(
            "streamkeep_sync_lag_bytes",
            "WAL not yet confirmed, or stream bytes not yet applied",
            labels=labels,
        )
        lag_seconds = GaugeMetricFamily(
            "streamkeep_sync_lag_seconds",
            "Commit-to-append, or append-to-apply, of the last batch",
            labels=labels,
        )
        state = GaugeMetricFamily(
            "streamkeep_sync_state", "1 for the state each mapping is in", labels=[*labels, "state"]
        )
        for one in self.stats:
            values = [one.name, one.direction]
            rows.add_metric(values, one.rows)
            batches.add_metric(values, one.batches)
            retries.add_metric(values, one.retries)
            lag_bytes.add_metric(values, one.lag_bytes)
            lag_seconds.add_metric(values, one.lag_seconds)
            for name in STATES:
                state.add_metric([*values, name], 1.0 if one.state == name else 0.0)
        return [rows, batches, retries, lag_bytes, lag_seconds, state]


def health(stats: Sequence[MappingStats]) -> tuple[int, dict[str, Any]]:
    """200 while every mapping runs (retrying counts as running: it heals itself), 503 when one
    stopped for a person to act on, with why."""
    mappings = {
        one.name: {
            "direction": one.direction,
            "state": one.state,
            "rows": one.rows,
            "position": one.position,
            "lag_seconds": round(one.lag_seconds, 3),
            "last_error": one.last_error,
            "stopped": one.stopped,
            "seconds_since_progress": round(time.time() - one.updated_at, 1),
        }
        for one in stats
    }
    ok = all(one.state != "stopped" for one in stats)
    return (200 if ok else 503), {"ok": ok, "mappings": mappings}


class Pages:
    def __init__(self, stats: Sequence[MappingStats]) -> None:
        self.stats = stats
        self.registry = CollectorRegistry()
        self.registry.register(SyncCollector(stats))

    def answer(self, method: str, target: str) -> tuple[int, str, bytes]:
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return (
                405,
                "application/json",
                json.dumps({"error": "only GET and HEAD are served here"}).encode(),
            )
        if path == "/metrics":
            return 200, "text/plain; version=0.0.4; charset=utf-8", generate_latest(self.registry)
        if path == "/healthz":
            status, body = health(self.stats)
            return status, "application/json", json.dumps(body).encode()
        return (
            404,
            "application/json",
            json.dumps({"error": f"no page {path}; try /metrics or /healthz"}).encode(),
        )

    async def serve_connection(self, stream: trio.SocketStream) -> None:
        connection = h11.Connection(h11.SERVER, max_incomplete_event_size=REQUEST_LIMIT)
        try:
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    with trio.move_on_after(30):
                        data = await stream.receive_some(REQUEST_LIMIT)
                        connection.receive_data(data)
                        continue
                    return  # an idle connection is closed
                if isinstance(event, h11.Request):
                    status, content_type, body = self.answer(event.method.decode(), event.target.decode())
                    headers = [("content-type", content_type), ("content-length", str(len(body)))]
                    await stream.send_all(
                        connection.send(h11.Response(status_code=status, headers=headers)) or b""
                    )
                    if event.method != b"HEAD":
                        await stream.send_all(connection.send(h11.Data(data=body)) or b"")
                    await stream.send_all(connection.send(h11.EndOfMessage()) or b"")
                elif isinstance(event, h11.ConnectionClosed):
                    return
                if connection.our_state is h11.DONE and connection.their_state is h11.DONE:
                    connection.start_next_cycle()
                elif connection.our_state is h11.MUST_CLOSE or connection.their_state is h11.MUST_CLOSE:
                    return
        except (h11.RemoteProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            await trio.aclose_forcefully(stream)


async def serve(
    pages: Pages, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    log.info("sync: /metrics and /healthz on http://%s:%d", host, bound)
    task_status.started(bound)
    await trio.serve_listeners(pages.serve_connection, listeners)
