"""Actor lifecycle: spawn on demand, hibernate when idle, revive intact, bounded mailboxes."""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trio.testing

from streamkeep.actors.actor import StreamActor
from streamkeep.actors.expiry import SWEEP_SLICE, sweep_expired
from streamkeep.actors.mailbox import ActorGone, NotNow
from streamkeep.actors.messages import HEAD, Append, Ask, Create, Read
from streamkeep.actors.stream_ops import HANDLERS, NOW, StreamOps
from streamkeep.actors.supervisor import SWEEP_SLICE as SUPERVISOR_SWEEP_SLICE
from streamkeep.actors.supervisor import Supervisor
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.model import Headers
from streamkeep.protocol.stream import AppendSpec, CreateSpec
from streamkeep.storage.memory import MemoryStorage


def new_storage() -> MemoryStorage:
    return MemoryStorage(max_stream_bytes=1 << 20, max_total_bytes=1 << 22)


def create() -> Create:
    return Create(CreateSpec.from_request(Headers([("Content-Type", "text/plain")]), b""))


def append(body: bytes) -> Append:
    return Append(AppendSpec.from_request(Headers([("Content-Type", "text/plain")]), body))


async def test_idle_actor_hibernates_and_revives_with_its_data(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(new_storage(), nursery, hibernate_after=5)
        await supervisor.call("s", create(), must_exist=False)
        await (await supervisor.call("s", append(b"hello"))).wait()
        assert supervisor.active == 1
        await trio.sleep(6)
        assert supervisor.active == 0, "idle actor should have hibernated"
        # The ended actor is not kept alive by its stream's publish callback.
        hibernated_log = supervisor.storage.open("s")
        assert hibernated_log is not None and hibernated_log.on_publish is None
        plan = await supervisor.call("s", Read("-1", True))
        view = await plan.log.read(0, 1024, whole_messages=False)
        assert view.messages == [b"hello"]
        assert supervisor.spawned == 2 and supervisor.active == 1
        nursery.cancel_scope.cancel()


async def test_a_woken_stream_gets_a_task_only_for_a_message_with_no_direct_form(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An append or a catch-up read to a hibernated stream is answered in the caller's task: its
    actor comes back without a mailbox or a task (issue 26: they were most of what an append to
    one of many idle streams cost extra). The first message that must queue makes both, and an
    actor that never had them hibernates all the same."""

    def stream_tasks() -> list[str]:
        root = trio.lowlevel.current_root_task()
        assert root is not None
        found: list[str] = []
        pending = [root]
        while pending:
            task = pending.pop()
            found += [task.name] if task.name.startswith("stream-actor:") else []
            pending += [child for nursery in task.child_nurseries for child in nursery.child_tasks]
        return found

    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(new_storage(), nursery, hibernate_after=5)
        await supervisor.call("s", create(), must_exist=False)
        await trio.sleep(6)
        assert supervisor.active == 0 and stream_tasks() == []
        assert supervisor.call_now("s", append(b"one")).commit.done
        plan = await supervisor.call("s", Read("-1", True))
        assert (await plan.log.read(0, 1024, whole_messages=False)).messages == [b"one"]
        assert supervisor.active == 1 and supervisor.spawned == 2
        assert stream_tasks() == [], "a woken stream needs no task for direct calls"
        await trio.sleep(6)
        assert supervisor.active == 0, "an actor without a task hibernates too"
        with pytest.raises(NotNow):
            supervisor.call_now("missing", append(b"x"))  # the long way answers 404
        assert supervisor.active == 0
        # A message with no direct form (here: a create of an existing stream) starts the task.
        status, _ = await supervisor.call("s", create(), must_exist=False)
        assert status == 200 and stream_tasks() == ["stream-actor:s"]
        await trio.sleep(6)
        assert supervisor.active == 0 and stream_tasks() == []
        nursery.cancel_scope.cancel()


async def test_an_actor_that_hibernated_before_its_first_message_is_made_again() -> None:
    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(new_storage(), nursery, hibernate_after=5)
        await supervisor.call("s", create(), must_exist=False)
        gone = supervisor.actor("s", must_exist=True)
        assert gone.hibernate_if_idle(trio.current_time() + 1)
        with pytest.raises(ActorGone):
            await gone.call(HEAD)
        view = await supervisor.call("s", HEAD)  # the supervisor makes a fresh actor
        assert view.tail == 0 and supervisor.actor("s", must_exist=True) is not gone
        nursery.cancel_scope.cancel()


SHIELDED_CALL_AT_SHUTDOWN = """
import trio
from streamkeep.actors.supervisor import Supervisor
from streamkeep.protocol.errors import ProtocolError
from streamkeep.storage.memory import MemoryStorage
from tests.test_actors import create

async def main() -> None:
    answers = []
    with trio.CancelScope() as server:
        async with trio.open_nursery() as nursery:
            supervisor = Supervisor(MemoryStorage(max_stream_bytes=1 << 20, max_total_bytes=1 << 22), nursery)
            await supervisor.call("s", create(), must_exist=False)

            async def must_finish() -> None:  # as a fork's detach from its source does
                with trio.CancelScope(shield=True):
                    await trio.sleep(0.05)  # the actor's task has ended by now
                    try:
                        answers.append(await supervisor.call("s", create()))
                    except ProtocolError as error:
                        answers.append(error.code)

            nursery.start_soon(must_finish)
            await trio.sleep(0.01)
            server.cancel()
    print(answers)

trio.run(main)
"""


def test_a_caller_that_must_finish_is_answered_after_the_actors_task_ended() -> None:
    """The server stops: an actor's task ends while the actor is still in the supervisor's table.
    A shielded caller that sends to it then must hear "stopping", not "gone" (which sent it back
    to the same actor forever: the event loop spun and the process never exited)."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", SHIELDED_CALL_AT_SHUTDOWN],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['shutting_down']"


async def test_live_reader_keeps_actor_awake(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(new_storage(), nursery, hibernate_after=1)
        await supervisor.call("s", create(), must_exist=False)
        with supervisor.live_reader("s"):
            await trio.sleep(10)
            assert supervisor.active == 1
        await trio.sleep(2)
        assert supervisor.active == 0
        nursery.cancel_scope.cancel()


async def test_missing_stream_spawns_no_actor() -> None:
    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(new_storage(), nursery)
        for i in range(100):
            try:
                await supervisor.call(f"nope-{i}", HEAD)
            except ProtocolError as error:
                assert error.status == 404
        assert supervisor.spawned == 0
        nursery.cancel_scope.cancel()


async def test_concurrent_appends_are_serialised() -> None:
    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(new_storage(), nursery, mailbox_size=8)
        await supervisor.call("s", create(), must_exist=False)
        next_offsets: list[int] = []

        async def one(i: int) -> None:
            pending = await supervisor.call("s", append(b"%03d" % i))
            outcome = await pending.wait()
            next_offsets.append(outcome.next_offset)

        async with trio.open_nursery() as writers:
            for i in range(200):
                writers.start_soon(one, i)
        assert sorted(next_offsets) == [3 * (i + 1) for i in range(200)]
        plan = await supervisor.call("s", Read("-1", True))
        view = await plan.log.read(0, 1 << 20, whole_messages=False)
        assert sorted(view.messages) == [b"%03d" % i for i in range(200)]
        nursery.cancel_scope.cancel()


def not_now(ops: StreamOps, message: Append) -> None:
    raise NotNow


async def test_full_mailbox_makes_senders_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood of appends queues at most `mailbox_size` messages; the rest wait in their senders."""
    gate = trio.Event()
    original = HANDLERS[Append]

    async def slow_append(ops: StreamOps, message: Append) -> object:
        await gate.wait()
        return await original(ops, message)

    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(new_storage(), nursery, mailbox_size=4)
        await supervisor.call("s", create(), must_exist=False)
        monkeypatch.setitem(HANDLERS, Append, slow_append)
        # Appends that cannot be answered in the caller's task (here: none) take the mailbox.
        monkeypatch.setitem(NOW, Append, not_now)
        done = 0

        async def one() -> None:
            nonlocal done
            await (await supervisor.call("s", append(b"x"))).wait()
            done += 1

        async with trio.open_nursery() as writers:
            for _ in range(20):
                writers.start_soon(one)
            await trio.testing.wait_all_tasks_blocked()
            actor = supervisor.actor("s", must_exist=True)
            stats = actor._send.statistics()
            assert stats.current_buffer_used == 4  # one more is in the actor's hands
            assert stats.tasks_waiting_send == 20 - 4 - 1
            assert done == 0
            gate.set()
        assert done == 20
        view = await supervisor.call("s", HEAD)
        assert view.tail == 20
        nursery.cancel_scope.cancel()


@dataclass(slots=True)
class Slow(Ask[str]):
    """A message a test holds the actor busy with."""


async def test_a_caller_that_must_finish_is_answered_when_the_actor_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the torture run (sim seed 2462): at shutdown a fork's shielded delete called its
    source's actor, which was cancelled before it took the message; the delete waited forever and
    the server never stopped. Messages an actor will not take, or is cancelled in, are answered."""
    answers: list[object] = []
    outer = trio.CancelScope()

    async def shielded_call(supervisor: Supervisor, name: str, message: Ask[object]) -> None:
        with trio.CancelScope(shield=True):
            try:
                answers.append(await supervisor.call(name, message))
            except ProtocolError as error:
                answers.append(error.code)

    with outer:
        async with trio.open_nursery() as nursery:
            supervisor = Supervisor(new_storage(), nursery)
            await supervisor.call("s", create(), must_exist=False)
            entered, release = trio.Event(), trio.Event()

            # Holds the actor busy, so the next message waits in its mailbox.
            async def slow(ops: StreamOps, message: Slow) -> str:
                entered.set()
                await release.wait()
                return "done"

            monkeypatch.setitem(HANDLERS, Slow, slow)
            nursery.start_soon(shielded_call, supervisor, "s", Slow())
            await entered.wait()
            nursery.start_soon(shielded_call, supervisor, "s", HEAD)
            await trio.testing.wait_all_tasks_blocked()
            outer.cancel()
    assert sorted(map(str, answers)) == ["shutting_down", "shutting_down"]


async def test_the_ttl_sweep_lets_other_tasks_run_while_it_looks_at_many_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass over every stream is sliced: at 100,000 streams one pass held the event loop ~30 ms,
    a stall for every request in flight. Another task runs between slices, and the sweep still
    removes the one expired stream among them."""
    storage = MemoryStorage(max_stream_bytes=1 << 20, max_total_bytes=1 << 26)
    streams = 3 * SWEEP_SLICE + 10
    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(storage, nursery)
        for number in range(streams):
            await supervisor.call(f"s{number}", create(), must_exist=False)
        expiring = Create(
            CreateSpec.from_request(Headers([("Content-Type", "text/plain"), ("Stream-TTL", "1")]), b"")
        )
        await supervisor.call("short-lived", expiring, must_exist=False)
        short_lived = storage.open("short-lived")
        assert short_lived is not None
        short_lived.meta.last_access -= 5
        looked = 0
        original_open = storage.open

        def counting_open(name: str) -> object:
            nonlocal looked
            looked += 1
            return original_open(name)

        monkeypatch.setattr(storage, "open", counting_open)
        seen_between: list[int] = []

        async def other_request() -> None:
            while looked < streams:
                seen_between.append(looked)
                await trio.lowlevel.checkpoint()

        nursery.start_soon(sweep_expired, supervisor, 0.01)
        with trio.fail_after(10):
            await other_request()
            while storage.open("short-lived") is not None:
                await trio.sleep(0.01)
        assert any(0 < count < streams for count in seen_between), "the pass never let another task run"
        # trio runs each ready task once a batch, in random order: two slices may meet across batches.
        assert max(b - a for a, b in itertools.pairwise(seen_between)) <= 2 * SWEEP_SLICE + 1
        nursery.cancel_scope.cancel()


async def test_the_hibernation_sweep_lets_other_tasks_run_while_many_actors_go_to_sleep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Thousands of actors going idle together are put to sleep in slices, with other tasks running
    between them, and an actor that ended while the sweep yielded is not put to sleep twice."""
    streams = 3 * SUPERVISOR_SWEEP_SLICE + 10
    armed = False
    seen_awake: list[int] = []
    original = StreamActor.hibernate_if_idle

    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(new_storage(), nursery, hibernate_after=0.2)

        async def other_request() -> None:
            while supervisor.active:
                seen_awake.append(supervisor.active)
                await trio.lowlevel.checkpoint()

        def hibernate_when_armed(actor: StreamActor, idle_since: float) -> bool:
            if not armed:
                return False
            if not seen_awake:
                seen_awake.append(supervisor.active)
                nursery.start_soon(other_request)
            return original(actor, idle_since)

        monkeypatch.setattr(StreamActor, "hibernate_if_idle", hibernate_when_armed)
        for number in range(streams):
            await supervisor.call(f"s{number}", create(), must_exist=False)
        assert supervisor.active == streams
        woken_again = supervisor.actor("s0", must_exist=True)
        await trio.sleep(0.3)
        armed = True
        with trio.fail_after(10):
            while supervisor.active:
                await trio.sleep(0.01)
        assert any(0 < count < streams for count in seen_awake), "the sweep never let another task run"
        assert not woken_again.alive and supervisor.spawned == streams
        nursery.cancel_scope.cancel()


async def test_many_actors_going_to_sleep_ask_for_their_memory_to_be_given_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """After SWEEP_SLICE actors went to sleep, or some did and none is awake, the supervisor says
    so (the server then hands the freed heap back at once, not at its next minute's trim); a
    sweep that put none to sleep says nothing."""
    calls: list[int] = []
    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(new_storage(), nursery, hibernate_after=1)
        supervisor.many_hibernated = lambda: calls.append(supervisor.active)
        await supervisor.call("one", create(), must_exist=False)
        await trio.sleep(2)
        assert supervisor.active == 0 and calls == [0], "one actor slept and none is awake"

        with supervisor.live_reader("one"):  # stays awake through every sweep below
            for number in range(SUPERVISOR_SWEEP_SLICE + 5):
                await supervisor.call(f"s{number}", create(), must_exist=False)
            await trio.sleep(2)
            assert supervisor.active == 1 and calls == [0, 1], "a slice went to sleep with one awake"
            await trio.sleep(5)
            assert calls == [0, 1], "sweeps that put nobody to sleep said nothing"
        nursery.cancel_scope.cancel()
