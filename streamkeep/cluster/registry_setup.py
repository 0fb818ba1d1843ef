"""Which part of the cluster's one `__registry__` this member plays, set up at start.

- The member that owns the name keeps it (cluster/registry.py, `ClusterKeeper`).
- Every other member relays its creates and deletes there (cluster/registry_relay.py) and keeps
  no `__registry__` of its own: one left from before (each member used to keep its own list) is
  out of every client's reach, since the name is routed to the keeper, so it is deleted.
- Without a cluster secret members cannot call each other: the keeper lists only its own streams
  (as each member did before), the others list nothing, and a warning says so.

A single process (no `[cluster]`) never comes here: assemble.py starts a plain `RegistryKeeper`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import trio

from streamkeep.actors.messages import DELETE
from streamkeep.actors.supervisor import Supervisor
from streamkeep.background import supervised
from streamkeep.cluster.peers import PeerOps, Peers
from streamkeep.cluster.placement import Placement
from streamkeep.cluster.registry import ClusterKeeper
from streamkeep.cluster.registry_relay import RegistryRelay
from streamkeep.protocol.errors import ProtocolError
from streamkeep.registry import entries
from streamkeep.registry.entries import NAME
from streamkeep.registry.keeper import RegistryKeeper

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegistryPart:
    """What this member plays: the keeper (None on the others), its /stats section (None: no
    part at all), and what to start once the member answers calls (None: nothing)."""

    keeper: RegistryKeeper | None = None
    stats: Callable[[], dict] | None = None
    later: Callable[[], Awaitable[None]] | None = None


async def start(
    supervisor: Supervisor,
    placement: Placement,
    member_id: str,
    peers: Peers | None,
    peer_ops: PeerOps,
    nursery: trio.Nursery,
) -> RegistryPart:
    """Sets this member's part up before streams are served (a keeper reconciles, or raises
    RegistryConflict)."""
    keeper_id = placement.owner(NAME).id
    if keeper_id == member_id:
        if peers is None:
            log.warning(
                "%s lists only this member's streams: without a cluster secret the other members "
                "cannot send it theirs",
                NAME,
            )
            registry = RegistryKeeper(supervisor)
        else:
            registry = ClusterKeeper(supervisor, peers)
            registry.register(peer_ops)
        supervisor.lifecycle = registry
        await registry.start()
        nursery.start_soon(supervised, "registry", registry.run, registry.health)
        return RegistryPart(registry, registry.stats)
    await _drop_local(supervisor)
    if peers is None:
        return RegistryPart()
    relay = RegistryRelay(supervisor.storage, peers)
    relay.register(peer_ops)
    supervisor.lifecycle = relay
    return RegistryPart(None, relay.stats, partial(supervised, "registry relay", relay.run, relay.health))


async def _drop_local(supervisor: Supervisor) -> None:
    """Deletes a `__registry__` this member kept before the cluster had one (see above); a stream
    so named that was not one (a client's, made with the registry off) is left alone."""
    existing = supervisor.storage.open(NAME)
    if existing is None:
        return
    reason = entries.unadoptable(existing.meta)
    if reason is not None:
        log.warning("%s here is not a registry (%s); left as it is, out of reach", NAME, reason)
        return
    try:
        await supervisor.call(NAME, DELETE)
    except ProtocolError as error:
        log.warning("%s kept here before the cluster had one could not be deleted: %s", NAME, error.message)
        return
    log.info("deleted the %s this member kept: the cluster keeps one, on the member owning the name", NAME)
