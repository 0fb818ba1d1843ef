"""Keeps `__registry__` listing exactly the live streams (entries.py has what it holds).

The stream actors tell the keeper of every create and delete (including a TTL expiry, a
soft-delete and the delete of a fork) once it happened in storage, and await it: the entry is
appended to the registry through the registry's own actor before the PUT or DELETE is answered.
Appends of concurrent creates share a commit round like any appends; a lock only orders deciding
and submitting, so entries of one name land in the order their changes happened.

Two things can leave the registry and the streams apart: a crash after a change and before its
entry (or before an entry's sync, under a relaxed fsync policy), and an entry whose write failed
(a full disk). Both are healed by `reconcile`, which folds the registry as it is on disk, compares
it with the streams storage holds, and appends the difference: at every start, before any stream
is served, and in the background after a failed write. A create or delete is never failed
because of its entry: it happened, and the repair catches up.

The registry is a State Protocol stream, so it is bounded like one: `RETENTION_RULE` compacts it
(a snapshot of the live set, then the floor moves there and the segments below go).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from streamkeep.actors.folding import fold_range
from streamkeep.actors.messages import Append, Create
from streamkeep.actors.replies import PendingAppend
from streamkeep.actors.supervisor import Supervisor
from streamkeep.health import Health
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.state_fold import StateFold
from streamkeep.protocol.stream import AppendSpec, CreateSpec, StreamMeta
from streamkeep.registry import entries
from streamkeep.registry.entries import CONTENT_TYPE, NAME
from streamkeep.storage import forks
from streamkeep.storage.base import Storage, StreamLog
from streamkeep.storage.disk.directory import FormatError
from streamkeep.storage.disk.retention import RetentionRule

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 20
# Compacted once the history since its last snapshot is 4x the snapshot and at least 256 KiB
# (~2,000 creates and deletes): a snapshot re-sends every entry to live readers, so not much more
# often; the floor then moves to the snapshot and retention drops what is below it.
RETENTION_RULE = RetentionRule(NAME, compact="state", compact_ratio=4.0, compact_min_bytes=256 << 10)


# At most this many entries in one append: a turn never builds an append of unbounded size.
MAX_BATCH = 256


@dataclass(eq=False)
class _Change:
    """One entry to append (`entry` None: a delete), and what its turn decided."""

    name: str
    entry: dict[str, Any] | None
    still_due: Callable[[], None] | None
    decided: bool = False
    pending: PendingAppend | None = None  # submitted: its commit to wait for
    error: BaseException | None = None


class RegistryConflict(FormatError):
    """The data directory holds a stream named `__registry__` that cannot be the registry. A
    FormatError: like a data directory this version cannot open, the server stops at start and
    says why (cli.py prints it)."""


class RegistryKeeper:
    def __init__(self, supervisor: Supervisor, *, clock: Callable[[], float] = time.time) -> None:
        self.supervisor = supervisor
        self.storage = supervisor.storage
        self.clock = clock
        # What the registry lists, by name: what reconcile folded, plus the entries appended since;
        # each entry as `entries.summary` keeps it (one per stream: kept small).
        self.listed: dict[str, object] = {}
        self.health = Health()
        self._lock = trio.Lock()  # held by a turn (`_turn`): deciding and submitting, or a reconcile
        self._turn_ended: trio.Event | None = None  # made when a change waits for a turn to end
        self._queued: list[_Change] = []  # changes waiting for a turn of the lock (`_record`)
        self._repair = trio.Event()
        self.inserts = 0
        self.deletes = 0
        self.repairs = 0  # reconciliations that appended something
        self.appends_made = 0  # appends made to the registry: inserts + deletes over this is the sharing

    # ---- start and repair ------------------------------------------------------------

    async def start(self) -> None:
        """Before streams are served: creates the registry, or adopts a stream already so named,
        and makes it list what storage holds. Raises RegistryConflict for a stream that cannot be
        adopted; any other failure is left to the background repair."""
        existing = self.storage.open(NAME)
        if existing is not None:
            reason = entries.unadoptable(existing.meta)
            if reason is not None:
                raise _conflict(reason)
        try:
            if self.storage.unread():
                # Serving before every stream is read: what the registry lists now is checked and
                # taken as the start; the difference from the live streams is appended once all
                # are read (`run`).
                await self._reconcile(self._listed_now)
                self._repair.set()
            else:
                await self.reconcile()
        except RegistryConflict:
            raise
        except Exception as error:  # a failing disk: serve anyway, the repair retries
            self._failed(error)

    async def run(self) -> None:
        """Reconciles again after a failed entry; under `supervised`, which backs off if it fails."""
        while True:
            await self._repair.wait()
            self._repair = trio.Event()
            try:
                await self.reconcile()
            except BaseException:
                self._repair.set()  # still owed: the restarted loop tries again
                raise
            self.health.ok("registry")

    async def reconcile(self) -> None:
        """Appends what makes the registry list exactly the live streams in storage (once every
        stream is read: waiting inside `_reconcile` would hold the lock every create needs)."""
        await self.storage.recovered()
        await self._reconcile(self._wanted)

    async def _wanted(self, listed: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """What the registry should list, given what it lists now (a cluster's keeper asks the
        other members for their part: streamkeep/cluster/registry.py)."""
        return self._live()

    @staticmethod
    async def _listed_now(listed: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return listed

    async def _reconcile(
        self, wanted: Callable[[dict[str, Any]], Awaitable[dict[str, dict[str, Any]]]]
    ) -> None:
        async with self._lock:  # no entry is decided meanwhile: none can slip between fold and diff
            try:
                await self._reconcile_locked(wanted)
            finally:
                self._end_turn()

    async def _reconcile_locked(
        self, wanted: Callable[[dict[str, Any]], Awaitable[dict[str, dict[str, Any]]]]
    ) -> None:
        stream_log = await self._open()
        await stream_log.latest_commit().settled()  # entries in flight are on disk, or failed
        fold = StateFold()
        try:
            floor = forks.readable_from(self.storage, stream_log)
            await fold_range(self.storage, stream_log, fold, floor, stream_log.published_tail, READ_CHUNK)
        except ProtocolError as error:
            if error.code == "not_state_message":  # only an adopted stream can hold one
                raise _conflict(
                    f"it holds a message that is not a State Protocol one ({error.message})"
                ) from None
            raise
        listed = entries.listed(fold)
        live = await wanted(listed)
        messages = entries.changes(listed, live)
        if messages:
            pending = await self._submit(messages)
            await pending.wait()
            self.repairs += 1
            log.info(
                "registry: %d entries appended to list the %d live streams",
                len(messages),
                len(live),
            )
        self.listed = entries.summaries(live)  # what it lists now, the difference appended

    # ---- told by the stream actors ------------------------------------------------------

    async def created(self, meta: StreamMeta) -> None:
        if meta.name != NAME:  # the registry does not list itself (and its creation holds the lock)
            await self._change(meta.name, entries.value(meta))

    async def deleted(self, name: str) -> None:
        if name != NAME:
            await self._change(name, None)

    def unsure(self) -> None:
        """A create or delete failed in a way that may have happened: reconcile to find out."""
        self._repair.set()

    async def _change(self, name: str, entry: dict[str, Any] | None) -> None:
        """Appends an insert (`entry`) or a delete (None) of `name`. Never raises: the stream's own
        change happened, and a failed entry is repaired later."""
        try:
            await self._record(name, entry)
        except Exception as error:
            self._failed(error)
        else:
            self.health.ok("registry")

    async def _record(
        self, name: str, entry: dict[str, Any] | None, still_due: Callable[[], None] | None = None
    ) -> None:
        """Appends the entry unless the registry already says so (a reconcile may have got there
        first; a soft-deleted stream is deleted twice); raises what failed. `still_due` runs once
        the entry's turn has come and may refuse it by raising (a member's change that waited too
        long, streamkeep/cluster/registry.py).

        The entries queued while the lock was held go in one append, in the order they came: an
        append per entry cost each create ~0.5 ms of CPU (an actor call, a plan, a record and a
        publish each; issue 26, docs/benchmarks.md), one append per turn a share of that."""
        change = _Change(name, entry, still_due)
        self._queued.append(change)
        try:
            while not change.decided:
                if self._lock.locked():
                    # A turn is on: it or the next one takes this change. Waiting for the turn to
                    # end, not for the lock, wakes all its changes at once; the lock went from
                    # each to the next in turn, a task switch and a release each (issue 26).
                    if self._turn_ended is None:
                        self._turn_ended = trio.Event()
                    await self._turn_ended.wait()
                    continue
                async with self._lock:  # its checkpoint lets the creates running now queue too
                    try:
                        if not change.decided:  # no earlier turn took it: this turn takes all queued
                            await self._submit_queued()
                    finally:
                        self._end_turn()
        except BaseException:
            if not change.decided and change in self._queued:  # cancelled while waiting: never submitted
                self._queued.remove(change)
            raise
        if change.error is not None:
            raise change.error
        pending = change.pending
        if pending is not None:
            if pending.commit.done:  # memory storage: this task already waited for its turn
                pending.result()
            else:
                await pending.wait()  # outside the lock: entries of later turns share a sync

    def _end_turn(self) -> None:
        """Called by whoever holds the lock as it lets go: the changes waiting for a turn go on."""
        ended, self._turn_ended = self._turn_ended, None
        if ended is not None:
            ended.set()

    async def _submit_queued(self) -> None:
        """Under the lock: decides each queued change against what is listed (and the changes
        before it in the queue), and appends those still due as one append."""
        batch, self._queued = self._queued[:MAX_BATCH], self._queued[MAX_BATCH:]
        due: list[tuple[_Change, object]] = []  # each with what is listed once it lands
        after: dict[str, object] = {}  # what is listed once the earlier changes land (summaries)
        messages = []
        for change in batch:
            change.decided = True
            # One change that cannot be written (refused as too late, an entry that does not
            # encode) fails only itself: the rest of the batch is taken from the queue with it,
            # and a change left undecided there would wait for a turn that never takes it.
            try:
                if change.still_due is not None:
                    change.still_due()
                now = after[change.name] if change.name in after else self.listed.get(change.name)
                if change.entry is None:
                    remembered = None
                    message = entries.delete(change.name) if now is not None else None
                else:
                    remembered = entries.summary(change.name, change.entry)
                    message = entries.insert(change.name, change.entry) if now != remembered else None
                if message is None:  # the registry already says so
                    continue
            except Exception as error:
                change.error = error
                continue
            after[change.name] = remembered
            messages.append(message)
            due.append((change, remembered))
        if not messages:
            return
        try:
            pending = await self._submit(messages)
        except BaseException as error:  # each change's caller sees it fail (and a repair is due)
            failed = (
                error
                if isinstance(error, Exception)
                else ProtocolError(503, "registry_unavailable", "the registry entry was interrupted")
            )
            for change, _ in due:
                change.error = failed
            raise
        for change, remembered in due:
            change.pending = pending
            if remembered is None:
                self.listed.pop(change.name, None)
                self.deletes += 1
            else:
                self.listed[change.name] = remembered
                self.inserts += 1

    # ---- helpers --------------------------------------------------------------------------

    async def _open(self) -> StreamLog:
        stream_log = self.storage.open(NAME)
        if stream_log is None:
            spec = CreateSpec(CONTENT_TYPE, None, None, False, [])
            await self.supervisor.call(NAME, Create(spec), must_exist=False)
            stream_log = self.storage.open(NAME)
            if stream_log is None:
                raise ProtocolError(503, "registry_unavailable", f"{NAME} could not be created")
        return stream_log

    async def _submit(self, messages: list[bytes]) -> PendingAppend:
        """Sequences one append of `messages` in the registry's actor; its commit is the caller's
        to wait for."""
        body = b"[" + b",".join(messages) + b"]"
        self.appends_made += 1
        spec = AppendSpec(CONTENT_TYPE, body, False, None, None, messages)  # encoded here: not parsed again
        return await self.supervisor.call(NAME, Append(spec))

    def _live(self) -> dict[str, dict[str, Any]]:
        return live_streams(self.storage, self.clock())

    def _failed(self, error: Exception) -> None:
        message = error.message if isinstance(error, ProtocolError) else repr(error)
        bug = None if isinstance(error, ProtocolError) else error
        self.health.failed("registry", f"{message}; it will be reconciled", traceback=bug)
        self._repair.set()

    def stats(self) -> dict:
        return {
            "streams_listed": len(self.listed),
            "inserts": self.inserts,
            "deletes": self.deletes,
            "appends": self.appends_made,
            "repairs": self.repairs,
            **self.health.stats(),
        }


def live_streams(storage: Storage, now: float) -> dict[str, dict[str, Any]]:
    """The entries of the streams clients can use now: not soft-deleted, not past their TTL or
    expiry (the sweep is about to delete those, and their entry would only go then)."""
    live = {}
    for name in storage.names():
        stream_log = storage.open(name)
        if name == NAME or stream_log is None or getattr(stream_log, "deleted", False):
            continue
        meta = stream_log.meta
        if not meta.soft_deleted and not meta.expired(now):
            live[name] = entries.value(meta)
    return live


def _conflict(reason: str) -> RegistryConflict:
    return RegistryConflict(
        f"the data directory holds a stream named {NAME!r} that cannot serve as the stream registry: "
        f"{reason}. Start once with --no-registry (the name is then an ordinary stream), copy what you "
        f"need from it and DELETE /v1/stream/{NAME}; or keep it and run with --no-registry"
    )
