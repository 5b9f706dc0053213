"""The registry's read RPCs over Connect and gRPC-Web, for pages (toolmesh.runtime.web).

ListTools, GetTool and WatchTools (server-streaming): each admitted by the same policy as on the
gRPC port, then handed to the gRPC servicer's own method. PutTools is not served here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from connectrpc.request import RequestContext

from toolmesh.auth.guard import Listener, admission, grant_expires_at
from toolmesh.auth.tokens import Verifier
from toolmesh.core.limits import MAX_MESSAGE_BYTES
from toolmesh.registry.registry import Registry
from toolmesh.registry.servicer import RegistryServicer
from toolmesh.runtime.instrument import until_token_expires
from toolmesh.runtime.web import admit, connect_app, fail
from toolmesh.v1 import registry_pb2
from toolmesh.v1.registry_connect import RegistryService, RegistryServiceASGIApplication

READS: Sequence[str] = ("ListTools", "GetTool", "WatchTools")
READ_PATHS = frozenset(f"/toolmesh.v1.RegistryService/{name}" for name in READS)


class WebRegistry(RegistryService):
    """The registry's read methods for connectrpc, on the gRPC servicer's own.

    PutTools keeps its generated body (UNIMPLEMENTED); `guarded` never lets a request reach it.
    """

    def __init__(self, registry: Registry, verifier: Verifier | None) -> None:
        self._servicer = RegistryServicer(registry)
        self._context: Any = None
        self._admit = {
            name: admission(f"toolmesh.v1.RegistryService/{name}", Listener.PUBLIC, verifier)
            for name in READS
        }

    async def list_tools(
        self, request: registry_pb2.ListToolsRequest, ctx: RequestContext[Any, Any]
    ) -> registry_pb2.ListToolsResponse:
        try:
            await admit(self._admit["ListTools"], request, ctx)
            return await self._servicer.ListTools(request, self._context)
        except Exception as exc:
            fail("ListTools", exc)

    async def get_tool(
        self, request: registry_pb2.GetToolRequest, ctx: RequestContext[Any, Any]
    ) -> registry_pb2.GetToolResponse:
        try:
            await admit(self._admit["GetTool"], request, ctx)
            return await self._servicer.GetTool(request, self._context)
        except Exception as exc:
            fail("GetTool", exc)

    async def watch_tools(
        self, request: registry_pb2.WatchToolsRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[registry_pb2.WatchToolsResponse]:
        try:
            await admit(self._admit["WatchTools"], request, ctx)
            # As on the gRPC port, the stream ends when the token it was opened with expires.
            watch = self._servicer.WatchTools(request, self._context)
            async for tools in until_token_expires(watch, grant_expires_at()):
                yield tools
        except Exception as exc:
            fail("WatchTools", exc)


def web_connect(
    registry: Registry, verifier: Verifier | None = None, *, read_max_bytes: int = MAX_MESSAGE_BYTES
) -> RegistryServiceASGIApplication:
    """The read routes, unguarded (`guarded` with READ_PATHS makes them a port)."""
    return connect_app(RegistryServiceASGIApplication, WebRegistry(registry, verifier), read_max_bytes)
