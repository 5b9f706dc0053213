"""A host whose process paused (SIGSTOP, a laptop lid, a starved loop) reads what its bridge sent
meanwhile before its timers give the bridge up.

On thawing, a receipt wait that timed out during the pause and the bridge's receipt, queued in
the socket, are both due, and the loop runs the timer first. The wait then said "no receipt",
and a host with several bridge addresses left its bridge: every request its handlers were
running ended TOOL_HOST_DISCONNECTED and their results were refused after
(`python -m bench.chaos --seed 97`: host1 paused 4.8 s, four results lost so). A wait that times
out now looks again PAUSE_GRACE_S later, once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from scripted_bridge import ScriptedBridge, scripted

from toolmesh.core.deadlines import PAUSE_GRACE_S
from toolmesh.host.host_work import HostWorkLink
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc, tool_pb2
from toolmesh_testing import eventually

pytestmark = pytest.mark.integration


class LateReceipts(ScriptedBridge):
    """Answers each result on ExchangeHostWork with its receipt `delay_s` later (never: None)."""

    def __init__(self, delay_s: float | None) -> None:
        self.delay_s = delay_s

    async def ExchangeHostWork(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        async for message in request_iterator:
            if self.delay_s is None:
                continue
            await asyncio.sleep(self.delay_s)
            yield bridge_pb2.ExchangeHostWorkResponse(
                receipts=[
                    bridge_pb2.ToolResultReceipt(tool_request_id=r.tool_request_id) for r in message.results
                ]
            )


def result(tool_request_id: str) -> bridge_pb2.ToolResultSubmission:
    return bridge_pb2.ToolResultSubmission(
        tool_request_id=tool_request_id, outcome=tool_pb2.ToolOutcome(result_json="{}")
    )


async def submitted(bridge: LateReceipts, timeout: float, *, pause_s: float = 0) -> tuple[bool | None, float]:
    """Hand one result in on a host work stream with `timeout`, the loop blocked for `pause_s` right
    after (as a stopped process): whether the bridge took it, and how long the wait took."""
    async with scripted(bridge) as target, grpc.aio.insecure_channel(target) as channel:
        link = HostWorkLink(bridge_pb2_grpc.BridgeServiceStub(channel), "hs_1")
        started = time.monotonic()
        submitting = asyncio.ensure_future(link.submit(result("tr_1"), timeout))
        if pause_s:
            asyncio.get_running_loop().call_soon(time.sleep, pause_s)
        taken = await submitting
        waited = time.monotonic() - started
        assert len(link._waits) == 0  # its wait left nothing on the link's timer
        await link.aclose()
        return taken, waited


async def test_a_receipt_read_after_a_pause_that_outlasted_its_wait_is_taken() -> None:
    # The whole process stops past the wait's end; the receipt comes as it thaws.
    taken, _ = await submitted(LateReceipts(delay_s=0.05), timeout=0.2, pause_s=0.4)
    assert taken is True


async def test_a_receipt_a_little_late_is_taken() -> None:
    taken, waited = await submitted(LateReceipts(delay_s=0.1), timeout=0.01)
    assert taken is True and waited < PAUSE_GRACE_S


async def test_a_receipt_that_never_comes_is_given_up_after_the_grace() -> None:
    taken, waited = await submitted(LateReceipts(delay_s=None), timeout=0.1)
    assert taken is None
    assert 0.1 + PAUSE_GRACE_S <= waited < 0.1 + PAUSE_GRACE_S + 2


async def test_a_submit_cancelled_while_its_receipt_is_awaited_leaves_nothing_waiting() -> None:
    async with scripted(LateReceipts(delay_s=None)) as target, grpc.aio.insecure_channel(target) as channel:
        link = HostWorkLink(bridge_pb2_grpc.BridgeServiceStub(channel), "hs_1")
        submitting = asyncio.ensure_future(link.submit(result("tr_1"), 5.0))
        await eventually(lambda: len(link._waits) == 1)
        submitting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submitting
        assert len(link._waits) == 0
        await link.aclose()
