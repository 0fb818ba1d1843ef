"""`__registry__` entries of concurrent creates and deletes go in shared appends (one per turn of
the keeper's lock, registry/keeper.py `_record`), in the order the changes came, and the registry
still lists exactly the live streams; an entry refused by `still_due` or whose caller was
cancelled while waiting is left out of its batch, and only it."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import trio
import trio.testing

from streamkeep.actors.messages import Create
from streamkeep.actors.replies import PendingAppend
from streamkeep.actors.supervisor import Supervisor
from streamkeep.protocol.model import Headers
from streamkeep.protocol.stream import CreateSpec
from streamkeep.registry.keeper import RegistryKeeper
from streamkeep.storage.memory import MemoryStorage

STREAMS = 40


class CountingKeeper(RegistryKeeper):
    """The real keeper, counting the appends it makes and the entries in them."""

    def __init__(self, supervisor: Supervisor) -> None:
        super().__init__(supervisor)
        self.appends: list[int] = []

    async def _submit(self, messages: list[bytes]) -> PendingAppend:
        self.appends.append(len(messages))
        return await super()._submit(messages)


def create() -> Create:
    return Create(CreateSpec.from_request(Headers([("Content-Type", "text/plain")]), b""))


async def create_stream(supervisor: Supervisor, name: str) -> None:
    await supervisor.call(name, create(), must_exist=False)


async def started(nursery: trio.Nursery) -> tuple[Supervisor, CountingKeeper]:
    storage = MemoryStorage(max_stream_bytes=1 << 20, max_total_bytes=1 << 24)
    supervisor = Supervisor(storage, nursery)
    keeper = CountingKeeper(supervisor)
    supervisor.lifecycle = keeper
    await keeper.start()
    return supervisor, keeper


async def assert_lists_exactly_the_live_streams(keeper: CountingKeeper) -> None:
    """Reconcile folds the registry as stored and appends the difference: none means it was exact."""
    before = len(keeper.appends)
    await keeper.reconcile()
    assert keeper.repairs == 0 and len(keeper.appends) == before
    assert keeper.health.stats()["failing"] == []


async def test_concurrent_creates_and_deletes_share_appends_and_keep_the_registry_exact() -> None:
    async with trio.open_nursery() as nursery:
        supervisor, keeper = await started(nursery)
        keeper.appends.clear()
        async with trio.open_nursery() as creates:
            for i in range(STREAMS):
                creates.start_soon(create_stream, supervisor, f"s{i}")
        assert sorted(keeper.listed) == sorted(f"s{i}" for i in range(STREAMS))
        assert sum(keeper.appends) == STREAMS and keeper.inserts == STREAMS
        assert len(keeper.appends) < STREAMS / 2, keeper.appends  # shared, not one append each
        await assert_lists_exactly_the_live_streams(keeper)

        # A delete and a create again of the same name, queued in one batch: both land, in order.
        keeper.appends.clear()
        async with trio.open_nursery() as changes:
            for i in range(0, STREAMS, 2):
                changes.start_soon(supervisor.storage.delete, f"s{i}")
        async with trio.open_nursery() as changes:
            for i in range(0, STREAMS, 2):
                changes.start_soon(keeper.deleted, f"s{i}")
            for i in range(0, 10, 2):
                changes.start_soon(create_stream, supervisor, f"s{i}")
        assert len(keeper.appends) < STREAMS / 2 + 5, keeper.appends
        assert sorted(keeper.listed) == sorted(
            [f"s{i}" for i in range(1, STREAMS, 2)] + ["s0", "s2", "s4", "s6", "s8"]
        )
        await assert_lists_exactly_the_live_streams(keeper)
        nursery.cancel_scope.cancel()


async def test_a_refused_or_cancelled_entry_leaves_the_rest_of_its_batch() -> None:
    async with trio.open_nursery() as nursery:
        _, keeper = await started(nursery)
        entry: dict[str, Any] = {"path": "x", "contentType": "text/plain", "createdAt": 1_800_000_000_000}

        def refuse() -> None:
            raise RuntimeError("waited too long")

        refused: list[BaseException] = []

        async def refused_one() -> None:
            try:
                await keeper._record("refused", dict(entry, path="refused"), refuse)
            except RuntimeError as error:
                refused.append(error)

        keeper.appends.clear()
        async with trio.open_nursery() as changes:
            # Hold the lock so that every change below queues behind it and goes in one batch.
            await keeper._lock.acquire()
            changes.start_soon(keeper._record, "a", dict(entry, path="a"))
            changes.start_soon(refused_one)
            cancel_me = trio.CancelScope()

            async def given_up() -> None:  # its caller gives up before its turn: never submitted
                with cancel_me:
                    await keeper._record("given-up", dict(entry, path="given-up"))

            changes.start_soon(given_up)
            changes.start_soon(keeper._record, "b", dict(entry, path="b"))
            await trio.testing.wait_all_tasks_blocked()
            cancel_me.cancel()
            await trio.testing.wait_all_tasks_blocked()
            keeper._lock.release()
            keeper._end_turn()  # as a turn ends: the changes waiting for it go on
        assert keeper.appends == [2], keeper.appends  # a and b, in one append
        assert [str(error) for error in refused] == ["waited too long"]
        assert {"a", "b"} <= set(keeper.listed) and not {"refused", "given-up"} & set(keeper.listed)
        nursery.cancel_scope.cancel()


async def test_an_entry_that_does_not_encode_fails_alone_and_the_rest_of_its_batch_is_answered() -> None:
    """A member's malformed change (a value cbor2 decoded to a datetime, a NaN) fails only itself:
    the changes queued behind it in the same batch land, and none waits for a turn that never
    takes it (the event loop spun for them, and their PUTs were never answered)."""
    import datetime

    async with trio.open_nursery() as nursery:
        _, keeper = await started(nursery)
        entry: dict[str, Any] = {"path": "x", "contentType": "text/plain", "createdAt": 1_800_000_000_000}
        outcomes: dict[str, str] = {}

        async def change(name: str, value: dict[str, Any]) -> None:
            try:
                await keeper._record(name, value)
                outcomes[name] = "ok"
            except Exception as error:
                outcomes[name] = type(error).__name__

        keeper.appends.clear()
        with trio.fail_after(5):
            async with trio.open_nursery() as changes:
                await keeper._lock.acquire()  # every change below queues behind it: one batch
                changes.start_soon(change, "a", dict(entry, path="a"))
                changes.start_soon(change, "odd", {"path": "odd", "at": datetime.datetime.now()})
                changes.start_soon(change, "nan", dict(entry, path="nan", createdAt=float("nan")))
                changes.start_soon(change, "b", dict(entry, path="b"))
                await trio.testing.wait_all_tasks_blocked()
                keeper._lock.release()
                keeper._end_turn()
        assert outcomes == {"a": "ok", "odd": "TypeError", "nan": "ValueError", "b": "ok"}
        assert keeper.appends == [2], keeper.appends
        assert {"a", "b"} <= set(keeper.listed) and not {"odd", "nan"} & set(keeper.listed)
        nursery.cancel_scope.cancel()


def test_only_an_entry_of_values_shape_is_taken_from_a_member() -> None:
    from streamkeep.registry import entries

    good = {"path": "a", "contentType": "text/plain", "createdAt": 1}
    assert entries.is_value("a", good) and entries.is_value("a", dict(reversed(good.items())))
    for bad in (
        dict(good, path="b"),
        dict(good, createdAt=float("nan")),
        dict(good, createdAt=True),
        dict(good, contentType=None),
        dict(good, extra=1),
        {"path": "a", "contentType": "text/plain"},
        ["a"],
        None,
    ):
        assert not entries.is_value("a", bad), bad


def test_entries_go_as_split_messages_byte_for_byte() -> None:
    """The keeper hands its entries to the append already split (AppendSpec.messages): they are
    exactly what splitting the body would have stored, non-ASCII names included."""
    from streamkeep.protocol import jsonmode
    from streamkeep.registry import entries

    value: dict[str, Any] = {"path": "chat/ü-1", "contentType": "text/plain", "createdAt": 1_800_000_000_000}
    messages = [entries.insert("chat/ü-1", value), entries.delete('chat/room "2"')]
    assert jsonmode.split_messages(jsonmode.render_array(messages), allow_empty_array=False) == messages


def test_an_insert_written_out_is_what_json_dumps_makes() -> None:
    """entries.insert writes an entry of `value`'s shape out by hand: the same bytes as the general
    encoding, whatever the name; any other shape takes the general one."""
    import random

    from streamkeep.registry import entries

    def general(name: str, entry: dict[str, Any]) -> bytes:
        return entries._encode(
            {"type": "stream", "key": name, "value": entry, "headers": {"operation": "insert"}}
        )

    rnd = random.Random(26)
    alphabet = ["a", "/", '"', "\\", "\n", "\x00", "\x1f", "\x7f", "é", "€", "😀", "\u2028", " ", "<", "&"]
    for _ in range(2000):
        name = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 10)))
        entry = {
            "path": name,
            "contentType": rnd.choice(["text/plain", 'a"b', "ü"]),
            "createdAt": rnd.randint(0, 2**45),
        }
        assert entries.insert(name, entry) == general(name, entry)
    for odd in (
        {"path": "a", "contentType": "x", "createdAt": True},
        {"contentType": "x", "path": "a", "createdAt": 1},
    ):
        assert entries.insert("a", odd) == general("a", odd)


async def test_the_keeper_remembers_a_listed_stream_in_little_memory_and_still_tells_changes() -> None:
    """What the keeper keeps per listed stream is small (a dict per stream cost ~216 B of the
    ~2 KiB an idle stream may take; issue 26), and still tells a change that says nothing new
    (no append) from one that does (an insert)."""
    async with trio.open_nursery() as nursery:
        supervisor, keeper = await started(nursery)
        async with trio.open_nursery() as creates:
            for i in range(STREAMS):
                creates.start_soon(create_stream, supervisor, f"s{i}")
        kept = [value for name, value in keeper.listed.items() if name.startswith("s")]
        assert len(kept) == STREAMS
        assert max(sys.getsizeof(value) for value in kept) <= 64, "a listed stream is kept as a dict"

        stream_log = supervisor.storage.open("s1")
        assert stream_log is not None
        keeper.appends.clear()
        await keeper.created(stream_log.meta)  # told again: the registry already says so
        assert keeper.appends == []
        await keeper.created(replace(stream_log.meta, content_type="application/octet-stream"))
        assert keeper.appends == [1] and keeper.inserts == STREAMS + 1
        await keeper.deleted("s2")
        await keeper.deleted("s2")  # a delete of what is no longer listed appends nothing
        assert keeper.appends == [1, 1] and "s2" not in keeper.listed
        await keeper.reconcile()  # the registry now disagrees with storage on s1 and s2: repaired
        assert keeper.repairs == 1 and "s2" in keeper.listed
        keeper.repairs = 0
        await assert_lists_exactly_the_live_streams(keeper)
        nursery.cancel_scope.cancel()
