"""An invocation whose result another bridge replica recorded: the replica dispatching it stops
waiting on its own bridge (frozen, or lost) and answers with the ledger's outcome at once."""

from __future__ import annotations

import asyncio

import pytest

from toolmesh.contracts.cancels import RECORDED_KEY, CancelBoard
from toolmesh.contracts.ledger import Ledger
from toolmesh.core.calls import ToolCall, ToolRequest
from toolmesh.core.outcome import Outcome
from toolmesh.invocation.invoker import Invoker
from toolmesh.store.memory import InMemoryStore, MemoryLedgerStore
from toolmesh_testing import OneTool, SlowHost, eventually

pytestmark = pytest.mark.unit

CALL = ToolCall("s", "t", "tool", "{}")


class Dispatched(SlowHost):
    """A bridge that never answers (SlowHost never released): keeps the ids it was sent."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []

    async def dispatch(self, request: ToolRequest, on_progress: object = None) -> Outcome:
        self.ids.append(request.tool_request_id)
        return await super().dispatch(request)


@pytest.mark.parametrize("leaves_early", [True, False])
async def test_a_posted_outcome_ends_the_wait_on_a_silent_bridge_with_the_ledger_s_outcome(
    leaves_early: bool,
) -> None:
    ledger = Ledger(MemoryLedgerStore())
    store = InMemoryStore()
    host = Dispatched()
    invoker = Invoker(OneTool(), host, ledger, recorded_elsewhere=CancelBoard(store, RECORDED_KEY))
    ready = asyncio.Event()
    following = asyncio.create_task(invoker.follow_recorded_elsewhere(ready))
    await ready.wait()
    calling = asyncio.create_task(invoker.invoke(CALL, leaves_early=leaves_early))
    [tool_request_id] = await eventually(lambda: host.ids)
    # Another bridge replica took the host's result and recorded it, then posted its id.
    await ledger.finish(tool_request_id, Outcome.success('{"n": 1}'))
    await CancelBoard(store, RECORDED_KEY).post(tool_request_id)
    result = await asyncio.wait_for(calling, 2)  # long before its 5 s deadline
    assert result.outcome == Outcome.success('{"n": 1}') and result.tool_request_id == tool_request_id
    following.cancel()


async def test_a_post_for_an_invocation_not_dispatched_here_changes_nothing() -> None:
    host = Dispatched()
    invoker = Invoker(OneTool(), host, Ledger(MemoryLedgerStore()))
    calling = asyncio.create_task(invoker.invoke(CALL))
    await eventually(lambda: host.ids)
    invoker.outcome_recorded("tr_someone_else")
    host.release.set()
    result = await asyncio.wait_for(calling, 2)
    assert result.outcome == Outcome.success("1")
    # Without a board, following ends at once, ready.
    ready = asyncio.Event()
    await asyncio.wait_for(invoker.follow_recorded_elsewhere(ready), 1)
    assert ready.is_set()
