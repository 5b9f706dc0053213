"""Overload and shutdown: no outcome is produced, and the caller is told so with a status."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.contracts.ledger import Ledger
from toolmesh.core.calls import ToolCall
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.tools import ToolSpec
from toolmesh.invocation.invoker import Invoker
from toolmesh.store.memory import MemoryLedgerStore
from toolmesh.v1 import invocation_pb2, invocation_pb2_grpc
from toolmesh_testing import HostProcess, OneTool, SlowHost, eventually, start_host_process


def call(n: int) -> ToolCall:
    return ToolCall("s", "t", "tool", f'{{"n": {n}}}')


@pytest.mark.unit
async def test_invoker_refuses_above_its_limit_and_while_stopping() -> None:
    host = SlowHost()
    invoker = Invoker(OneTool(), host, Ledger(MemoryLedgerStore()), max_in_flight=2)
    running = [asyncio.ensure_future(invoker.invoke(call(n))) for n in range(2)]
    await eventually(lambda: host.started == 2)
    with pytest.raises(ToolmeshError) as raised:
        await invoker.invoke(call(3))
    assert raised.value.code is Code.OVERLOADED and raised.value.retryable
    host.release.set()
    assert [(await task).outcome.ok for task in running] == [True, True]
    assert (await invoker.invoke(call(4))).outcome.ok  # room again
    await invoker.drain()
    with pytest.raises(ToolmeshError) as raised:
        await invoker.invoke(call(5))
    assert raised.value.code is Code.SHUTTING_DOWN


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def tight(marker_dir: Path) -> AsyncIterator[tuple[LocalSystem, HostProcess]]:
    system = await start_local_system(max_in_flight=1)
    async with RegistryClient(system.registry_target) as registry:
        await registry.put_tools("tight", [ToolSpec("slow_async", "", '{"type": "object"}', timeout_ms=2000)])
    host = await start_host_process(system.bridge_target, "tight", "e2e_handlers:HANDLERS", marker_dir)
    yield system, host
    await host.stop()
    await system.stop(0.5)


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
async def test_overload_is_resource_exhausted_with_error_info(
    tight: tuple[LocalSystem, HostProcess], marker_dir: Path
) -> None:
    system, _ = tight
    held = f"held-{uuid.uuid4().hex}"
    async with InvocationClient(system.invocation_target) as client:
        first = asyncio.ensure_future(client.invoke("tight", "slow_async", {"marker": held}, turn_id="t"))
        # Its handler runs: the service's one slot is taken while the call is open.
        await eventually((marker_dir / f"started-{held}").exists)
        refused = await client.invoke("tight", "slow_async", {"marker": "b"}, turn_id="t")
        assert refused.outcome is None and refused.code is Code.OVERLOADED
        # The raw RPC: the status, with ErrorInfo.
        async with grpc.aio.insecure_channel(system.invocation_target) as channel:
            stub = invocation_pb2_grpc.InvocationServiceStub(channel)
            request = invocation_pb2.InvokeToolRequest(
                session_id="tight", turn_id="t", tool_name="slow_async", arguments_json='{"marker": "d"}'
            )
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.InvokeTool(request)
        assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_code(raised.value) is Code.OVERLOADED
        first.cancel()
