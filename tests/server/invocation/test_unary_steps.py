"""A unary call's claim and run without the tasks and shields they no longer need.

On a store in memory the claim completes without suspending, so a unary caller claims in its own
task; its run goes on in a task of its own that hands the outcome straight to the caller. Whatever
the caller does meanwhile, the outcome is the same as before: the invocation runs once, to its end,
and its outcome or error reaches every caller waiting for it, and nothing is left unretrieved.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from typing import Any

import pytest
import pytest_asyncio

from toolmesh.contracts.ledger import InvocationRecord, InvocationState, Ledger
from toolmesh.core.calls import ToolCall, ToolRequest
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome
from toolmesh.core.tools import ToolSpec
from toolmesh.invocation.invoker import Invoker
from toolmesh.invocation.ports import NoInvocationObserver
from toolmesh.store.memory import MemoryLedgerStore
from toolmesh.store.redis_ledger import RedisLedgerStore
from toolmesh_testing import eventually

pytestmark = pytest.mark.unit

CALL = ToolCall("s", "t", "tool", '{"n": 1}')


class OneTool:
    async def get_tool(self, session_id: str, name: str) -> ToolSpec | None:
        return ToolSpec(name, "", '{"type": "object"}', timeout_ms=5000)


class HeldHost:
    """Stands in for the bridge: holds each request until released, then answers or fails it."""

    def __init__(self, failure: Code | None = None) -> None:
        self.dispatched = asyncio.Event()
        self.release = asyncio.Event()
        self.requests: list[str] = []
        self._failure = failure

    async def dispatch(self, request: ToolRequest, on_progress: object = None) -> Outcome:
        self.requests.append(request.tool_request_id)
        self.dispatched.set()
        await self.release.wait()
        if self._failure is not None:
            raise ToolmeshError(self._failure)
        return Outcome.success('{"ok": true}')


class JoinSeen(NoInvocationObserver):
    """Tells when a call has joined a running invocation."""

    def __init__(self) -> None:
        self.joined = asyncio.Event()

    def attached(self, record: InvocationRecord, how: str) -> AbstractContextManager[None]:
        if how == "joined":
            self.joined.set()
        return super().attached(record, how)


@pytest_asyncio.fixture
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """What the event loop reports meanwhile (an exception never retrieved, for one)."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    yield reported
    loop.set_exception_handler(None)


async def test_a_claim_on_the_memory_store_completes_without_suspending() -> None:
    ledger = Ledger(MemoryLedgerStore())
    assert ledger.claims_at_once
    assert not RedisLedgerStore.synchronous
    # One step of each claim's coroutine finishes it: no await in it suspends, so a caller's
    # cancellation cannot reach it half made.
    for new_id, is_new in (("tr_1", True), ("tr_2", False)):
        claiming = ledger.claim(CALL, new_id, 5000)
        with pytest.raises(StopIteration) as done:
            claiming.send(None)
        claim = done.value.value
        assert claim.is_new is is_new and claim.record.tool_request_id == "tr_1"


async def left_early(host: HeldHost, invoker: Invoker, state: InvocationState) -> str:
    """A unary call whose caller leaves once its request is dispatched; the host then answers.

    Returns the invocation's id once the ledger has it ended in `state` and its task is over.
    """
    caller = asyncio.ensure_future(invoker.invoke(CALL))
    await host.dispatched.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    host.release.set()
    (tool_request_id,) = host.requests

    async def ended() -> bool:
        record = await invoker.ledger.get(tool_request_id)
        return record is not None and record.state is state

    await eventually(ended)
    await eventually(lambda: not invoker._running)  # its task is over
    return tool_request_id


async def test_a_unary_caller_that_leaves_after_its_claim_leaves_its_invocation_running(
    loop_errors: list[dict[str, Any]],
) -> None:
    host = HeldHost()
    invoker = Invoker(OneTool(), host, Ledger(MemoryLedgerStore()))
    tool_request_id = await left_early(host, invoker, InvocationState.COMPLETED)
    retried = await invoker.invoke(CALL)  # its exact retry replays the outcome: nothing runs again
    assert retried.replayed and retried.tool_request_id == tool_request_id and retried.outcome.ok
    assert host.requests == [tool_request_id]
    gc.collect()
    assert loop_errors == []


async def test_a_run_that_fails_raises_its_error_to_its_caller_and_to_a_call_that_joined_it(
    loop_errors: list[dict[str, Any]],
) -> None:
    host = HeldHost(Code.BRIDGE_UNAVAILABLE)
    observer = JoinSeen()
    invoker = Invoker(OneTool(), host, Ledger(MemoryLedgerStore()), observer=observer)
    first = asyncio.ensure_future(invoker.invoke(CALL))
    await host.dispatched.wait()
    second = asyncio.ensure_future(invoker.invoke(CALL))
    await observer.joined.wait()
    host.release.set()
    for call in (first, second):
        with pytest.raises(ToolmeshError) as failed:
            await call
        assert failed.value.code is Code.BRIDGE_UNAVAILABLE
    assert len(host.requests) == 1
    gc.collect()
    assert loop_errors == []


async def test_a_run_that_fails_after_its_caller_left_leaves_no_error_unretrieved(
    loop_errors: list[dict[str, Any]],
) -> None:
    host = HeldHost(Code.BRIDGE_UNAVAILABLE)
    invoker = Invoker(OneTool(), host, Ledger(MemoryLedgerStore()))
    await left_early(host, invoker, InvocationState.FAILED)
    gc.collect()
    assert loop_errors == []
