"""Which part of the cluster's one `__registry__` this member plays, set up at start.

- The member that owns the name keeps it (cluster/registry.py, `ClusterKeeper`).
- Every other member relays its creates and deletes there (cluster/registry_relay.py) and keeps
  no `__registry__` of its own: one left from before (each member used to keep its own list) is
  out of every client's reach, since the name is routed to the keeper, so it is deleted.
- Without a cluster secret members cannot call each other: the keeper lists only its own streams
  (as each member did before), the others list nothing, and a warning says so.

A single process (no `[cluster]`) never comes here: http/server.py starts a plain `RegistryKeeper`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING

import trio

from streamkeep.background import supervised
from streamkeep.cluster.registry import ClusterKeeper
from streamkeep.cluster.registry_relay import RegistryRelay
from streamkeep.protocol.errors import ProtocolError
from streamkeep.registry import entries
from streamkeep.registry.entries import NAME
from streamkeep.registry.keeper import RegistryKeeper

if TYPE_CHECKING:
    from streamkeep.service import Service

log = logging.getLogger(__name__)


async def start(service: Service, nursery: trio.Nursery) -> Callable[[], Awaitable[None]] | None:
    """Sets this member's part up before streams are served (a keeper reconciles, or raises
    RegistryConflict); returns what to start once the member answers calls, if anything."""
    placement = service.placement
    assert placement is not None
    supervisor = service.supervisor
    keeper_id = placement.owner(NAME).id
    if keeper_id == service.member_id:
        if service.peers is None:
            log.warning(
                "%s lists only this member's streams: without a cluster secret the other members "
                "cannot send it theirs",
                NAME,
            )
            registry = RegistryKeeper(supervisor)
        else:
            registry = ClusterKeeper(supervisor, service.peers)
            registry.register(service.peer_ops)
        supervisor.lifecycle = registry
        await registry.start()
        service.registry = registry
        service.stats_sources["registry"] = registry.stats
        nursery.start_soon(supervised, "registry", registry.run, registry.health)
        return None
    await _drop_local(service)
    if service.peers is None:
        return None
    relay = RegistryRelay(supervisor.storage, service.peers)
    relay.register(service.peer_ops)
    supervisor.lifecycle = relay
    service.stats_sources["registry"] = relay.stats
    return partial(supervised, "registry relay", relay.run, relay.health)


async def _drop_local(service: Service) -> None:
    """Deletes a `__registry__` this member kept before the cluster had one (see above); a stream
    so named that was not one (a client's, made with the registry off) is left alone."""
    existing = service.supervisor.storage.open(NAME)
    if existing is None:
        return
    reason = entries.unadoptable(existing.meta)
    if reason is not None:
        log.warning("%s here is not a registry (%s); left as it is, out of reach", NAME, reason)
        return
    try:
        await service.supervisor.call(NAME, "delete")
    except ProtocolError as error:
        log.warning("%s kept here before the cluster had one could not be deleted: %s", NAME, error.message)
        return
    log.info("deleted the %s this member kept: the cluster keeps one, on the member owning the name", NAME)
