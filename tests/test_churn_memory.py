"""Memory under stream churn (issue 23, point 9): what a server that runs for months must not keep.

In process, no sockets: the structures are counted directly, and the heap through /proc.
`make soak` (ops/soak.py) is the end-to-end check on a real server.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import trio

from streamkeep import background
from streamkeep.actors.messages import Create, Delete
from streamkeep.actors.supervisor import Supervisor
from streamkeep.compaction import PRUNE_FLOOR, Compactor
from streamkeep.protocol.stream import CreateSpec
from streamkeep.storage.memory import MemoryStorage

TEXT = CreateSpec("text/plain", None, None, False, [])
JSON = CreateSpec("application/json", None, None, False, [])


def test_failed_compactions_of_deleted_streams_are_forgotten() -> None:
    """A retention rule that compacts `**` fails on every stream that is not JSON; the compactor
    notes each failure so it does not retry every pass. Those notes went only with the server:
    ~150 bytes for every such stream ever deleted."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            supervisor = Supervisor(MemoryStorage(max_stream_bytes=1 << 20, max_total_bytes=1 << 24), nursery)
            compactor = Compactor(supervisor, nursery)
            churned = 4 * PRUNE_FLOOR
            for number in range(churned):
                name = f"churn-{number}"
                await supervisor.call(name, Create(TEXT), must_exist=False)
                compactor.start_due(name)  # not a State Protocol stream: fails, and is noted
                await supervisor.call(name, Delete())
            assert len(compactor._failed_at) <= 2 * PRUNE_FLOOR, len(compactor._failed_at)

            # A stream created again under a failed name is a new stream: it is tried again at
            # once, not after it has grown a MiB past its predecessor's tail.
            await supervisor.call("again", Create(TEXT), must_exist=False)
            compactor.start_due("again")
            first = compactor._failed_at["again"]
            await supervisor.call("again", Delete())
            await supervisor.call("again", Create(JSON), must_exist=False)
            compactor.start_due("again")  # memory storage cannot compact: a failure, noted anew
            assert compactor._failed_at["again"][0] != first[0]
            nursery.cancel_scope.cancel()

    trio.run(main)


def _rss_kib() -> int:
    match = re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text())
    assert match is not None
    return int(match.group(1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc are Linux's")
def test_freed_heap_memory_goes_back_to_the_system() -> None:
    """What Python frees in the middle of glibc's heap stays in RSS until a trim hands it back;
    the server trims every minute (background.give_back_memory)."""
    trim = background.malloc_trim()
    assert trim is not None, "glibc's malloc_trim was not found"
    blocks = [bytes(2048) for _ in range(32_768)]  # 64 MiB of blocks past pymalloc's 512 bytes
    kept = blocks[::64]  # one in 64 stays, so the heap's top cannot shrink by itself
    del blocks
    before = _rss_kib()
    trim()
    after = _rss_kib()
    assert before - after > 32 << 10, f"RSS {before} KiB -> {after} KiB"
    assert len(kept) == 512
