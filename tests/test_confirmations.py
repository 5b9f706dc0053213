"""Delivery confirmations: carried by the next call when there is one, else sent on their own."""

from __future__ import annotations

import pytest

from toolmesh.client.confirmations import PendingConfirmations
from toolmesh_testing import eventually

pytestmark = pytest.mark.unit


class Service:
    def __init__(self, reachable: bool = True) -> None:
        self.received: list[list[str]] = []
        self.reachable = reachable

    async def send(self, ids: list[str]) -> bool:
        if not self.reachable:
            return False
        self.received.append(ids)
        return True


async def test_a_next_call_carries_them_and_nothing_is_sent_alone() -> None:
    service = Service()
    pending = PendingConfirmations(service.send)
    pending.add("tr_1")
    assert pending.take() == ["tr_1"]  # the caller's next InvokeTool carries it
    pending.add("tr_2")  # none carries this one
    # Whatever goes alone goes in one batch: once it went, tr_1 was not in it.
    await eventually(lambda: service.received)
    assert service.received == [["tr_2"]]


async def test_when_no_call_follows_they_go_in_one_batch() -> None:
    service = Service()
    pending = PendingConfirmations(service.send)
    for n in range(3):
        pending.add(f"tr_{n}")
    await eventually(lambda: service.received)
    assert service.received == [["tr_0", "tr_1", "tr_2"]]


async def test_given_back_ids_are_sent_again_and_close_flushes() -> None:
    service = Service(reachable=False)
    pending = PendingConfirmations(service.send, delay_s=10)
    pending.add("tr_1")
    carried = pending.take()
    pending.give_back(carried)  # that call failed on the way
    service.reachable = True
    await pending.close()
    assert service.received == [["tr_1"]]
