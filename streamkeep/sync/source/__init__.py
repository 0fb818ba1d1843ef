"""Postgres -> stream (`[[pg_to_stream]]`): a logical replication slot's committed changes as
State Protocol messages on a stream, exactly once through crashes (see bridge.py)."""

from __future__ import annotations

import psycopg

from streamkeep.client import Client
from streamkeep.sync.config import PgToStream
from streamkeep.sync.source import catalog
from streamkeep.sync.source.bridge import Bridge, BridgeBusy
from streamkeep.sync.source.checkpoint import CheckpointStore
from streamkeep.sync.stats import MappingStats


async def run(mapping: PgToStream, client: Client, stats: MappingStats) -> None:
    """Runs the mapping until cancelled; raises on a transient failure (the process calls it
    again) and `MappingStopped` on what a person must fix."""
    bridge = Bridge(mapping, client, stats)
    try:
        await bridge.run()
    finally:
        bridge.close()


def reset(mapping: PgToStream) -> str:
    """`streamkeep sync reset NAME`: drops the slot, the publication and the checkpoint, so the
    next start snapshots again (behind a `reset` control message, since the stream has content).
    Appends nothing itself. Refused while a bridge runs the mapping."""
    with psycopg.connect(mapping.dsn, autocommit=True) as conn:
        store = CheckpointStore(conn, mapping.checkpoint_table, mapping.name)
        if not store.try_lock(mapping.slot):
            raise BridgeBusy(
                f"mapping {mapping.name} is running (its advisory lock is held): stop the sync first"
            )
        slot = catalog.slot_state(conn, mapping.slot)
        if slot is not None and slot.active_pid is not None:
            raise BridgeBusy(
                f"slot {mapping.slot} is in use by backend {slot.active_pid}: stop the sync first"
            )
        dropped = catalog.drop_slot(conn, mapping.slot)
        dropped_publication = catalog.drop_publication(conn, mapping.publication)
        deleted = store.delete()
    done = [
        f"slot {mapping.slot} dropped" if dropped else f"no slot {mapping.slot}",
        f"publication {mapping.publication} dropped"
        if dropped_publication
        else f"no publication {mapping.publication}",
        "checkpoint deleted" if deleted else "no checkpoint",
    ]
    return (
        f"{mapping.name}: {', '.join(done)}; the next start re-snapshots into {mapping.stream} behind a reset"
    )


__all__ = ["BridgeBusy", "reset", "run"]
