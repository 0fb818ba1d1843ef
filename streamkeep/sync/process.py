"""One `streamkeep sync` process: every mapping of sync.toml in one trio nursery, each restarted
after a failure from what it stored in Postgres, the listener for /metrics and /healthz, a progress
line per mapping in the log, and a clean stop on SIGTERM or Ctrl-C.

A failing mapping never ends the process: it logs once per cause, backs off, retries, and shows up
in /healthz and the metrics. Only `MappingStopped` (something a person must act on) stops it, and
then only that mapping."""

from __future__ import annotations

import logging
import random
import signal
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from streamkeep.client import Client, StreamError
from streamkeep.sync.config import PgToStream, StreamToPg, SyncConfig
from streamkeep.sync.listener import Pages, serve
from streamkeep.sync.stats import MappingStats, MappingStopped

log = logging.getLogger("streamkeep.sync")

Runner = Callable[[Any, Client, MappingStats], Awaitable[None]]
FIRST_BACKOFF = 0.2
MOST_BACKOFF = 10.0
PROGRESS_EVERY = 10.0  # seconds between a mapping's progress lines in the log


def direction(mapping: PgToStream | StreamToPg) -> str:
    return "pg_to_stream" if isinstance(mapping, PgToStream) else "stream_to_pg"


def default_runners() -> dict[str, Runner]:
    # Imported here: a config with only one direction does not load the other's code.
    from streamkeep.sync import sink, source

    return {"pg_to_stream": source.run, "stream_to_pg": sink.run}


def _stopped(error: BaseException) -> MappingStopped | None:
    if isinstance(error, MappingStopped):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = _stopped(inner)
            if found is not None:
                return found
    return None


def _expected(error: BaseException) -> bool:
    """A failure the bridge expects in life (a server or Postgres away, a fenced bridge): its one
    line says enough. Anything else gets its traceback once, as a bug would need."""
    if isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        return _expected(error.exceptions[0])
    if isinstance(error, OSError | StreamError):
        return True
    kind = type(error)
    if kind.__module__.startswith("streamkeep.sync."):
        return True
    import psycopg  # loaded already by any mapping that raised a psycopg error

    return isinstance(error, psycopg.OperationalError)


def _cause(error: BaseException) -> str:
    """A failure's cause for 'log once per cause': its type and the start of its message."""
    if isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        return _cause(error.exceptions[0])
    return f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"


async def keep_running(
    mapping: PgToStream | StreamToPg, runner: Runner, client: Client, stats: MappingStats
) -> None:
    backoff = FIRST_BACKOFF
    logged: set[str] = set()
    while True:
        batches_before = stats.batches
        try:
            await runner(mapping, client, stats)
            cause = "the mapping's task returned"  # it should run until cancelled
        except Exception as error:  # anything but cancellation: retried, never fatal
            stopped = _stopped(error)
            if stopped is not None:
                stats.state = "stopped"
                stats.stopped = str(stopped)
                log.error("sync %s stopped: %s", mapping.name, stopped)
                return
            cause = _cause(error)
            if cause not in logged:
                logged.add(cause)
                log.warning(
                    "sync %s: %s; retrying with backoff (logged once per cause; /healthz shows the last error)",
                    mapping.name,
                    cause,
                    exc_info=not _expected(error),
                )
        if stats.batches > batches_before:
            backoff = FIRST_BACKOFF  # it made progress: the trouble was new, start the backoff over
        stats.retries += 1
        stats.state = "retrying"
        stats.last_error = cause
        await trio.sleep(backoff * random.uniform(0.8, 1.2))
        backoff = min(backoff * 2, MOST_BACKOFF)


async def report_progress(stats: list[MappingStats]) -> None:
    """A line per mapping every PROGRESS_EVERY seconds while it moves, so a person watching the log
    sees rows go by (or sees that they do not)."""
    seen = {one.name: -1 for one in stats}
    while True:
        await trio.sleep(PROGRESS_EVERY)
        for one in stats:
            if one.rows != seen[one.name] or one.state != "streaming":
                log.info(
                    "sync %s (%s): %s, %d rows, position %s, lag %.2f s%s",
                    one.name,
                    one.direction,
                    one.state,
                    one.rows,
                    one.position or "-",
                    one.lag_seconds,
                    f", last error: {one.last_error}" if one.last_error else "",
                )
                seen[one.name] = one.rows


async def stop_on_signals(cancel_scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for number in signals:
            log.info("sync: %s received, stopping", signal.Signals(number).name)
            cancel_scope.cancel()
            return


async def run(
    config: SyncConfig,
    *,
    runners: Mapping[str, Runner] | None = None,
    task_status: trio.TaskStatus[list[MappingStats]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Runs until cancelled (or a signal); `task_status` gets each mapping's stats once started."""
    chosen = dict(runners) if runners is not None else default_runners()
    stats = [MappingStats(m.name, direction(m)) for m in config.mappings]
    async with (
        Client(config.server.url, token=config.server.token, http2=config.server.http2) as client,
        trio.open_nursery() as nursery,
    ):
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            nursery.start_soon(stop_on_signals, nursery.cancel_scope)
        if config.listener.port:  # 0: no listener
            await nursery.start(serve, Pages(stats), config.listener.host, config.listener.port)
        for mapping, one in zip(config.mappings, stats, strict=True):
            nursery.start_soon(keep_running, mapping, chosen[one.direction], client, one)
        nursery.start_soon(report_progress, stats)
        task_status.started(stats)
