"""The process hands freed heap back once a minute, and at once when told many streams went idle
(background.MemoryGiveBack; the supervisor tells it after a slice of actors hibernated)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from streamkeep import background


async def test_a_trim_runs_every_minute_and_soon_after_it_is_asked_for(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    trims: list[float] = []
    monkeypatch.setattr(background, "malloc_trim", lambda: lambda: trims.append(trio.current_time()) or 0)
    give_back = background.MemoryGiveBack(every=60)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(give_back.run)
        await trio.sleep(10)
        assert trims == []
        give_back.soon()
        await trio.sleep(1)
        assert trims == [pytest.approx(10)], "asked for, it ran at once"
        await trio.sleep(60)
        assert trims == [pytest.approx(10), pytest.approx(70)], "then a minute after the last"
        nursery.cancel_scope.cancel()


async def test_without_glibc_it_returns_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(background, "malloc_trim", lambda: None)
    give_back = background.MemoryGiveBack()
    with trio.fail_after(1):
        await give_back.run()
    give_back.soon()  # harmless with nothing running
