"""The stream outbox: whatever is ready goes out together, within a byte budget."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from toolmesh.core.outbox import Outbox
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
