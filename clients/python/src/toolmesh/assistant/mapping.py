"""How the outcome of a tool call becomes a turn code: the one place that decides it.

| what the invocation gave                      | turn code          | the turn   |
| --------------------------------------------- | ------------------ | ---------- |
| a result                                      | (ok)               | goes on    |
| a domain error (the handler's own code)       | EXECUTION_FAILED   | goes on    |
| TOOL_NOT_FOUND, TOOL_HANDLER_NOT_FOUND,        | TOOL_UNAVAILABLE   | goes on    |
| TOOL_HOST_UNAVAILABLE, REGISTRY_UNAVAILABLE,   |                    |            |
| STORE_UNAVAILABLE, OVERLOADED, SHUTTING_DOWN,  |                    |            |
| UNAUTHENTICATED, PERMISSION_DENIED (nothing    |                    |            |
| ran)                                          |                    |            |
| TOOL_ARGS_INVALID                             | INVALID_ARGUMENTS  | goes on    |
| TOOL_HANDLER_ERROR, TOOL_RESULT_INVALID,       | EXECUTION_FAILED   | goes on    |
| TOOL_HOST_DISCONNECTED, BRIDGE_UNAVAILABLE,    |                    |            |
| TRANSPORT_FAILED, OUTCOME_UNAVAILABLE,         |                    |            |
| INVALID_REQUEST, INTERNAL,                     |                    |            |
| and any code this version does not know       |                    |            |
| TOOL_TIMEOUT, CALLER_DEADLINE_EXCEEDED         | TIMEOUT            | ends       |
| TOOL_CANCELLED (a caller cancelled the call)   | ABORTED            | ends       |

Whether the turn ends is the turn code's `ends_turn` in the turn-code table
(toolmesh.assistant.errors); the runtime table has no say in it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from toolmesh.assistant.errors import TurnCode
from toolmesh.assistant.results import ToolResult
from toolmesh.client.invocation import CallResult
from toolmesh.core import jsontext
from toolmesh.core.errors import Code
from toolmesh.core.outcome import ErrorKind

RUNTIME_TO_TURN: Mapping[Code, TurnCode] = MappingProxyType(
    {
        Code.TOOL_NOT_FOUND: TurnCode.TOOL_UNAVAILABLE,
        Code.TOOL_HANDLER_NOT_FOUND: TurnCode.TOOL_UNAVAILABLE,
        Code.TOOL_HOST_UNAVAILABLE: TurnCode.TOOL_UNAVAILABLE,
        Code.REGISTRY_UNAVAILABLE: TurnCode.TOOL_UNAVAILABLE,
        Code.STORE_UNAVAILABLE: TurnCode.TOOL_UNAVAILABLE,
        Code.OVERLOADED: TurnCode.TOOL_UNAVAILABLE,
        Code.SHUTTING_DOWN: TurnCode.TOOL_UNAVAILABLE,
        Code.UNAUTHENTICATED: TurnCode.TOOL_UNAVAILABLE,
        Code.PERMISSION_DENIED: TurnCode.TOOL_UNAVAILABLE,
        Code.TOOL_ARGS_INVALID: TurnCode.INVALID_ARGUMENTS,
        Code.TOOL_HANDLER_ERROR: TurnCode.EXECUTION_FAILED,
        Code.TOOL_RESULT_INVALID: TurnCode.EXECUTION_FAILED,
        Code.TOOL_HOST_DISCONNECTED: TurnCode.EXECUTION_FAILED,
        Code.BRIDGE_UNAVAILABLE: TurnCode.EXECUTION_FAILED,
        Code.TRANSPORT_FAILED: TurnCode.EXECUTION_FAILED,
        Code.OUTCOME_UNAVAILABLE: TurnCode.EXECUTION_FAILED,
        Code.INVALID_REQUEST: TurnCode.EXECUTION_FAILED,
        Code.INTERNAL: TurnCode.EXECUTION_FAILED,
        Code.TOOL_TIMEOUT: TurnCode.TIMEOUT,
        Code.CALLER_DEADLINE_EXCEEDED: TurnCode.TIMEOUT,
        Code.TOOL_CANCELLED: TurnCode.ABORTED,
    }
)
DOMAIN_ERROR = TurnCode.EXECUTION_FAILED
UNKNOWN_CODE = TurnCode.EXECUTION_FAILED


def turn_code(outcome_code: str, kind: ErrorKind = ErrorKind.RUNTIME) -> TurnCode:
    """The turn code of a failed call: its runtime code, or a domain error's own code."""
    if kind is ErrorKind.DOMAIN:
        return DOMAIN_ERROR
    try:
        return RUNTIME_TO_TURN.get(Code(outcome_code), UNKNOWN_CODE)
    except ValueError:
        return UNKNOWN_CODE


def tool_result(call: CallResult) -> ToolResult:
    """The ToolResult of an invocation, with or without an outcome."""
    if call.outcome is None:
        code = call.code or Code.TRANSPORT_FAILED
        detail = f"No outcome arrived ({code.value}); the tool may or may not have run. {call.detail}"
        return ToolResult.failure(turn_code(code.value), detail.strip(), cause=code.value)
    failure = call.outcome.failure
    if failure is None:
        assert call.outcome.result_json is not None
        try:
            return ToolResult.success(call.outcome.result_json)
        except jsontext.NotPlainJson:
            return ToolResult.failure(TurnCode.EXECUTION_FAILED, "The result is not JSON.", cause="not_json")
    detail = f"[{failure.code}] {failure.message}"
    details = failure.details or {}
    violations = details.get("violations")
    if isinstance(violations, list):
        detail += " " + describe_violations(
            (str(v.get("path", "")), str(v.get("message", ""))) for v in violations if isinstance(v, dict)
        )
    return ToolResult.failure(
        turn_code(failure.code, failure.kind), detail, cause=failure.code, data=failure.details
    )


def describe_violations(violations: Iterable[tuple[str, str]]) -> str:
    """Schema violations as one line the model can act on: `/path: message; ...`."""
    return "; ".join(f"{path or '/'}: {message}" for path, message in violations)
