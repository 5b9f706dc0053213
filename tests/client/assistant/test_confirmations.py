"""Delivery confirmations: carried by the next call when there is one, else sent on their own."""

from __future__ import annotations

import pytest

from toolmesh.client.confirmations import MAX_UNANSWERED, Delivery, PendingConfirmations
from toolmesh_testing import eventually

pytestmark = pytest.mark.unit


class Service:
    def __init__(self, reachable: bool = True) -> None:
        self.received: list[list[str]] = []
        self.reachable = reachable

    async def send(self, deliveries: list[Delivery]) -> bool:
        if not self.reachable:
            return False
        self.received.append([tool_request_id for tool_request_id, _ in deliveries])
        return True


async def test_a_next_call_carries_them_and_nothing_is_sent_alone() -> None:
    service = Service()
    pending = PendingConfirmations(service.send)
    pending.add("tr_1")
    assert pending.take() == [Delivery("tr_1")]  # the caller's next InvokeTool carries it
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


async def test_a_retry_s_outcome_confirms_the_attachments_that_got_none() -> None:
    pending = PendingConfirmations(Service().send, delay_s=10)
    pending.unanswered("tr_1", "1")  # the first call gave up; the service had named its attachment
    pending.unanswered("tr_1", "1")
    pending.unanswered("tr_other", "4")
    pending.add("tr_1", "3")  # the retry's outcome arrived
    assert pending.take() == [Delivery("tr_1", "3"), Delivery("tr_1", "1")]
    pending.add("tr_1", "5")  # already confirmed: not again
    assert pending.take() == [Delivery("tr_1", "5")]
    await pending.close()


async def test_unanswered_calls_are_remembered_within_a_bound() -> None:
    pending = PendingConfirmations(Service().send, delay_s=10)
    for n in range(MAX_UNANSWERED + 5):
        pending.unanswered(f"tr_{n}", "1")
    pending.add("tr_0", "2")  # forgotten: the replay window ends what it holds
    pending.add(f"tr_{MAX_UNANSWERED + 4}", "2")
    assert pending.take() == [
        Delivery("tr_0", "2"),
        Delivery(f"tr_{MAX_UNANSWERED + 4}", "2"),
        Delivery(f"tr_{MAX_UNANSWERED + 4}", "1"),
    ]
    await pending.close()
