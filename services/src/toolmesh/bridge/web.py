"""The bridge's web port: the host-facing RPCs over Connect and gRPC-Web, for pages.

A browser cannot send gRPC (HTTP/2 with trailers), so the bridge also serves
OpenHostSession, SubmitToolResult, SubmitToolResults, DeclareHostTools, AnswerReadCheck,
ReportToolProgress and StartToolRequests over the Connect protocol and gRPC-Web on HTTP/1.1, on a
port of its own, sharing the Router
and Declarations of its gRPC port. The routes come from protoc-gen-connectrpc
(connectrpc, on our protobuf messages); uvicorn serves them.

Who may call: the hosts, as on the gRPC port: the same policy and tokens
(`authorization: Bearer <token>`, a header browsers may send here), and TLS
with the bridge's certificate when it has one. The internal Dispatch RPCs are
never served here (any other path is 404). A browser page may call only from
an origin it is allowed: one of the configured origins, or the port's own
origin; a request from another origin is refused (403) before any RPC runs,
and preflights for it get no CORS grant. Requests without an Origin header
(not from a browser) are served.

DNS rebinding: every request's `Host` must name this port as configured (the
loopback names localhost, 127.0.0.1 and [::1], the bound address, the hosts
of the allowed origins and `--web-hosts`), else 403 (PERMISSION_DENIED) before
anything else; a rebinding page, whose Host is its own name, never reaches the
origin check that trusts the port's own origin.

Slow clients: a request must arrive whole (headers and body) within
REQUEST_READ_S of its connection opening or of the previous response, an idle
keep-alive connection closes after KEEP_ALIVE_S, and at most MAX_CONNECTIONS
connections (MAX_CONNECTIONS_PER_ADDRESS from one client address) are open at
once; a connection over either is closed as it opens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from connectrpc.request import RequestContext

from toolmesh.auth.grants import Role
from toolmesh.auth.guard import Listener, admission, grant_expires_at, scope
from toolmesh.auth.tokens import Verifier
from toolmesh.bridge.declarations import Declarations
from toolmesh.bridge.outcomes import OutcomeRecorder
from toolmesh.bridge.router import Router
from toolmesh.bridge.servicer import (
    answer_read_check,
    declare,
    host_events,
    report_progress,
    start_requests,
    submit,
    submit_many,
)
from toolmesh.core.limits import MAX_MESSAGE_BYTES
from toolmesh.runtime.instrument import until_token_expires
from toolmesh.runtime.web import (
    App,
    ConnectionLimits,
    WebServer,
    add_web_arguments,
    admit,
    allowed_hosts,
    connect_app,
    fail,
    guarded,
    host_name,
    start_web_server,
    web_hosts,
    web_origins,
)
from toolmesh.v1 import bridge_pb2
from toolmesh.v1.bridge_connect import BridgeService, BridgeServiceASGIApplication

__all__ = [
    "DEFAULT_WEB_PORT",
    "HOST_FACING_PATHS",
    "ConnectionLimits",
    "WebBridge",
    "WebServer",
    "add_web_arguments",
    "allowed_hosts",
    "host_name",
    "start_web_server",
    "web_app",
    "web_connect",
    "web_hosts",
    "web_origins",
]

DEFAULT_WEB_PORT = 7404

_SERVICE = "/toolmesh.v1.BridgeService/"
HOST_FACING = (
    "OpenHostSession",
    "SubmitToolResult",
    "SubmitToolResults",
    "DeclareHostTools",
    "AnswerReadCheck",
    "ReportToolProgress",
    "StartToolRequests",
)
HOST_FACING_PATHS = frozenset(_SERVICE + name for name in HOST_FACING)


class WebBridge(BridgeService):
    """The host-facing BridgeService methods for connectrpc: thin, on the gRPC port's own functions,
    each admitted by the same policy as on the gRPC port.

    The Dispatch methods keep the generated bodies (UNIMPLEMENTED), and `guarded`
    never lets a request reach them.
    """

    def __init__(
        self,
        router: Router,
        declarations: Declarations,
        verifier: Verifier | None,
        recorder: OutcomeRecorder | None = None,
    ) -> None:
        self._router = router
        self._recorder = recorder
        self._declarations = declarations
        self._admit = {
            name: admission(f"toolmesh.v1.BridgeService/{name}", Listener.PUBLIC, verifier)
            for name in HOST_FACING
        }

    async def open_host_session(
        self, request: bridge_pb2.OpenHostSessionRequest, ctx: RequestContext[Any, Any]
    ) -> AsyncIterator[bridge_pb2.OpenHostSessionResponse]:
        try:
            await admit(self._admit["OpenHostSession"], request, ctx)
            # As on the gRPC port, the stream ends when the token it was opened with expires.
            async for event in until_token_expires(host_events(self._router, request), grant_expires_at()):
                yield event
        except Exception as exc:
            fail("OpenHostSession", exc)

    async def submit_tool_result(
        self, request: bridge_pb2.SubmitToolResultRequest, ctx: RequestContext[Any, Any]
    ) -> bridge_pb2.SubmitToolResultResponse:
        try:
            await admit(self._admit["SubmitToolResult"], request, ctx)
            return await submit(self._router, self._recorder, request, scope(Role.HOST))
        except Exception as exc:
            fail("SubmitToolResult", exc)

    async def submit_tool_results(
        self, request: bridge_pb2.SubmitToolResultsRequest, ctx: RequestContext[Any, Any]
    ) -> bridge_pb2.SubmitToolResultsResponse:
        try:
            await admit(self._admit["SubmitToolResults"], request, ctx)
            return await submit_many(self._router, self._recorder, request, scope(Role.HOST))
        except Exception as exc:
            fail("SubmitToolResults", exc)

    async def answer_read_check(
        self, request: bridge_pb2.AnswerReadCheckRequest, ctx: RequestContext[Any, Any]
    ) -> bridge_pb2.AnswerReadCheckResponse:
        try:
            await admit(self._admit["AnswerReadCheck"], request, ctx)
            return answer_read_check(self._router, request, scope(Role.HOST))
        except Exception as exc:
            fail("AnswerReadCheck", exc)

    async def report_tool_progress(
        self, request: bridge_pb2.ReportToolProgressRequest, ctx: RequestContext[Any, Any]
    ) -> bridge_pb2.ReportToolProgressResponse:
        try:
            await admit(self._admit["ReportToolProgress"], request, ctx)
            return report_progress(self._router, request, scope(Role.HOST))
        except Exception as exc:
            fail("ReportToolProgress", exc)

    async def start_tool_requests(
        self, request: bridge_pb2.StartToolRequestsRequest, ctx: RequestContext[Any, Any]
    ) -> bridge_pb2.StartToolRequestsResponse:
        try:
            await admit(self._admit["StartToolRequests"], request, ctx)
            return await start_requests(self._router, request, scope(Role.HOST))
        except Exception as exc:
            fail("StartToolRequests", exc)

    async def declare_host_tools(
        self, request: bridge_pb2.DeclareHostToolsRequest, ctx: RequestContext[Any, Any]
    ) -> bridge_pb2.DeclareHostToolsResponse:
        try:
            await admit(self._admit["DeclareHostTools"], request, ctx)
            return await declare(self._declarations, request, scope(Role.HOST))
        except Exception as exc:
            fail("DeclareHostTools", exc)


def web_connect(
    router: Router,
    declarations: Declarations,
    verifier: Verifier | None = None,
    recorder: OutcomeRecorder | None = None,
    *,
    read_max_bytes: int = MAX_MESSAGE_BYTES,
) -> BridgeServiceASGIApplication:
    """The host-facing routes, unguarded (`guarded` with HOST_FACING_PATHS makes them a port)."""
    return connect_app(
        BridgeServiceASGIApplication, WebBridge(router, declarations, verifier, recorder), read_max_bytes
    )


def web_app(
    router: Router,
    declarations: Declarations,
    origins: Iterable[str],
    verifier: Verifier | None = None,
    recorder: OutcomeRecorder | None = None,
    *,
    read_max_bytes: int = MAX_MESSAGE_BYTES,
    hosts: Iterable[str] = (),
) -> App:
    """The web port's application; with a `verifier`, every call needs a token, as on the gRPC port;
    with `recorder`, results handed in after another replica was lost are adopted as on the gRPC port.

    `read_max_bytes`: the largest message it reads (the `message_bytes` limit); `hosts`: the names
    a request's Host may give besides loopback's and the origins' (DNS rebinding).
    """
    connect = web_connect(router, declarations, verifier, recorder, read_max_bytes=read_max_bytes)
    return guarded(connect, HOST_FACING_PATHS, origins, hosts)
