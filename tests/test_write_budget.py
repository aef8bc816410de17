"""The bound on fetched bytes waiting for the cache writer (fetcher.ByteBudget)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from cachefs.fetch.byte_budget import ByteBudget


@pytest.mark.trio
async def test_takers_wait_for_room_and_get_it_when_bytes_come_back() -> None:
    budget = ByteBudget(100)
    await budget.take(60)
    await budget.take(40)  # exactly full
    taken: list[int] = []

    async def taker(size: int) -> None:
        await budget.take(size)
        taken.append(size)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(taker, 30)
        await trio.testing.wait_all_tasks_blocked()
        assert taken == []  # no room
        budget.give_back(20)
        await trio.testing.wait_all_tasks_blocked()
        assert taken == []  # 20 free, 30 wanted
        budget.give_back(40)
    assert taken == [30]


@pytest.mark.trio
async def test_a_taker_larger_than_the_limit_waits_until_nothing_is_taken() -> None:
    budget = ByteBudget(100)
    await budget.take(10)
    taken = trio.Event()

    async def large() -> None:
        await budget.take(500)
        taken.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(large)
        await trio.testing.wait_all_tasks_blocked()
        assert not taken.is_set()
        budget.give_back(10)
    assert taken.is_set()
    with trio.move_on_after(0.2) as scope:  # and then it alone holds the budget
        await budget.take(1)
    assert scope.cancelled_caught


@pytest.mark.trio
async def test_fewer_waiting_is_seen_when_a_waiting_taker_gives_up() -> None:
    """The writer-backlog wait (`wait_for_fewer_waiting`) ends when a taker that waited
    is cancelled, with nothing given back: it must not rely on a later give_back."""
    budget = ByteBudget(100)
    await budget.take(100)
    async with trio.open_nursery() as nursery:
        giving_up = trio.CancelScope()

        async def taker() -> None:
            with giving_up:
                await budget.take(10)

        nursery.start_soon(taker)
        await trio.testing.wait_all_tasks_blocked()
        assert budget.waiting == 1
        fewer = trio.Event()

        async def backlog_wait() -> None:
            await budget.wait_for_fewer_waiting(1)
            fewer.set()

        nursery.start_soon(backlog_wait)
        await trio.testing.wait_all_tasks_blocked()
        assert not fewer.is_set()
        giving_up.cancel()
        with trio.fail_after(5):
            await fewer.wait()
        assert budget.waiting == 0
