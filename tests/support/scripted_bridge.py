"""A base for scripted bridges in tests: every BridgeService method refuses (UNIMPLEMENTED) unless
the test's subclass defines it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from toolmesh.v1 import bridge_pb2_grpc


class ScriptedBridge(bridge_pb2_grpc.BridgeServiceServicer):
    async def OpenHostSession(self, request: Any, context: Any) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this test")
        yield  # never reached: a stream method is an async generator

    async def SubmitToolResult(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this test")

    async def SubmitToolResults(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this test")

    async def DispatchToolRequest(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this test")

    async def DispatchToolRequests(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this test")
        yield  # never reached: a stream method is an async generator

    async def DeclareHostTools(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this test")

    async def AnswerReadCheck(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this test")

    async def ReportToolProgress(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this test")

    async def StartToolRequests(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this test")

    async def ExchangeHostWork(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this test")
        yield  # never reached: a stream method is an async generator


@contextlib.asynccontextmanager
async def scripted(
    bridge: ScriptedBridge, *more: grpc.GenericRpcHandler, port: int = 0
) -> AsyncIterator[str]:
    """`bridge` served on a real port (`port`, or one of its own), with the services `more` handles:
    its address."""
    server = grpc.aio.server()
    bridge_pb2_grpc.add_BridgeServiceServicer_to_server(bridge, server)
    server.add_generic_rpc_handlers(more)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)
