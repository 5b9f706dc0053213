"""The invoker's ports over gRPC: the registry and the bridge as remote services."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from toolmesh.core import telemetry
from toolmesh.core.calls import ToolRequest
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.tools import ToolSpec
from toolmesh.core.wire import outcome_from_pb, request_to_pb, tool_from_pb
from toolmesh.server.outbox import Outbox
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc, registry_pb2, registry_pb2_grpc

log = logging.getLogger("toolmesh.invocation")

# How long a registry lookup may take before the call fails as REGISTRY_UNAVAILABLE.
REGISTRY_TIMEOUT_S = 5.0
# The bridge enforces the tool's deadline itself; this margin only catches a
# bridge that stopped answering.
BRIDGE_GRACE_S = 2.0
DISPATCH_METHOD = "toolmesh.v1.BridgeService/DispatchToolRequests"


class RemoteCatalog:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = registry_pb2_grpc.RegistryServiceStub(channel)

    async def get_tool(self, session_id: str, name: str) -> ToolSpec | None:
        try:
            with telemetry.client_call("toolmesh.v1.RegistryService/GetTool") as metadata:
                response = await self._stub.GetTool(
                    registry_pb2.GetToolRequest(session_id=session_id, name=name),
                    timeout=REGISTRY_TIMEOUT_S,
                    metadata=metadata,
                )
        except grpc.aio.AioRpcError as error:
            if error_code(error) is Code.TOOL_NOT_FOUND:
                return None
            raise ToolmeshError(Code.REGISTRY_UNAVAILABLE, "", {"grpc_status": error.code().name}) from None
        return tool_from_pb(response.tool)


class RemoteDispatcher:
    """Tool requests to the bridge, all on one DispatchToolRequests stream.

    One stream rather than a call per request: a call held for as long as a
    tool runs costs each side about 20 KB, which is most of what a held
    invocation costs. When the stream breaks, the requests on it fail with
    BRIDGE_UNAVAILABLE and the next request opens a new one.
    """

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = bridge_pb2_grpc.BridgeServiceStub(channel)
        self._link: _DispatchLink | None = None

    async def dispatch(self, request: ToolRequest) -> Outcome:
        link = self._link
        if link is None or link.closed:
            link = self._link = _DispatchLink(self._stub)
        tool_request_id = request.tool_request_id
        with telemetry.client_span(DISPATCH_METHOD) as carrier:
            message = request_to_pb(request)
            message.trace_context.update(carrier)
            result = link.send(message)

            def give_up() -> None:  # the bridge enforces the deadline; this catches one that went quiet
                if not result.done():
                    link.cancel(tool_request_id)
                    result.set_result(
                        Outcome.runtime_error(
                            Code.TOOL_TIMEOUT,
                            f"No result within {request.timeout_ms} ms.",
                            {"timeoutMs": request.timeout_ms},
                        )
                    )

            guard = asyncio.get_running_loop().call_later(request.timeout_ms / 1000 + BRIDGE_GRACE_S, give_up)
            try:
                return await result
            except asyncio.CancelledError:
                link.cancel(tool_request_id)
                raise
            finally:
                guard.cancel()

    async def aclose(self) -> None:
        if self._link is not None:
            await self._link.aclose()


class _DispatchLink:
    """One open DispatchToolRequests stream and the requests waiting on it."""

    def __init__(self, stub: bridge_pb2_grpc.BridgeServiceStub) -> None:
        # Requests to send, and the ids of requests to cancel (str).
        self._outbox: Outbox[bridge_pb2.ToolRequest | str] = Outbox(_size)
        self._waiting: dict[str, asyncio.Future[Outcome]] = {}
        self.closed = False
        self._call = stub.DispatchToolRequests(self._messages())
        self._reader = asyncio.create_task(self._read())

    def send(self, request: bridge_pb2.ToolRequest) -> asyncio.Future[Outcome]:
        result: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._waiting[request.tool_request_id] = result
        self._outbox.put(request)
        return result

    def cancel(self, tool_request_id: str) -> None:
        if self._waiting.pop(tool_request_id, None) is not None and not self.closed:
            self._outbox.put(tool_request_id)

    async def aclose(self) -> None:
        self._call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    async def _messages(self) -> AsyncIterator[bridge_pb2.DispatchToolRequestsRequest]:
        while True:
            message = bridge_pb2.DispatchToolRequestsRequest()
            for item in await self._outbox.take():
                if isinstance(item, str):
                    message.cancel_tool_request_ids.append(item)
                else:
                    message.requests.append(item)
            yield message

    async def _read(self) -> None:
        ended = "OK"
        try:
            async for response in self._call:
                for result in response.results:
                    self._settle(result)
        except grpc.aio.AioRpcError as error:
            ended = error.code().name
        except asyncio.CancelledError:
            ended = "CANCELLED"
            raise
        finally:
            self.closed = True
            waiting, self._waiting = self._waiting, {}
            for future in waiting.values():
                if not future.done():
                    future.set_exception(ToolmeshError(Code.BRIDGE_UNAVAILABLE, "", {"grpc_status": ended}))

    def _settle(self, result: bridge_pb2.DispatchResult) -> None:
        future = self._waiting.pop(result.tool_request_id, None)
        if future is None or future.done():
            return  # given up on already
        if result.HasField("outcome"):
            future.set_result(outcome_from_pb(result.outcome))
            return
        # Malformed or duplicate: this service sent what it should not have.
        refusal = result.refusal
        log.error("the bridge refused a tool request", extra={"reason": refusal.reason})
        detail = "The bridge refused the request."
        future.set_exception(ToolmeshError(Code.INTERNAL, detail, {"reason": refusal.reason}))


def _size(item: bridge_pb2.ToolRequest | str) -> int:
    return len(item) if isinstance(item, str) else item.ByteSize()
