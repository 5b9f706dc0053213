"""The host SDK reads the tool requests a bridge sends together (ToolRequestBatch): each runs once
and is answered on its own. A real bridge; the invocation service's dispatch stream by hand, five
requests in one message, which the bridge queues for the host together."""

from __future__ import annotations

import json
from typing import Any

import pytest

from toolmesh.assembly.system import start_bridge
from toolmesh.host import HostError, ToolContext, ToolHost
from toolmesh.v1 import bridge_pb2
from toolmesh_testing import bridge_stubs, dispatch_together

pytestmark = pytest.mark.integration

SESSION = "request-batches"


async def test_requests_that_come_together_each_run_once_and_are_answered_each() -> None:
    server, _ = await start_bridge()
    ran: list[str] = []
    errors: list[HostError] = []

    async def echo(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
        ran.append(ctx.tool_request_id)
        return {"n": args["n"]}

    host = ToolHost(f"127.0.0.1:{server.port}", SESSION)
    host.on_tool("echo", echo)
    host.on_error(errors.append)
    await host.start()
    ids = [f"batch-{n}" for n in range(5)]
    try:
        async with bridge_stubs(server) as (_, internal):
            answered = await dispatch_together(
                internal,
                [
                    bridge_pb2.ToolRequest(
                        session_id=SESSION,
                        turn_id="turn",
                        tool_request_id=request_id,
                        tool_name="echo",
                        arguments_json=json.dumps({"n": n}),
                        timeout_ms=5000,
                    )
                    for n, request_id in enumerate(ids)
                ],
            )
    finally:
        await host.stop()
        await server.stop(0.1)
    assert answered == {
        request_id: json.dumps({"n": n}, separators=(",", ":")) for n, request_id in enumerate(ids)
    }
    assert sorted(ran) == sorted(ids) and errors == []
