"""Conversions between toolmesh's domain values and their protobuf messages."""

from __future__ import annotations

import math
import time

from toolmesh.core import jsontext
from toolmesh.core.calls import ToolRequest
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.names import require_id, require_tool_name
from toolmesh.core.outcome import ErrorKind, Outcome, ToolFailure
from toolmesh.core.progress import ToolProgress
from toolmesh.core.tools import ToolAnnotations, ToolSpec
from toolmesh.v1 import bridge_pb2, tool_pb2

# The initial-metadata key of InvokeTool that carries the invocation's id ahead of its outcome.
TOOL_REQUEST_ID_METADATA = "toolmesh-tool-request-id"
# Beside it: the call's attachment to that invocation, for its delivery confirmation.
ATTACHMENT_ID_METADATA = "toolmesh-attachment-id"
# Until when an exact retry of the call surely joins or replays its invocation (RFC 3339, UTC):
# sent beside the ids, as `retrySafeUntil` is in an OUTCOME_UNAVAILABLE's ErrorInfo.
RETRY_SAFE_UNTIL_METADATA = "toolmesh-retry-safe-until"

_KIND_TO_PB = {
    ErrorKind.DOMAIN: tool_pb2.ERROR_KIND_DOMAIN,
    ErrorKind.RUNTIME: tool_pb2.ERROR_KIND_RUNTIME,
}
_KIND_FROM_PB = {value: key for key, value in _KIND_TO_PB.items()}


def outcome_to_pb(outcome: Outcome) -> tool_pb2.ToolOutcome:
    failure = outcome.failure
    if failure is None:
        return tool_pb2.ToolOutcome(result_json=outcome.result_json or "")
    return tool_pb2.ToolOutcome(
        error=tool_pb2.ToolError(
            kind=_KIND_TO_PB[failure.kind],
            code=failure.code,
            message=failure.message,
            details_json="" if failure.details is None else jsontext.dumps(failure.details),
            retryable=failure.retryable,
        )
    )


def outcome_from_pb(message: tool_pb2.ToolOutcome) -> Outcome:
    """Read an outcome sent by a peer; raise ToolmeshError(INVALID_REQUEST) if it is malformed.

    The result's JSON text is passed on as it is: whoever accepts it from an
    untrusted peer checks it (the bridge does, on SubmitToolResult).
    """
    which = message.WhichOneof("outcome")
    if which == "result_json":
        return Outcome.success(message.result_json)
    if which != "error":
        raise ToolmeshError(Code.INVALID_REQUEST, "The outcome holds neither a result nor an error.")
    error = message.error
    kind = _KIND_FROM_PB.get(error.kind)
    if kind is None:
        raise ToolmeshError(Code.INVALID_REQUEST, "The error's kind is unspecified.", {"field": "kind"})
    if not error.code or not error.message:
        raise ToolmeshError(Code.INVALID_REQUEST, "An error needs a code and a message.", {"field": "error"})
    details = None
    if error.details_json:
        try:
            details = jsontext.parse(error.details_json)
        except jsontext.NotPlainJson:
            raise ToolmeshError(
                Code.INVALID_REQUEST, "The error's details are not JSON.", {"field": "details_json"}
            ) from None
        if not isinstance(details, dict):
            raise ToolmeshError(
                Code.INVALID_REQUEST, "The error's details must be a JSON object.", {"field": "details_json"}
            )
    return Outcome.error(ToolFailure(kind, error.code, error.message, details, error.retryable))


def tool_to_pb(tool: ToolSpec) -> tool_pb2.ToolDefinition:
    return tool_pb2.ToolDefinition(
        name=tool.name,
        description=tool.description,
        input_schema_json=tool.input_schema_json,
        output_schema_json=tool.output_schema_json,
        timeout_ms=tool.timeout_ms,
        annotations=tool_pb2.ToolAnnotations(
            read_only=tool.annotations.read_only,
            idempotent=tool.annotations.idempotent,
            requires_confirmation=tool.annotations.requires_confirmation,
        ),
    )


def tool_from_pb(message: tool_pb2.ToolDefinition) -> ToolSpec:
    return ToolSpec(
        name=message.name,
        description=message.description,
        input_schema_json=message.input_schema_json,
        output_schema_json=message.output_schema_json,
        timeout_ms=message.timeout_ms,
        annotations=ToolAnnotations(
            read_only=message.annotations.read_only,
            idempotent=message.annotations.idempotent,
            requires_confirmation=message.annotations.requires_confirmation,
        ),
    )


def request_to_pb(request: ToolRequest) -> bridge_pb2.ToolRequest:
    return bridge_pb2.ToolRequest(
        session_id=request.session_id,
        turn_id=request.turn_id,
        tool_request_id=request.tool_request_id,
        tool_name=request.tool_name,
        arguments_json=request.arguments_json,
        timeout_ms=request.timeout_ms,
        trace_context=dict(request.trace_context),
        redeliverable=request.redeliverable,
        deadline_unix_ms=request.deadline_unix_ms,
        invocation_deadline_unix_ms=request.invocation_deadline_unix_ms,
        dispatch_generation=request.dispatch_generation,
    )


def request_from_pb(message: bridge_pb2.ToolRequest) -> ToolRequest:
    """Read a tool request from the invocation service; raise ToolmeshError(INVALID_REQUEST) if malformed.

    Its deadline_unix_ms is left out: the bridge sets its own, from `time_left_ms`.
    """
    require_id(message.session_id, "session_id")
    require_id(message.turn_id, "turn_id")
    require_id(message.tool_request_id, "tool_request_id")
    require_tool_name(message.tool_name)
    if message.timeout_ms <= 0:
        raise ToolmeshError(Code.INVALID_REQUEST, "timeout_ms must be positive.", {"field": "timeout_ms"})
    return ToolRequest(
        session_id=message.session_id,
        turn_id=message.turn_id,
        tool_request_id=message.tool_request_id,
        tool_name=message.tool_name,
        arguments_json=message.arguments_json,
        timeout_ms=message.timeout_ms,
        trace_context=dict(message.trace_context),
        redeliverable=message.redeliverable,
        invocation_deadline_unix_ms=message.invocation_deadline_unix_ms,
        dispatch_generation=message.dispatch_generation,
    )


def time_left_ms(request: ToolRequest) -> int:
    """The time a bridge gives a request it reads now: its timeout_ms, cut to what is left until
    its invocation's deadline when the request carries one (0 when that has passed: the router
    then ends it with TOOL_TIMEOUT, never sending it to a host)."""
    if not request.invocation_deadline_unix_ms:
        return request.timeout_ms
    left_ms = request.invocation_deadline_unix_ms - math.floor(time.time() * 1000)
    return max(0, min(request.timeout_ms, left_ms))


def progress_to_pb(progress: ToolProgress) -> tool_pb2.ToolProgress:
    message = tool_pb2.ToolProgress(
        tool_request_id=progress.tool_request_id, progress=progress.progress, message=progress.message or ""
    )
    if progress.total is not None:
        message.total = progress.total
    return message


def progress_from_pb(message: tool_pb2.ToolProgress) -> ToolProgress:
    return ToolProgress(
        tool_request_id=message.tool_request_id,
        progress=message.progress,
        total=message.total if message.HasField("total") else None,
        message=message.message or None,
    )
