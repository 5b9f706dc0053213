"""The stream outbox: whatever is ready goes out together, within a byte budget."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from toolmesh.core.outbox import GATHER_TURNS, Outbox
from toolmesh_testing import eventually

pytestmark = pytest.mark.unit


async def test_takes_everything_ready_at_once_in_order() -> None:
    outbox: Outbox[str] = Outbox(len)
    for item in ("a", "b", "c"):
        outbox.put(item)
    assert await outbox.take() == ["a", "b", "c"]
    assert len(outbox) == 0


async def test_waits_for_the_next_item() -> None:
    outbox: Outbox[str] = Outbox(len)
    take = outbox.take()
    taking = asyncio.ensure_future(take)
    # Started, and suspended on something: with nothing to take, it waits.
    await eventually(lambda: inspect.getcoroutinestate(take) == inspect.CORO_SUSPENDED)
    assert not taking.done()
    outbox.put("late")
    assert await asyncio.wait_for(taking, 1) == ["late"]


async def test_splits_at_the_byte_budget_and_never_holds_back_a_big_item() -> None:
    outbox: Outbox[str] = Outbox(len, batch_bytes=10)
    for item in ("aaaa", "bbbb", "cccc", "x" * 25, "d"):
        outbox.put(item)
    assert await outbox.take() == ["aaaa", "bbbb"]
    assert await outbox.take() == ["cccc"]
    assert await outbox.take() == ["x" * 25]  # larger than the budget: alone
    assert await outbox.take() == ["d"]


async def test_close_hands_out_what_is_left_then_an_empty_batch() -> None:
    outbox: Outbox[str] = Outbox(len)
    outbox.put("last")
    outbox.close()
    assert await outbox.take() == ["last"]
    assert await asyncio.wait_for(outbox.take(), 1) == []


async def test_splits_at_the_item_budget_and_counts_the_bytes_waiting() -> None:
    outbox: Outbox[str] = Outbox(len, batch_items=2)
    for item in ("a", "bb", "ccc", "dddd", "e"):
        outbox.put(item)
    assert outbox.bytes == 11
    assert await outbox.take() == ["a", "bb"]
    assert outbox.bytes == 8
    assert await outbox.take() == ["ccc", "dddd"]
    outbox.clear()
    assert (len(outbox), outbox.bytes) == (0, 0)


async def _put_each_turn(outbox: Outbox[str], items: list[str]) -> None:
    """One item per turn of the event loop, as concurrent calls' sends arrive."""
    for item in items:
        await asyncio.sleep(0)
        outbox.put(item)


async def test_with_more_coming_a_take_gathers_the_items_of_the_next_turns() -> None:
    outbox: Outbox[str] = Outbox(len, more_coming=lambda: len(outbox) < 4)
    outbox.put("a")
    putting = asyncio.ensure_future(_put_each_turn(outbox, ["b", "c", "d", "e"]))
    # Gathers while more are said to come (fewer than 4 waiting), then takes at once.
    assert await outbox.take() == ["a", "b", "c", "d"]
    await putting
    assert await outbox.take() == ["e"]


async def test_a_lone_item_goes_at_once() -> None:
    outbox: Outbox[str] = Outbox(len, more_coming=lambda: False)
    outbox.put("a")
    putting = asyncio.ensure_future(_put_each_turn(outbox, ["b"]))
    assert await outbox.take() == ["a"]  # not the one put a turn later
    await putting
    assert await outbox.take() == ["b"]


async def test_gathering_stops_after_its_turns_though_more_keep_coming() -> None:
    outbox: Outbox[str] = Outbox(len, more_coming=lambda: True)
    outbox.put("first")
    items = [f"i{n}" for n in range(GATHER_TURNS * 3)]
    putting = asyncio.ensure_future(_put_each_turn(outbox, items))
    taken = await outbox.take()
    assert taken[0] == "first"
    # Every item put during its turns, and no more than one per turn: bounded, never a timer.
    assert 1 < len(taken) <= GATHER_TURNS + 1
    putting.cancel()


async def test_a_take_whose_items_were_dropped_while_gathering_waits_for_the_next() -> None:
    outbox: Outbox[str] = Outbox(len, more_coming=lambda: True)
    outbox.put("dropped")
    taking = asyncio.ensure_future(outbox.take())
    await asyncio.sleep(0)
    outbox.clear()
    for _ in range(GATHER_TURNS + 2):  # past its gathering: empty, it waits again
        await asyncio.sleep(0)
    assert not taking.done()
    outbox.put("next")
    assert await asyncio.wait_for(taking, 1) == ["next"]


async def test_an_item_that_may_wait_goes_with_the_next_one() -> None:
    outbox: Outbox[str] = Outbox(len)
    outbox.put("receipt", within_s=60)
    take = outbox.take()
    taking = asyncio.ensure_future(take)
    await eventually(lambda: inspect.getcoroutinestate(take) == inspect.CORO_SUSPENDED)
    for _ in range(GATHER_TURNS + 2):
        await asyncio.sleep(0)
    assert not taking.done()  # it does not wake a take
    outbox.put("start")
    assert await asyncio.wait_for(taking, 1) == ["receipt", "start"]


async def test_an_item_that_may_wait_goes_alone_once_its_time_passed() -> None:
    loop = asyncio.get_running_loop()
    outbox: Outbox[str] = Outbox(len)
    put_at = loop.time()
    outbox.put("receipt", within_s=0.05)
    assert await asyncio.wait_for(outbox.take(), 1) == ["receipt"]
    assert loop.time() - put_at >= 0.04  # the loop's clock may read whole milliseconds


async def test_close_sends_an_item_that_may_wait_at_once() -> None:
    outbox: Outbox[str] = Outbox(len)
    outbox.put("receipt", within_s=60)
    outbox.close()
    assert await asyncio.wait_for(outbox.take(), 1) == ["receipt"]
    assert await asyncio.wait_for(outbox.take(), 1) == []


async def test_items_that_may_wait_and_were_dropped_wake_no_take() -> None:
    outbox: Outbox[str] = Outbox(len)
    outbox.put("dropped", within_s=0.01)
    outbox.clear()
    taking = asyncio.ensure_future(outbox.take())
    await asyncio.sleep(0.05)  # past the dropped item's time: its timer must not wake the take
    assert not taking.done()
    outbox.put("next")
    assert await asyncio.wait_for(taking, 1) == ["next"]
