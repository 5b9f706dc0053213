"""The requests a bridge replica's dispatch streams hold, stopped by cancellations from the store."""

from __future__ import annotations

import asyncio

import pytest

from toolmesh.bridge.cancels import HeldRequests
from toolmesh.contracts.cancels import CancelBoard
from toolmesh.store.memory import InMemoryStore
from toolmesh_testing import eventually

pytestmark = pytest.mark.unit


async def test_a_posted_cancellation_stops_the_request_where_it_is_held() -> None:
    store = InMemoryStore()
    holds = HeldRequests()
    stopped: list[str] = []
    holds.hold("tr_held", stopped.append)
    ready = asyncio.Event()
    following = asyncio.create_task(holds.follow(CancelBoard(store), ready))
    await ready.wait()
    await CancelBoard(store).post("tr_elsewhere")  # held by no stream here: nothing to stop
    await CancelBoard(store).post("tr_held")
    await eventually(lambda: stopped)
    following.cancel()
    assert stopped == ["tr_held"]


def test_a_duplicate_on_another_stream_leaves_the_first_hold() -> None:
    holds = HeldRequests()
    first: list[str] = []
    second: list[str] = []
    holds.hold("tr_1", first.append)
    holds.hold("tr_1", second.append)  # refused by the router, released by its stream
    holds.release("tr_1", second.append)
    holds.cancelled("tr_1")
    assert first == ["tr_1"] and second == []
    holds.release("tr_1", first.append)
    holds.cancelled("tr_1")
    assert first == ["tr_1"]
