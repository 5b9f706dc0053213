"""The OpenTelemetry MCP conventions (development, semantic conventions 1.44.0) on both MCP sides.

Server side, the gateway: the MCP SDK's own middleware makes the SERVER span of each
request, named `{mcp.method.name} {target}`, with `mcp.method.name`,
`jsonrpc.request.id`, `mcp.protocol.version` and `error.type`, parented on the
request's `_meta.traceparent`; ServerTelemetry, inside it, records
`mcp.server.operation.duration`. Client side, `toolmesh host --mcp`: client_operation
makes the CLIENT span `{mcp.method.name} {target}` around each request to the MCP
server and records `mcp.client.operation.duration`; the SDK's `MCP send` span beneath
it carries the JSON-RPC id and puts the trace context into the request's
`_meta.traceparent`, so the MCP server's spans join the toolmesh trace.

`mcp.session.id` is never set: an MCP session id is a bearer capability, kept out of
logs and spans alike. Metric labels are bounded and name no tenant: the method (one
of MCP's, or `_OTHER`), the protocol version and `error.type`; never a tool's name.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import mcp_types as types
from mcp.server.context import CallNext, HandlerResult, ServerMiddleware, ServerRequestContext
from mcp.shared.exceptions import MCPError
from opentelemetry.trace import SpanKind, Status, StatusCode
from pydantic import ValidationError

from toolmesh.core import telemetry

MCP_METHOD_NAME = "mcp.method.name"
MCP_PROTOCOL_VERSION = "mcp.protocol.version"
# What the conventions call a tools/call whose result is an error (isError).
TOOL_ERROR = "tool_error"
OTHER_METHOD = "_OTHER"
# The conventions' bucket boundaries for both durations, in seconds.
_BUCKETS = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120, 300]

SERVER_DURATION = telemetry.METER.create_histogram(
    "mcp.server.operation.duration",
    unit="s",
    description="MCP requests the gateway served, from receipt to its answer",
    explicit_bucket_boundaries_advisory=_BUCKETS,
)
CLIENT_DURATION = telemetry.METER.create_histogram(
    "mcp.client.operation.duration",
    unit="s",
    description="MCP requests a host sent its MCP server, until the answer",
    explicit_bucket_boundaries_advisory=_BUCKETS,
)

# The methods of MCP (requests and notifications): any other name a client sends is `_OTHER` on a metric.
METHODS = frozenset(
    {
        "initialize",
        "ping",
        "tools/list",
        "tools/call",
        "resources/list",
        "resources/templates/list",
        "resources/read",
        "resources/subscribe",
        "resources/unsubscribe",
        "prompts/list",
        "prompts/get",
        "completion/complete",
        "logging/setLevel",
        "sampling/createMessage",
        "elicitation/create",
        "roots/list",
        "tasks/get",
        "tasks/result",
        "tasks/list",
        "tasks/cancel",
        "subscriptions/listen",
        "server/discover",
        "notifications/initialized",
        "notifications/cancelled",
        "notifications/progress",
        "notifications/message",
        "notifications/roots/list_changed",
        "notifications/resources/list_changed",
        "notifications/resources/updated",
        "notifications/prompts/list_changed",
        "notifications/tools/list_changed",
        "notifications/tasks/status",
    }
)


def _metric_attributes(method: str, protocol_version: str | None, error_type: str | None) -> dict[str, str]:
    attributes = {MCP_METHOD_NAME: method if method in METHODS else OTHER_METHOD}
    if protocol_version:
        attributes[MCP_PROTOCOL_VERSION] = protocol_version
    if error_type is not None:
        attributes[telemetry.ERROR_TYPE] = error_type
    return attributes


def _is_tool_error(result: object) -> bool:
    match result:
        case types.CallToolResult(is_error=True) | {"isError": True}:
            return True
    return False


class ServerTelemetry(ServerMiddleware[Any]):
    """Records mcp.server.operation.duration for every request the gateway serves (see the module)."""

    async def __call__(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        started = time.perf_counter()
        try:
            result = await call_next(ctx)
        except MCPError as error:
            _record_served(ctx, started, str(error.error.code))
            raise
        except ValidationError:
            _record_served(ctx, started, str(types.INVALID_PARAMS))
            raise
        except Exception as error:
            _record_served(ctx, started, type(error).__qualname__)
            raise
        tool_error = ctx.method == "tools/call" and _is_tool_error(result)
        _record_served(ctx, started, TOOL_ERROR if tool_error else None)
        return result


def _record_served(ctx: ServerRequestContext[Any, Any], started: float, error_type: str | None) -> None:
    attributes = _metric_attributes(ctx.method, ctx.protocol_version, error_type)
    SERVER_DURATION.record(time.perf_counter() - started, attributes)


@contextlib.contextmanager
def client_operation(method: str, target: str | None, protocol_version: str | None) -> Iterator[Any]:
    """A request to the MCP server: its CLIENT span (when tracing) and its duration.

    Yields the span (telemetry.NO_SPAN's when not tracing); set_result marks a tool error.
    """
    started = time.perf_counter()
    attributes = {MCP_METHOD_NAME: method}
    if protocol_version:
        attributes[MCP_PROTOCOL_VERSION] = protocol_version
    if method == "tools/call" and target is not None:
        attributes[telemetry.GEN_AI_OPERATION_NAME] = telemetry.EXECUTE_TOOL
        attributes[telemetry.GEN_AI_TOOL_NAME] = target
    operation = _ClientOperation()
    try:
        with telemetry.span(
            f"{method} {target}" if target else method, SpanKind.CLIENT, attributes=attributes
        ) as current:
            operation.span = current
            try:
                yield operation
            except MCPError as error:
                operation.fail(str(error.error.code))
                raise
            except Exception as error:
                operation.fail(type(error).__qualname__)
                raise
    finally:
        CLIENT_DURATION.record(
            time.perf_counter() - started, _metric_attributes(method, protocol_version, operation.error_type)
        )


class _ClientOperation:
    """What client_operation's caller tells it: a result that is a tool error."""

    __slots__ = ("error_type", "span")

    def __init__(self) -> None:
        self.span: Any = None
        self.error_type: str | None = None

    def fail(self, error_type: str) -> None:
        self.error_type = error_type
        if self.span is not None and self.span.is_recording():
            self.span.set_attribute(telemetry.ERROR_TYPE, error_type)
            self.span.set_status(Status(StatusCode.ERROR, error_type))

    def set_result(self, result: object) -> None:
        if _is_tool_error(result):
            self.fail(TOOL_ERROR)
