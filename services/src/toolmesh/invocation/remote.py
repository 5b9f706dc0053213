"""The invoker's ports over gRPC: the registry (lookups, and watches for the cache) and the bridge."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator

import grpc

from toolmesh.client.registry import RegistryClient
from toolmesh.core import telemetry
from toolmesh.core.calls import ToolRequest
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.stream_link import StreamBroken, StreamLink
from toolmesh.core.tools import ToolSet, ToolSpec
from toolmesh.core.wire import outcome_from_pb, request_to_pb, tool_from_pb
from toolmesh.invocation.catalog_cache import (
    DEFAULT_IDLE_S,
    DEFAULT_MAX_SESSIONS,
    WatchedCatalog,
    WatchSource,
    unavailable,
)
from toolmesh.invocation.ports import REGISTRY_TIMEOUT_S
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc, registry_pb2, registry_pb2_grpc

log = logging.getLogger("toolmesh.invocation")

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
            raise ToolmeshError(Code.REGISTRY_UNAVAILABLE, "", {"grpcStatus": error.code().name}) from None
        return tool_from_pb(response.tool)


def registry_watch_source(client: RegistryClient) -> WatchSource:
    """WatchTools through `client`, its gRPC failures as REGISTRY_UNAVAILABLE."""

    async def watch(session_id: str) -> AsyncGenerator[ToolSet, None]:
        try:
            async with contextlib.aclosing(client.watch_tools(session_id)) as updates:
                async for tools in updates:
                    yield tools
        except grpc.aio.AioRpcError as error:
            raise unavailable(session_id, grpcStatus=error.code().name) from None

    return watch


def cached_registry_catalog(
    registry_target: str,
    channel: grpc.aio.Channel,
    *,
    max_sessions: int = DEFAULT_MAX_SESSIONS,
    idle_s: float = DEFAULT_IDLE_S,
) -> WatchedCatalog:
    """The invocation service's catalog: watches over `channel`, direct GetTool as the fallback."""
    return WatchedCatalog(
        registry_watch_source(RegistryClient(registry_target, channel=channel)),
        RemoteCatalog(channel),
        max_sessions=max_sessions,
        idle_s=idle_s,
    )


class RemoteDispatcher:
    """Tool requests to the bridge, all on one DispatchToolRequests stream.

    One stream rather than a call per request: a call held for as long as a
    tool runs costs each side about 20 KB, which is most of what a held
    invocation costs. When the stream breaks, the requests on it fail with
    BRIDGE_UNAVAILABLE and the next request opens a new one.
    """

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = bridge_pb2_grpc.BridgeServiceStub(channel)
        self._link: DispatchLink | None = None

    def _open_link(self) -> DispatchLink:
        link = self._link
        if link is None or link.closed:
            link = self._link = StreamLink(
                self._stub.DispatchToolRequests,
                batch=_dispatch_message,
                size_of=_size,
                results_of=lambda response: response.results,
                key_of=lambda result: result.tool_request_id,
            )
        return link

    async def dispatch(self, request: ToolRequest) -> Outcome:
        link = self._open_link()
        tool_request_id = request.tool_request_id
        with telemetry.client_span(DISPATCH_METHOD) as carrier:
            message = request_to_pb(request)
            message.trace_context.update(carrier)
            result = link.expect(tool_request_id)
            link.send(message)
            # The bridge enforces the deadline; this only catches a bridge that went quiet.
            guard = asyncio.get_running_loop().call_later(
                request.timeout_ms / 1000 + BRIDGE_GRACE_S, _give_up, result
            )
            try:
                return _outcome_of(await result)
            except StreamBroken as broken:
                raise _unavailable(broken) from None
            except TimeoutError:
                detail = f"No result within {request.timeout_ms} ms."
                return Outcome.runtime_error(Code.TOOL_TIMEOUT, detail, {"timeoutMs": request.timeout_ms})
            finally:
                guard.cancel()
                # Not answered (gave up, or this wait was cancelled): tell the bridge to stop it.
                if link.forget(tool_request_id) and not link.closed:
                    link.send(tool_request_id)

    async def aclose(self) -> None:
        if self._link is not None:
            await self._link.aclose()


DispatchLink = StreamLink[
    bridge_pb2.ToolRequest | str,
    bridge_pb2.DispatchToolRequestsRequest,
    bridge_pb2.DispatchToolRequestsResponse,
    bridge_pb2.DispatchResult,
]


def _dispatch_message(batch: list[bridge_pb2.ToolRequest | str]) -> bridge_pb2.DispatchToolRequestsRequest:
    """Requests, and the ids (str) of requests to cancel, in one message."""
    message = bridge_pb2.DispatchToolRequestsRequest()
    for item in batch:
        if isinstance(item, str):
            message.cancel_tool_request_ids.append(item)
        else:
            message.requests.append(item)
    return message


def _unavailable(broken: StreamBroken) -> ToolmeshError:
    metadata = {"grpcStatus": broken.status}
    refused = error_code(broken.error) if broken.error is not None else None
    if refused is not None:
        # The bridge answered but would not take the stream: a configuration to fix, not an outage.
        metadata["reason"] = refused.value
        log.error("the bridge refused the dispatch stream", extra={"reason": refused.value})
    return ToolmeshError(Code.BRIDGE_UNAVAILABLE, "", metadata)


def _give_up(result: asyncio.Future[bridge_pb2.DispatchResult]) -> None:
    if not result.done():
        result.set_exception(TimeoutError())


def _outcome_of(result: bridge_pb2.DispatchResult) -> Outcome:
    if result.HasField("outcome"):
        return outcome_from_pb(result.outcome)
    # Malformed or duplicate: this service sent what it should not have.
    refusal = result.refusal
    log.error("the bridge refused a tool request", extra={"reason": refusal.reason})
    raise ToolmeshError(Code.INTERNAL, "The bridge refused the request.", {"reason": refusal.reason})


def _size(item: bridge_pb2.ToolRequest | str) -> int:
    return len(item) if isinstance(item, str) else item.ByteSize()
