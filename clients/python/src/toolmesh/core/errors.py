"""The one error table of toolmesh.

Every code the runtime, the bridge, the host SDK or the CLI can produce is a
row here: its gRPC status when it fails an RPC, whether the same call may be
retried as it is, whether it ends an assistant turn, and the message shown to
people. Nothing else decides these. (A tool call's code reaches an assistant
turn through toolmesh.assistant.mapping; its `ends_turn` is that of the turn code
it maps to, and a test keeps the two in step.)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import grpc

DOMAIN = "toolmesh"


class Code(enum.StrEnum):
    # Outcomes of a tool call (carried inside a successful InvokeTool response).
    TOOL_NOT_FOUND = "TOOL_NOT_FOUND"
    TOOL_ARGS_INVALID = "TOOL_ARGS_INVALID"
    TOOL_HANDLER_NOT_FOUND = "TOOL_HANDLER_NOT_FOUND"
    TOOL_HANDLER_ERROR = "TOOL_HANDLER_ERROR"
    TOOL_RESULT_INVALID = "TOOL_RESULT_INVALID"
    TOOL_TIMEOUT = "TOOL_TIMEOUT"
    TOOL_HOST_UNAVAILABLE = "TOOL_HOST_UNAVAILABLE"
    TOOL_HOST_DISCONNECTED = "TOOL_HOST_DISCONNECTED"
    # Reported by the host SDK to its error callbacks.
    SUBMIT_TOOL_RESULT_FAILED = "SUBMIT_TOOL_RESULT_FAILED"
    # Failed RPCs: no outcome was produced.
    INVALID_REQUEST = "INVALID_REQUEST"
    INVALID_SCHEMA = "INVALID_SCHEMA"
    REVISION_CONFLICT = "REVISION_CONFLICT"
    REGISTRY_UNAVAILABLE = "REGISTRY_UNAVAILABLE"
    BRIDGE_UNAVAILABLE = "BRIDGE_UNAVAILABLE"
    OVERLOADED = "OVERLOADED"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    INTERNAL = "INTERNAL"
    # Reasons SubmitToolResult refuses a result.
    REQUEST_UNKNOWN = "REQUEST_UNKNOWN"
    REQUEST_FOREIGN = "REQUEST_FOREIGN"
    REQUEST_ENDED = "REQUEST_ENDED"
    REQUEST_DUPLICATE = "REQUEST_DUPLICATE"
    HOST_SESSION_UNKNOWN = "HOST_SESSION_UNKNOWN"
    # The invocation ledger.
    IDEMPOTENCY_KEY_REUSED = "IDEMPOTENCY_KEY_REUSED"
    INVOCATION_NOT_FOUND = "INVOCATION_NOT_FOUND"
    INVOCATION_RUNNING = "INVOCATION_RUNNING"
    RESULT_NOT_JSON = "RESULT_NOT_JSON"
    RESULT_TOO_LARGE = "RESULT_TOO_LARGE"
    # Who may do what: refused before anything ran.
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    WRONG_LISTENER = "WRONG_LISTENER"
    # Seen by a caller that received no outcome at all.
    CALLER_DEADLINE_EXCEEDED = "CALLER_DEADLINE_EXCEEDED"
    TRANSPORT_FAILED = "TRANSPORT_FAILED"
    # Turn codes of the assistant (toolmesh.assistant); INVALID_SCHEMA above is one too.
    # How tool-call outcomes become these: toolmesh/assistant/mapping.py.
    UNSUPPORTED_WEBMCP = "UNSUPPORTED_WEBMCP"
    DISCOVERY_FAILED = "DISCOVERY_FAILED"
    TOOL_UNAVAILABLE = "TOOL_UNAVAILABLE"
    STALE_TOOLS = "STALE_TOOLS"
    INVALID_ARGUMENTS = "INVALID_ARGUMENTS"
    EXECUTION_FAILED = "EXECUTION_FAILED"
    CONFIRMATION_DENIED = "CONFIRMATION_DENIED"
    ABORTED = "ABORTED"
    TIMEOUT = "TIMEOUT"
    MODEL_ERROR = "MODEL_ERROR"
    TURN_LIMIT = "TURN_LIMIT"
    BUSY = "BUSY"


@dataclass(frozen=True, slots=True)
class ErrorSpec:
    status: grpc.StatusCode
    retryable: bool
    ends_turn: bool
    message: str


S = grpc.StatusCode

_TABLE: dict[Code, ErrorSpec] = {
    Code.TOOL_NOT_FOUND: ErrorSpec(S.NOT_FOUND, False, False, "The session has no tool of that name."),
    Code.TOOL_ARGS_INVALID: ErrorSpec(
        S.INVALID_ARGUMENT, False, False, "The arguments are not a JSON object or do not match the schema."
    ),
    Code.TOOL_HANDLER_NOT_FOUND: ErrorSpec(
        S.UNIMPLEMENTED, False, False, "The handler host has no handler for this tool."
    ),
    Code.TOOL_HANDLER_ERROR: ErrorSpec(S.INTERNAL, False, False, "The tool's handler failed."),
    Code.TOOL_RESULT_INVALID: ErrorSpec(
        S.INTERNAL, False, False, "The tool's handler returned a value that is not plain JSON, or too much."
    ),
    Code.TOOL_TIMEOUT: ErrorSpec(
        S.DEADLINE_EXCEEDED, False, True, "The tool did not answer before its deadline; the call has ended."
    ),
    Code.TOOL_HOST_UNAVAILABLE: ErrorSpec(
        S.UNAVAILABLE, True, False, "No handler host serves this session right now; the tool did not run."
    ),
    Code.TOOL_HOST_DISCONNECTED: ErrorSpec(
        S.UNAVAILABLE, False, False, "The handler host went away during the call; the tool may have run."
    ),
    Code.SUBMIT_TOOL_RESULT_FAILED: ErrorSpec(
        S.FAILED_PRECONDITION, False, False, "The tool's result could not be handed back to the runtime."
    ),
    Code.INVALID_REQUEST: ErrorSpec(S.INVALID_ARGUMENT, False, False, "The request is malformed."),
    Code.INVALID_SCHEMA: ErrorSpec(S.INVALID_ARGUMENT, False, True, "A tool definition is not valid."),
    Code.REVISION_CONFLICT: ErrorSpec(
        S.ABORTED, False, False, "The tool list changed since the revision the caller expected."
    ),
    Code.REGISTRY_UNAVAILABLE: ErrorSpec(
        S.UNAVAILABLE, True, False, "The tool registry could not be reached; the tool did not run."
    ),
    Code.BRIDGE_UNAVAILABLE: ErrorSpec(
        S.UNAVAILABLE, True, False, "The bridge could not be reached; the outcome is unknown."
    ),
    Code.OVERLOADED: ErrorSpec(S.RESOURCE_EXHAUSTED, True, False, "The service is overloaded; try again."),
    Code.SHUTTING_DOWN: ErrorSpec(S.UNAVAILABLE, True, False, "The service is shutting down; try again."),
    Code.INTERNAL: ErrorSpec(S.INTERNAL, False, False, "An internal error occurred."),
    Code.REQUEST_UNKNOWN: ErrorSpec(S.NOT_FOUND, False, False, "No tool request has that id."),
    Code.REQUEST_FOREIGN: ErrorSpec(
        S.PERMISSION_DENIED, False, False, "The tool request was sent to another host session."
    ),
    Code.REQUEST_ENDED: ErrorSpec(
        S.FAILED_PRECONDITION,
        False,
        False,
        "The tool request has already ended (timed out, cancelled or answered).",
    ),
    Code.REQUEST_DUPLICATE: ErrorSpec(
        S.ALREADY_EXISTS, False, False, "A tool request with that id is pending."
    ),
    Code.IDEMPOTENCY_KEY_REUSED: ErrorSpec(
        S.INVALID_ARGUMENT, False, True, "That idempotency key was used with other arguments; nothing ran."
    ),
    Code.INVOCATION_NOT_FOUND: ErrorSpec(
        S.NOT_FOUND, False, False, "No invocation has that id, or it is older than the ledger keeps."
    ),
    Code.INVOCATION_RUNNING: ErrorSpec(
        S.FAILED_PRECONDITION, False, False, "The invocation has no outcome yet."
    ),
    Code.HOST_SESSION_UNKNOWN: ErrorSpec(
        S.NOT_FOUND, False, False, "The host session does not exist or has ended."
    ),
    Code.RESULT_NOT_JSON: ErrorSpec(S.INVALID_ARGUMENT, False, False, "The result is not valid JSON."),
    Code.RESULT_TOO_LARGE: ErrorSpec(S.INVALID_ARGUMENT, False, False, "The result is larger than allowed."),
    Code.UNAUTHENTICATED: ErrorSpec(
        S.UNAUTHENTICATED,
        False,
        False,
        "The call has no valid token: missing, malformed, expired, or not signed by a trusted key.",
    ),
    Code.PERMISSION_DENIED: ErrorSpec(
        S.PERMISSION_DENIED, False, False, "The token does not allow this call for this session."
    ),
    Code.WRONG_LISTENER: ErrorSpec(
        S.PERMISSION_DENIED,
        False,
        False,
        "This RPC is not served on this port: internal RPCs only on the internal listener, "
        "the others only on the public one.",
    ),
    Code.CALLER_DEADLINE_EXCEEDED: ErrorSpec(
        S.DEADLINE_EXCEEDED,
        True,
        True,
        "No outcome arrived before the caller's own deadline; an exact retry joins the same call.",
    ),
    Code.TRANSPORT_FAILED: ErrorSpec(
        S.UNAVAILABLE, True, False, "The connection failed before an outcome arrived; an exact retry is safe."
    ),
    # Turn codes. A code that does not end the turn reaches the model as a failed tool result.
    Code.UNSUPPORTED_WEBMCP: ErrorSpec(
        S.FAILED_PRECONDITION,
        False,
        True,
        "The tool services this assistant needs are missing, incomplete or not secure.",
    ),
    Code.DISCOVERY_FAILED: ErrorSpec(
        S.UNAVAILABLE, True, True, "The assistant could not read the tools of this session."
    ),
    Code.TOOL_UNAVAILABLE: ErrorSpec(S.NOT_FOUND, False, False, "That tool cannot be used right now."),
    Code.STALE_TOOLS: ErrorSpec(
        S.ABORTED, True, False, "The tools changed while the assistant was working; please ask again."
    ),
    Code.INVALID_ARGUMENTS: ErrorSpec(
        S.INVALID_ARGUMENT, False, False, "The assistant gave the tool input that it does not accept."
    ),
    Code.EXECUTION_FAILED: ErrorSpec(S.UNKNOWN, False, False, "The tool ran into a problem."),
    Code.CONFIRMATION_DENIED: ErrorSpec(
        S.PERMISSION_DENIED, False, False, "The action was not confirmed, so it did not run."
    ),
    Code.ABORTED: ErrorSpec(S.CANCELLED, False, True, "The assistant stopped because it was cancelled."),
    Code.TIMEOUT: ErrorSpec(
        S.DEADLINE_EXCEEDED, False, True, "The assistant waited too long for an answer and stopped."
    ),
    Code.MODEL_ERROR: ErrorSpec(
        S.UNAVAILABLE, True, True, "The assistant's model failed or gave an answer it could not use."
    ),
    Code.TURN_LIMIT: ErrorSpec(
        S.RESOURCE_EXHAUSTED,
        False,
        True,
        "The assistant stopped after taking too many steps for one message.",
    ),
    Code.BUSY: ErrorSpec(
        S.FAILED_PRECONDITION, True, False, "The assistant is still working on the previous message."
    ),
}

ERROR_TABLE: Mapping[Code, ErrorSpec] = MappingProxyType(_TABLE)


def spec(code: Code) -> ErrorSpec:
    return ERROR_TABLE[code]


def code_for_reason(reason: str) -> Code | None:
    """The table's code for an ErrorInfo reason, or None for a reason we do not know."""
    try:
        return Code(reason)
    except ValueError:
        return None


@dataclass(eq=False)
class ToolmeshError(Exception):
    """A failure that produced no tool outcome; servers turn it into a status with ErrorInfo.

    `metadata` holds every variable of the message (AIP-193), never argument or
    result values.
    """

    code: Code
    detail: str = ""
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def message(self) -> str:
        base = ERROR_TABLE[self.code].message
        return f"{base} {self.detail}".strip()

    @property
    def status(self) -> grpc.StatusCode:
        return ERROR_TABLE[self.code].status

    @property
    def retryable(self) -> bool:
        return ERROR_TABLE[self.code].retryable
