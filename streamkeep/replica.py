"""One replica of a cluster member (`serve --replicas 2`): follows until it owns, then serves.

A member's streams live on two replicas on two machines. The one etcd names as owner serves them
(the whole server, built by `assemble` as usual) with its disk storage writing through the mirror
(replication/mirror.py), and accepts its follower's connection; the other keeps a copy by applying
the owner's channel (replication/follower.py) and does not listen for HTTP, so the front door's
health checks send the member's requests to the owner only. The rules of who owns are in
replication/roles.py; this module runs them:

- follower: connect to the owner, empty the directory, apply the channel. When etcd says the copy
  is in sync, write the marker. When the owner's lease is gone and the copy is in sync, promote
  (one transaction), stop applying, and serve the copy.
- owner: serve; mark the follower in sync once its copy is durable, alone when its channel breaks.
  Fencing: when this process loses its lease, or etcd shows another owner or epoch, or a mark
  finds itself deposed, it exits at once (status 75) without answering anything more; started
  again (the supervisor does), it finds it is not the owner and rejoins as the follower, emptying
  its directory first, so whatever it wrote that was never acknowledged is gone.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import math
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import trio

from streamkeep import collector
from streamkeep.assemble import Injected, serve
from streamkeep.background import Backoff
from streamkeep.coordination.etcd import Etcd, EtcdError
from streamkeep.replication import follower, wire
from streamkeep.replication.mirror import HEARTBEAT, LOCK, MARKER, Link, MirrorFileSystem
from streamkeep.replication.roles import Coordinator, Deposed, Record, marker_for, read_marker, write_marker
from streamkeep.storage import files

log = logging.getLogger(__name__)

FENCED_EXIT = 75
# Renewals are cut short after this long (then the next endpoint is tried), and an owner stops this
# long before etcd could expire its lease at the earliest.
LEASE_CALL_TIMEOUT = 1.5
LEASE_MARGIN = 0.5
USER_TIMEOUT_MS = 10_000  # unacknowledged data on a replication socket for this long breaks it  # EX_TEMPFAIL: started again, the process rejoins as a follower
POLL = 0.25


def fence(reason: str) -> None:
    """Stops this process now: nothing more may be acknowledged as the owner."""
    log.error("fenced: %s; exiting so that this replica rejoins as the follower", reason)
    sys.stderr.flush()
    os._exit(FENCED_EXIT)


def proof(secret: str, *fields: str) -> str:
    return hmac.new(secret.encode(), "\0".join(fields).encode(), hashlib.sha256).hexdigest()


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


@dataclass
class ReplicaStats:
    role: str = "starting"
    epoch: int = 0
    follower_in_sync: bool = False
    alone_since: float | None = None
    links: int = 0
    copy: dict[str, Any] = field(default_factory=dict)


class Replica:
    def __init__(self, settings: SimpleNamespace, etcd: Etcd, make_etcd: Callable[..., Etcd]) -> None:
        self.settings = settings
        options = settings.replication
        self.data_dir = Path(settings.storage.data_dir)
        self.member = settings.cluster.member
        self.secret = settings.cluster.secret
        self.replication_address = options.listen
        self.coordinator = self._coordinator(etcd)
        self.make_etcd = make_etcd
        self.stats = ReplicaStats()
        self.mirror: MirrorFileSystem | None = None
        self._owning: Record | None = None
        self._backoff = Backoff(0.2, 5.0)  # between follower sessions that did not get in sync
        self._session_failed = False
        self._events: trio.MemorySendChannel[tuple[str, Link]] | None = None

    def _coordinator(self, etcd: Etcd) -> Coordinator:
        options = self.settings.replication
        return Coordinator(
            etcd,
            prefix=options.etcd_prefix,
            member=self.member,
            replica=options.replica,
            http_address=f"{self.settings.server.host}:{self.settings.server.port}",
            replication_address=self.replication_address,
            lease_ttl=options.lease_ttl,
        )

    # ---- the process ---------------------------------------------------------------------------

    async def run(self) -> None:
        self._lock_directory()
        coordinator = self.coordinator
        await coordinator.register(self._copy_held())
        async with trio.open_nursery() as nursery:
            # The lease is renewed on a thread and event loop of its own: a busy or blocked loop
            # here (a promotion building the whole server, a long recovery) must not let it lapse.
            threading.Thread(
                target=trio.run, args=(self._lease_thread,), name="etcd-lease", daemon=True
            ).start()
            record = await self._follow_until_owner()
            await self._own(record, nursery)  # returns when the server stopped (SIGTERM)
            nursery.cancel_scope.cancel()
        # A planned stop: the follower need not wait out the lease to take over.
        self.stats.role = "stopping"  # the lease thread must not take the revoke for a fence
        with trio.move_on_after(2) as scope:
            scope.shield = True
            try:
                await coordinator.etcd.revoke(coordinator.lease)
            except EtcdError as error:
                log.warning("could not give up this replica's etcd lease: %s", error)

    def _copy_held(self) -> str:
        """The session of the complete copy of this member the directory holds ("" for none)."""
        marker = read_marker(self.data_dir)
        if marker is None or marker.get("member") != self.member:
            return ""
        return str(marker.get("session", ""))

    async def _announce(self, copy: str) -> bool:
        """Tells etcd which copy this replica holds: an owner hands over only to a follower that
        holds the copy recorded in sync (not one that runs again on an empty disk). False if
        etcd could not be told: a copy is emptied only once its key no longer names it."""
        try:
            await self.coordinator.announce(copy)
        except EtcdError as error:
            log.warning("member %s: cannot tell etcd which copy it holds: %s", self.member, error)
            return False
        return True

    def _lock_directory(self) -> None:
        """One process per replica directory: a second (an orphan of a killed supervisor, a
        replacement started by hand) would serve or follow at the same epoch as the first."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.data_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SystemExit(
                f"streamkeep: {self.data_dir} is in use by another process (replica.lock); stop it first"
            ) from None
        self._lock_fd = fd  # held until the process exits

    async def _lease_thread(self) -> None:
        async with self.make_etcd(timeout=LEASE_CALL_TIMEOUT) as etcd:
            keeper = self._coordinator(etcd)
            keeper.lease = self.coordinator.lease
            keeper.valid_until = trio.current_time() + keeper.lease_ttl - LEASE_MARGIN
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._lease_deadline, keeper)
                while True:
                    await keeper.keep_lease()  # returns when etcd says the lease is gone
                    if self.stats.role == "owner":
                        fence("this replica's etcd lease expired: the follower may be promoted")
                    # A follower takes a new one: promotion is decided by the record, not the lease.
                    while True:
                        try:
                            await keeper.register(self._copy_held())
                            self.coordinator.lease = keeper.lease  # what a planned stop revokes
                            break
                        except EtcdError as error:
                            log.warning("cannot renew this replica's etcd registration: %s", error)
                            await trio.sleep(1)

    async def _lease_deadline(self, keeper: Coordinator) -> None:
        """An owner answers nothing once etcd may have let its lease expire (the follower may be
        promoted from then on): classic lease fencing, on this process's own clock, with a margin.
        Stale reads from a cut-off owner stop before the new owner can serve."""
        while True:
            await trio.sleep(0.1)
            if self.stats.role == "owner" and trio.current_time() > keeper.valid_until - LEASE_MARGIN:
                fence("this replica's etcd lease was not renewed in time (etcd out of reach)")

    # ---- follower ------------------------------------------------------------------------------

    async def _follow_until_owner(self) -> Record:
        coordinator = self.coordinator
        said: set[str] = set()

        def once(key: str, message: str, *args: object) -> None:
            if key not in said:
                said.add(key)
                log.warning(message, *args)

        while True:
            marker = read_marker(self.data_dir)
            try:
                # A new record (epoch 1, replica a owning) only where no failover can have happened:
                # a copy marked at a later epoch, or a follower's, must not be served from scratch.
                fresh = marker is None or (int(marker.get("epoch", 0)) <= 1 and not marker.get("session"))
                record = await coordinator.record(create=fresh)
                if record is None:
                    once(
                        "no-record",
                        "member %s: etcd has no record of it, but %s holds a copy after a failover (%s): etcd's "
                        "state was lost or another --etcd/--etcd-prefix is given. Not creating a new "
                        "record, which could serve an older copy over a newer one: point this replica "
                        "at the cluster's etcd, or remove %s from the directory that is to be served",
                        self.member,
                        self.data_dir,
                        marker,
                        MARKER,
                    )
                    await trio.sleep(1)
                    continue
                await self._step(record, marker, once)
            except EtcdError as error:  # a hiccup longer than a call: try again, do not restart
                once(f"etcd-{type(error).__name__}", "member %s: etcd: %s; trying again", self.member, error)
                await trio.sleep(POLL)
                continue
            if self._owning is not None:
                return self._owning

    async def _step(self, record: Record, marker: dict[str, Any] | None, once: Callable[..., None]) -> None:
        """One turn of following: sets `_owning` when this replica may serve."""
        coordinator = self.coordinator
        if record.owner == coordinator.replica:
            # A new process of the owner (restarted after a crash, or on an empty disk) while the
            # follower is in sync and running: the follower takes over at once, warm (its copy is
            # in its page cache, its process up), instead of this process recovering cold or the
            # follower waiting out the old process's lease.
            # Only to a follower whose process runs (not a dead one's key, which outlives it up to
            # a lease) and holds the copy recorded in sync (not one back on an empty disk).
            follower = await coordinator.alive(record.follower) if record.in_sync else None
            if (
                follower is not None
                and follower.get("copy") == record.session
                and await coordinator.renewing(record.follower)
            ):
                await coordinator.hand_over(record)
                return
            if marker is not None and marker.get("member") == self.member:
                self._owning = record
                return
            if not record.served:
                # The member's first owner: a new directory, or one from before replication.
                write_marker(self.data_dir, marker_for(self.member, record.epoch))
                self._owning = record
                return
            once(
                "no-copy",
                "member %s: etcd names this replica the owner, but %s holds no copy of it and "
                "%s has no in-sync copy; restore it with `streamkeep restore --from-bucket` "
                "(docs/scaling.md) or bring %s back",
                self.member,
                self.data_dir,
                record.follower,
                record.follower,
            )
            await trio.sleep(1)
            return
        owner = await coordinator.alive(record.owner)
        if owner is None:
            if self._may_promote(record, marker):
                await coordinator.promote(record)
            else:
                once(
                    f"stale-{record.epoch}",
                    "member %s: owner %s is down and this replica's copy is not in sync; "
                    "waiting for %s to come back",
                    self.member,
                    record.owner,
                    record.owner,
                )
                await trio.sleep(POLL)
            return
        await self._follow(record, owner["replication"])
        if self._session_failed:
            await self._back_off(record)

    async def _back_off(self, record: Record) -> None:
        """Waits before the next session, but no longer than until etcd's record moves on: an
        owner restarted after a crash hands the member over (or its lease expires) while we wait,
        and every second of waiting past that is a second the member serves nothing."""
        with trio.move_on_after(self._backoff.failed()):
            while True:
                await trio.sleep(POLL)
                try:
                    now = await self.coordinator.record(create=False)
                    if now is None or (now.owner, now.epoch) != (record.owner, record.epoch):
                        return
                    if await self.coordinator.alive(record.owner) is None:
                        return  # its lease expired: this replica may be promoted now
                except EtcdError:
                    continue

    def _may_promote(self, record: Record, marker: dict[str, Any] | None) -> bool:
        return (
            record.in_sync
            and record.follower == self.coordinator.replica
            and marker is not None
            and marker.get("member") == self.member
            and bool(record.session)
            and marker.get("session") == record.session
        )

    async def _follow(self, record: Record, address: str) -> None:
        """One session of following `record.owner`: returns when it ends (the owner went away or
        dropped us, or etcd says this replica should own)."""
        coordinator = self.coordinator
        session = secrets.token_hex(8)
        self.stats.role = "follower"
        self.stats.epoch = record.epoch
        self._session_failed = True
        try:
            sock = await trio.to_thread.run_sync(self._connect, address, session, record.epoch)
        except (OSError, wire.ProtocolError) as error:
            log.info("member %s: cannot follow %s at %s yet: %s", self.member, record.owner, address, error)
            return
        try:
            # Our copy may still be recorded in sync under an earlier session (the owner has not yet
            # seen that session end): emptying it now would leave etcd naming a copy that is gone.
            # The owner records the old one as over as soon as this session replaced it.
            with trio.move_on_after(10):
                while True:
                    now = await coordinator.record(create=False)
                    if now is None or not (now.in_sync and now.session != session):
                        break
                    await trio.sleep(0.1)
            if now is None or (now.in_sync and now.session != session):
                log.info(
                    "member %s: %s still records an earlier copy in sync; trying again",
                    self.member,
                    record.owner,
                )
                sock.close()
                return
            if not await self._announce(""):  # the copy this key may name is about to be emptied
                sock.close()
                return
        except BaseException:
            sock.close()
            raise
        copy = follower.Copy(self.data_dir)
        finished = trio.Event()
        outcome: list[BaseException] = []
        token = trio.lowlevel.current_trio_token()

        def apply() -> None:
            try:
                copy.wipe()
                follower.follow(sock, copy)
            except BaseException as error:
                outcome.append(error)  # how the session ended, said below
            finally:
                token.run_sync_soon(finished.set)

        threading.Thread(target=apply, name="replication-follow", daemon=True).start()
        log.info(
            "member %s: following %s at epoch %d (session %s)",
            self.member,
            record.owner,
            record.epoch,
            session,
        )
        marked = False
        try:
            while not finished.is_set():
                with trio.move_on_after(POLL):
                    await finished.wait()
                try:
                    now = await coordinator.record(create=False)
                    owner_alive = now is not None and await coordinator.alive(now.owner) is not None
                except EtcdError as error:
                    log.warning("etcd: %s", error)
                    continue
                if now is None:
                    break
                ours = now.in_sync and now.session == session and now.epoch == record.epoch
                if ours and not marked:
                    write_marker(self.data_dir, marker_for(self.member, now.epoch, session))
                    marked = True
                    await self._announce(session)
                    self._backoff.reset()
                    self._session_failed = False
                if marked and not ours:
                    break  # the owner records us as gone (it timed out on us): a new session copies again
                if now.owner != record.owner or now.epoch != record.epoch or not owner_alive:
                    break
        finally:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
            await finished.wait()
        if not marked:
            # The owner may have recorded this session in sync and died between two polls.
            with trio.move_on_after(2):
                try:
                    now = await coordinator.record(create=False)
                except EtcdError:
                    now = None
                if now is not None and now.in_sync and now.session == session:
                    write_marker(self.data_dir, marker_for(self.member, now.epoch, session))
                    await self._announce(session)
        if outcome:
            log.info("member %s: following %s ended: %s", self.member, record.owner, outcome[0])

    def _connect(self, address: str, session: str, epoch: int) -> socket.socket:
        source = source_address(self.settings)
        sock = socket.create_connection(
            split_address(address), timeout=2, source_address=None if source is None else (source, 0)
        )
        try:
            replica = self.coordinator.replica
            sock.sendall(
                wire.hello(
                    {
                        "member": self.member,
                        "replica": replica,
                        "session": session,
                        "epoch": epoch,
                        "proof": proof(self.secret, self.member, replica, session),
                    }
                )
            )
            answer = wire.read_line(sock.recv)
            if not answer.get("ok"):
                raise wire.ProtocolError(str(answer.get("error", "refused")))
            # The owner sends a barrier at least every HEARTBEAT: silence means it is gone, and a
            # partition sends no reset.
            sock.settimeout(5 * HEARTBEAT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
            return sock
        except BaseException:
            sock.close()
            raise

    # ---- owner ---------------------------------------------------------------------------------

    async def _own(self, record: Record, nursery: trio.Nursery) -> None:
        coordinator = self.coordinator
        epoch = record.epoch
        marker = read_marker(self.data_dir) or {}
        write_marker(
            self.data_dir, {**marker, **marker_for(self.member, epoch, str(marker.get("session", "")))}
        )
        self.stats.role = "owner"
        self.stats.epoch = epoch
        self.stats.alone_since = trio.current_time()
        send, receive = trio.open_memory_channel[tuple[str, Link]](math.inf)
        token = trio.lowlevel.current_trio_token()

        def report(kind: str) -> Callable[[Link], None]:
            return lambda link: token.run_sync_soon(send.send_nowait, (kind, link))

        mirror = MirrorFileSystem(
            files.OS, self.data_dir, on_broken=report("broken"), on_in_sync=report("in_sync")
        )
        self.mirror = mirror
        try:
            await coordinator.mark_served(epoch)
            if record.in_sync:  # the follower's copy predates this process: it reconnects and copies again
                await coordinator.mark(epoch, in_sync=False)
        except Deposed as deposed:
            fence(str(deposed))
        listener = socket.create_server(split_address(self.replication_address), reuse_port=False)

        def take_followers() -> None:
            # Only once recovery is done: a follower's copy must not compete with it for the CPU
            # and the disk while the member's streams wait to be served.
            threading.Thread(target=self._accept, args=(listener, mirror, epoch), daemon=True).start()

        nursery.start_soon(self._owner_events, receive, epoch)
        nursery.start_soon(self._owner_watch, epoch)
        log.info("member %s: replica %s owns it at epoch %d", self.member, coordinator.replica, epoch)
        await serve(self.settings, Injected(fs=mirror, replication=self, on_serving=take_followers))

    def _accept(self, listener: socket.socket, mirror: MirrorFileSystem, epoch: int) -> None:
        while True:
            try:
                sock, peer = listener.accept()
            except OSError as failure:  # out of descriptors, say: the follower tries again
                log.error("replication: accepting a follower failed: %s", failure)
                time.sleep(1)
                continue
            try:
                sock.settimeout(5)
                hello = wire.read_line(sock.recv)
                refusal = self._admit(hello)
                sock.sendall(
                    wire.hello({"ok": True, "epoch": epoch} if refusal is None else {"error": refusal})
                )
                if refusal is not None:
                    sock.close()
                    continue
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
                mirror.attach(sock, str(hello["replica"]), session=str(hello["session"]))
                self.stats.links += 1
            except (OSError, wire.ProtocolError) as problem:
                log.warning("replication: a connection from %s failed its handshake: %s", peer, problem)
                sock.close()

    def _admit(self, hello: dict[str, Any]) -> str | None:
        coordinator = self.coordinator
        if hello.get("member") != self.member or hello.get("replica") != coordinator.other:
            return f"this is member {self.member}'s owner; its follower is {coordinator.other}"
        expected = proof(self.secret, self.member, coordinator.other, str(hello.get("session", "")))
        if not hmac.compare_digest(expected, str(hello.get("proof", ""))):
            return "the cluster secret does not match"
        return None

    async def _owner_events(self, receive: trio.MemoryReceiveChannel[tuple[str, Link]], epoch: int) -> None:
        coordinator = self.coordinator
        async for kind, link in receive:
            session = link.session
            while True:
                try:
                    if kind == "in_sync":
                        if link.broken is None:
                            await coordinator.mark(epoch, in_sync=True, session=session)
                            self.stats.follower_in_sync = True
                            self.stats.alone_since = None
                            self.stats.copy = {
                                "bytes": link.stats.copied_bytes,
                                "seconds": round(link.stats.copy_seconds, 3),
                            }
                    else:
                        await coordinator.mark(epoch, in_sync=False)
                        if self.stats.follower_in_sync:
                            log.error(
                                "member %s: follower %s is gone; acknowledging alone", self.member, link.peer
                            )
                        self.stats.follower_in_sync = False
                        self.stats.alone_since = self.stats.alone_since or trio.current_time()
                        if self.mirror is not None:
                            self.mirror.release(link)
                    break
                except Deposed as deposed:
                    fence(str(deposed))
                except EtcdError as error:
                    log.warning("etcd: %s; trying again", error)
                    await trio.sleep(0.2)

    async def _owner_watch(self, epoch: int) -> None:
        """Another owner in etcd (this process was paused or cut off past its lease) ends this one."""
        coordinator = self.coordinator
        while True:
            await trio.sleep(POLL)
            try:
                record = await coordinator.record()
            except EtcdError:
                continue  # the lease watch fences if this lasts longer than the lease
            if record.owner != coordinator.replica or record.epoch != epoch:
                fence(f"member {self.member} is owned by {record.owner} at epoch {record.epoch}")

    def describe(self) -> dict[str, Any]:
        mirror = self.mirror
        link = None if mirror is None else mirror.link
        alone = self.stats.alone_since
        return {
            "member": self.member,
            "replica": self.coordinator.replica,
            "address": self.coordinator.http_address,
            "role": self.stats.role,
            "epoch": self.stats.epoch,
            "follower": self.coordinator.other,
            "follower_connected": link is not None and link.broken is None,
            "follower_in_sync": self.stats.follower_in_sync,
            "alone_seconds": 0.0 if alone is None else round(trio.current_time() - alone, 1),
            "follower_links": self.stats.links,
            "last_copy": self.stats.copy,
            "barriers": 0 if link is None else link.stats.barriers,
            "barrier_waits": 0 if link is None else link.stats.waits,
            "barrier_wait_seconds": 0.0 if link is None else round(link.stats.wait_seconds, 3),
            "promotions": self.coordinator.promotions,
        }


def source_address(settings: SimpleNamespace) -> str | None:
    """The address this replica's own connections leave from: its listening address when that is
    one address (so a machine's traffic can be cut as a whole, as the partition tests do)."""
    host = settings.server.host
    return None if host in ("", "0.0.0.0", "::", "localhost") else host


async def run_replica(settings: SimpleNamespace) -> None:
    options = settings.replication
    endpoints = [e.strip() for e in options.etcd.split(",") if e.strip()]

    def make_etcd(timeout: float = 2.0) -> Etcd:
        return Etcd(endpoints, timeout=timeout, local_address=source_address(settings))

    async with make_etcd() as etcd:
        await Replica(settings, etcd, make_etcd).run()


def run(settings: SimpleNamespace) -> None:
    collector.tune()  # a server process, as `assemble.run` sets it
    trio.run(run_replica, settings)
