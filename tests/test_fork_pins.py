"""A source's pins for forks other cluster members own, as its actor keeps them (memory storage,
in process): counted once however often an attach is retried, kept in memory while a save of
their removal fails (so the retry still removes them), and raised, never lowered, when the fork
reads less of the source than it did."""

from __future__ import annotations

import pytest
import trio

from streamkeep.actors.messages import DELETE, AttachFork, Create, DetachFork, RaisePin
from streamkeep.actors.supervisor import Supervisor
from streamkeep.protocol import offsets
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.stream import CreateSpec, ForkSpec, StreamMeta
from streamkeep.storage.errors import StorageUnavailable
from streamkeep.storage.memory import MemoryStorage


def source_spec() -> CreateSpec:
    return CreateSpec("text/plain", None, None, False, [b"abcdef"], b"abcdef")


async def test_a_pin_is_counted_once_kept_while_its_removal_fails_and_only_rises() -> None:
    async with trio.open_nursery() as nursery:
        storage = MemoryStorage(max_stream_bytes=1 << 20, max_total_bytes=1 << 22)
        supervisor = Supervisor(storage, nursery)
        await supervisor.call("src", Create(source_spec()), must_exist=False)
        token = offsets.encode(3)
        at_three = ForkSpec("src", token, offsets.decode(token), 0)
        for _ in range(2):  # the fork's member retried its attach: one pin, one count
            source = await supervisor.call("src", AttachFork(at_three, None, ("pin1", "elsewhere/fork")))
            assert source.base == 3 and source.low == 0 and source.incarnations
        log = storage.open("src")
        assert log is not None
        assert log.meta.fork_count == 1 and log.meta.remote_forks == (("pin1", "elsewhere/fork", 0),)
        await supervisor.call("src", RaisePin("pin1", 2))
        await supervisor.call("src", RaisePin("pin1", 1))  # pins never go back down
        assert log.meta.remote_forks == (("pin1", "elsewhere/fork", 2),)
        await supervisor.call("src", DELETE)
        assert log.meta.soft_deleted  # pinned: its fork still reads it
        saved = storage.save_meta

        async def failing(name: str, meta: StreamMeta) -> None:
            raise StorageUnavailable("the disk is full", status=507)

        storage.save_meta = failing  # type: ignore[method-assign]
        with pytest.raises(ProtocolError):  # the actor answers it as the storage error it is
            await supervisor.call("src", DetachFork("pin1"))
        assert log.meta.remote_forks and log.meta.fork_count == 1  # nothing half-done
        storage.save_meta = saved  # type: ignore[method-assign]
        await supervisor.call("src", DetachFork("pin1"))  # the retry (a reconcile) finishes it
        assert storage.open("src") is None
        nursery.cancel_scope.cancel()
