"""`GET /metrics`: every part's numbers in Prometheus' text format, gathered at scrape time.

The hot path only bumps plain counters (telemetry.requests, telemetry.histogram and the parts' own
counts); this collector turns them into metric families when Prometheus asks, through
prometheus_client's exposition, so a scrape costs the server a few milliseconds and an append
nothing extra. Names follow Prometheus' conventions: a `streamkeep_` prefix, `_total` on counters,
base units (`_seconds`, `_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector

from streamkeep.telemetry.histogram import Histogram

PREFIX = "streamkeep_"


@dataclass
class Sources:
    """What the collector reads; the parts the server did not start stay None."""

    service: Any
    storage: Any
    archiver: Any = None
    subscriptions: Any = None
    gate: Any = None
    retention: Any = None
    replication: Any = None  # a replica's coordinator: describe() -> its /stats section


def _histogram(name: str, documentation: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(PREFIX + name, documentation, labels=labels)


def _add(family: HistogramMetricFamily, labels: list[str], histogram: Histogram) -> None:
    family.add_metric(labels, histogram.cumulative(), histogram.sum)


class StreamkeepCollector:
    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def describe(self) -> list[Metric]:
        return []  # collected fresh at every scrape; nothing to describe ahead of it

    def collect(self) -> Iterator[Metric]:
        yield from self._requests()
        yield from self._streams()
        yield from self._storage()
        yield from self._cold()
        yield from self._retention()
        yield from self._subscriptions()
        yield from self._auth()
        yield from self._background()
        yield from self._replication()

    # ---- replication -------------------------------------------------------------------

    def _replication(self) -> Iterator[Metric]:
        source = self.sources.replication
        if source is None:
            return
        stats = source.describe()
        labels = ["member", "replica"]
        values = [stats["member"], stats["replica"]]
        for name, documentation, value in (
            ("replication_epoch", "The member's ownership epoch this replica serves at", stats["epoch"]),
            ("replication_follower_in_sync", "1 while the follower's copy is in sync (appends wait for it)",
             int(stats["follower_in_sync"])),
            ("replication_alone_seconds", "How long the owner has acknowledged appends without an in-sync "
             "follower (alert on > 0)", stats["alone_seconds"]),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(PREFIX + name, documentation, labels=labels)
            gauge.add_metric(values, value)
            yield gauge
        for name, documentation, value in (
            ("replication_barriers", "Syncs sent to the follower", stats["barriers"]),
            ("replication_barrier_wait_seconds", "Time syncs waited for the follower", stats["barrier_wait_seconds"]),
            ("replication_promotions", "Times this replica was promoted to owner", stats["promotions"]),
        ):  # fmt: skip
            counter = CounterMetricFamily(PREFIX + name, documentation, labels=labels)
            counter.add_metric(values, value)
            yield counter

    # ---- requests ----------------------------------------------------------------------

    def _requests(self) -> Iterator[Metric]:
        service = self.sources.service
        stats = service.request_stats
        if stats is None:
            return
        requests = CounterMetricFamily(
            PREFIX + "http_requests",
            "Requests answered, by method, route kind, status and HTTP version",
            labels=["method", "route", "status", "http_version"],
        )
        for (method, route, status, version), count in stats.requests.items():
            requests.add_metric([method, route, str(status), version], count)
        yield requests
        latency = _histogram(
            "http_request_duration_seconds",
            "Time from a request's arrival at the service to its response's end (a live read's whole wait)",
            ["route", "http_version"],
        )
        for (route, version), histogram in stats.latency.items():
            _add(latency, [route, version], histogram)
        yield latency
        served = CounterMetricFamily(
            PREFIX + "http_response_bytes",
            "Response body bytes sent, by route kind (streaming responses counted when they end)",
            labels=["route"],
        )
        for route, sent in stats.bytes_out.items():
            served.add_metric([route], sent)
        yield served
        yield CounterMetricFamily(PREFIX + "appends", "Appends acknowledged", value=service.appends)
        yield CounterMetricFamily(
            PREFIX + "appended_bytes", "Bytes of acknowledged appends", value=service.appended_bytes
        )
        cluster = service.cluster
        if cluster is not None and cluster.forwarder is not None:
            yield CounterMetricFamily(
                PREFIX + "cluster_forwarded_requests",
                "Requests handed to the cluster member that owns their stream",
                value=cluster.forwarder.forwarded,
            )
        yield from self._cluster()

    def _cluster(self) -> Iterator[Metric]:
        """Calls between cluster members and the pins of forks across them (none when alone)."""
        cluster = self.sources.service.cluster
        if cluster is None or cluster.peers is None:
            return
        calls = CounterMetricFamily(
            PREFIX + "cluster_calls",
            "Calls between cluster members, by direction and outcome",
            labels=["direction", "outcome"],
        )
        calls.add_metric(["out", "answered"], cluster.peers.calls - cluster.peers.failures)
        calls.add_metric(["out", "failed"], cluster.peers.failures)
        calls.add_metric(["in", "answered"], cluster.peer_ops.calls)
        calls.add_metric(["in", "refused"], cluster.peer_ops.refused)
        yield calls
        remote = getattr(self.sources.storage, "remote", None)
        if remote is None:
            return
        stats = remote.stats()
        yield GaugeMetricFamily(
            PREFIX + "cluster_fork_pins",
            "Pins this member's streams hold for forks other members own",
            value=stats["pins"],
        )
        yield CounterMetricFamily(
            PREFIX + "cluster_fork_pins_dropped",
            "Pins dropped by the reconcile because their fork was gone",
            value=stats["pins_dropped"],
        )
        yield CounterMetricFamily(
            PREFIX + "cluster_inherited_reads",
            "Reads of a fork's inherited range from the member owning its source",
            value=stats["remote_reads"],
        )

    # ---- streams and live readers ----------------------------------------------------------

    def _streams(self) -> Iterator[Metric]:
        service = self.sources.service
        storage = self.sources.storage
        yield GaugeMetricFamily(PREFIX + "streams", "Streams that exist", value=len(storage.names()))
        yield GaugeMetricFamily(
            PREFIX + "actors_awake",
            "Stream actors in memory (the rest hibernate)",
            value=service.supervisor.active,
        )
        readers = GaugeMetricFamily(PREFIX + "live_readers", "Live readers now, by mode", labels=["mode"])
        for mode in ("long-poll", "sse"):
            readers.add_metric([mode], service.live.readers_by_mode.get(mode, 0))
        yield readers
        pushed = service.live.pushed()
        yield CounterMetricFamily(
            PREFIX + "live_push_deliveries",
            "Changes written straight to a waiting SSE subscriber's socket by live fan-out",
            value=pushed,
        )
        reads = CounterMetricFamily(
            PREFIX + "live_reads",
            "How live readers got their data: shared (one read for all), alone, cached (no read)",
            labels=["kind"],
        )
        for kind in ("shared", "alone", "cached"):
            reads.add_metric([kind], service.live.reads_by_kind.get(kind, 0))
        yield reads
        yield GaugeMetricFamily(
            PREFIX + "ready",
            "1 once recovery finished and streams are served",
            value=service.not_ready is None,
        )

    # ---- storage -------------------------------------------------------------------------

    def _storage(self) -> Iterator[Metric]:
        storage = self.sources.storage
        tiers = getattr(storage, "tier_bytes", None)
        stored = GaugeMetricFamily(
            PREFIX + "stored_bytes",
            "Bytes of segment files, by tier (hot: local disk, cold: bucket only)",
            labels=["tier"],
        )
        if callable(tiers):
            for tier, size in tiers().items():
                stored.add_metric([tier], size)
        else:  # memory storage: everything is hot
            stored.add_metric(["hot"], storage.budget.total_bytes)
        yield stored
        committer = getattr(storage, "committer", None)
        if committer is not None:
            fsync = _histogram(
                "commit_round_seconds",
                "Time one group-commit round took to write and sync its appends (the fsync latency)",
                [],
            )
            _add(fsync, [], committer.round_seconds)
            yield fsync
            records = _histogram("commit_round_records", "Appends that shared one group-commit round", [])
            _add(records, [], committer.round_records)
            yield records
            yield CounterMetricFamily(
                PREFIX + "commit_rounds_failed",
                "Commit rounds that failed as a whole",
                value=committer.failed_rounds,
            )
        free = getattr(storage, "fs", None)
        if free is not None:
            try:
                free_bytes = storage.fs.free_bytes(storage.root)
            except OSError:
                free_bytes = None
            if free_bytes is not None:
                yield GaugeMetricFamily(
                    PREFIX + "disk_free_bytes",
                    "Free bytes on the data directory's file system",
                    value=free_bytes,
                )
            yield GaugeMetricFamily(
                PREFIX + "disk_min_free_bytes", "The --min-free-bytes reserve", value=storage.min_free_bytes
            )

    def _cold(self) -> Iterator[Metric]:
        archiver = self.sources.archiver
        if archiver is None:
            return
        yield GaugeMetricFamily(
            PREFIX + "cold_backlog_bytes",
            "Sealed bytes waiting for upload to the cold tier",
            value=archiver.backlog_bytes,
        )
        yield CounterMetricFamily(
            PREFIX + "cold_uploads", "Segments uploaded to the cold tier", value=archiver.uploaded
        )
        failures = CounterMetricFamily(
            PREFIX + "cold_failures",
            "Failed cold-tier steps (each is retried with backoff), by step",
            labels=["step"],
        )
        for kind, count in archiver.health.failures.items():
            failures.add_metric([kind.removeprefix("cold tier ")], count)
        yield failures
        yield GaugeMetricFamily(
            PREFIX + "cold_streams_backing_off",
            "Streams whose cold-tier work waits for a retry",
            value=len(archiver.stats()["streams_backing_off"]),
        )

    def _retention(self) -> Iterator[Metric]:
        retention = self.sources.retention
        if retention is None:
            return
        yield CounterMetricFamily(
            PREFIX + "retention_floor_moves",
            "Times retention moved a stream's floor",
            value=retention.floors_raised,
        )
        yield CounterMetricFamily(
            PREFIX + "retention_dropped_segments",
            "Segments retention deleted",
            value=retention.segments_dropped,
        )
        yield CounterMetricFamily(
            PREFIX + "retention_dropped_bytes",
            "Stream bytes retention deleted",
            value=retention.bytes_dropped,
        )

    def _subscriptions(self) -> Iterator[Metric]:
        manager = self.sources.subscriptions
        if manager is None:
            return
        yield GaugeMetricFamily(PREFIX + "subscriptions", "Subscriptions that exist", value=len(manager.subs))
        deliveries = CounterMetricFamily(
            PREFIX + "subscription_deliveries",
            "Subscription wakes by outcome: delivered, failed (webhook not 2xx), retried, announced (pull-wake)",
            labels=["outcome"],
        )
        for outcome in ("delivered", "failed", "retried", "announced"):
            deliveries.add_metric([outcome], manager.delivery.counts.get(outcome, 0))
        yield deliveries
        yield CounterMetricFamily(
            PREFIX + "subscription_cursor_jumps",
            "Times a subscription's cursor fell below its stream's retention floor and jumped to it",
            value=manager.links.cursor_jumps,
        )
        yield CounterMetricFamily(
            PREFIX + "subscription_save_failures",
            "Subscription state saves that failed (answered 507/503)",
            value=manager.faults.save_failures,
        )

    def _auth(self) -> Iterator[Metric]:
        gate = self.sources.gate
        if gate is None:
            return
        refusals = CounterMetricFamily(
            PREFIX + "auth_refusals", "Requests refused by the auth gate, by reason", labels=["reason"]
        )
        for reason, count in gate.refusals.items():
            refusals.add_metric([reason], count)
        yield refusals
        cache = gate.verifier.cache_info()
        yield CounterMetricFamily(
            PREFIX + "auth_token_cache_hits",
            "Token checks answered from the verified-token cache",
            value=cache["hits"],
        )
        yield CounterMetricFamily(
            PREFIX + "auth_token_cache_misses",
            "Token checks that verified a signature",
            value=cache["misses"],
        )

    def _background(self) -> Iterator[Metric]:
        service = self.sources.service
        failures = CounterMetricFamily(
            PREFIX + "background_failures",
            "Failures of background work and storage, by kind (each logged once until it recovers)",
            labels=["kind"],
        )
        failing = GaugeMetricFamily(
            PREFIX + "background_failing", "1 while a kind of work is failing", labels=["kind"]
        )
        healths = [service.health]
        remote = getattr(self.sources.storage, "remote", None)  # the cluster's fork pin reconcile
        for part in (self.sources.storage, self.sources.archiver, self.sources.retention, remote):
            health = getattr(part, "health", None)
            if health is not None and health not in healths:
                healths.append(health)
        seen: set[str] = set()
        for health in healths:
            for kind, count in health.failures.items():
                if kind not in seen:
                    seen.add(kind)
                    failures.add_metric([kind], count)
                    failing.add_metric([kind], kind in health.failing)
        yield failures
        yield failing


class Exposition:
    """The registry and its text: our collector plus the process' CPU, memory and descriptors."""

    def __init__(self, sources: Sources) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StreamkeepCollector(sources))
        ProcessCollector(namespace="streamkeep", registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def page(sources: Sources) -> Callable[[], bytes]:
    return Exposition(sources).render
