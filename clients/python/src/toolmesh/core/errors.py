"""The one error table of toolmesh's runtime.

Every code the runtime, the bridge, the host SDK or the CLI can produce is a
row here: the status it fails an RPC with, whether the same call may be
retried as it is, whether the request itself is at fault, and the message
shown to people. Nothing else decides these. The assistant's turn codes have
their own table beside the assistant (toolmesh.assistant.errors).

This module knows nothing of gRPC: `Status` numbers the canonical statuses,
and toolmesh.core.rpcstatus maps them to grpc.StatusCode.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from toolmesh.core.exceptions import exception_fields

DOMAIN = "toolmesh"


class Status(enum.IntEnum):
    """The canonical RPC status codes (google.rpc.Code), with gRPC's numbers and names."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class Code(enum.StrEnum):
    """A runtime error code: the reason of a failed RPC's ErrorInfo, or the code of a runtime outcome."""

    # Outcomes of a tool call (carried inside a successful InvokeTool response).
    TOOL_NOT_FOUND = "TOOL_NOT_FOUND"
    TOOL_ARGS_INVALID = "TOOL_ARGS_INVALID"
    TOOL_HANDLER_NOT_FOUND = "TOOL_HANDLER_NOT_FOUND"
    TOOL_HANDLER_ERROR = "TOOL_HANDLER_ERROR"
    TOOL_RESULT_INVALID = "TOOL_RESULT_INVALID"
    TOOL_TIMEOUT = "TOOL_TIMEOUT"
    TOOL_HOST_UNAVAILABLE = "TOOL_HOST_UNAVAILABLE"
    TOOL_HOST_DISCONNECTED = "TOOL_HOST_DISCONNECTED"
    TOOL_CANCELLED = "TOOL_CANCELLED"
    # Reported by the host SDK to its error callbacks.
    SUBMIT_TOOL_RESULT_FAILED = "SUBMIT_TOOL_RESULT_FAILED"
    # Failed RPCs: no outcome was produced.
    INVALID_REQUEST = "INVALID_REQUEST"
    INVALID_SCHEMA = "INVALID_SCHEMA"
    REVISION_CONFLICT = "REVISION_CONFLICT"
    REGISTRY_UNAVAILABLE = "REGISTRY_UNAVAILABLE"
    BRIDGE_UNAVAILABLE = "BRIDGE_UNAVAILABLE"
    STORE_UNAVAILABLE = "STORE_UNAVAILABLE"
    OUTCOME_UNAVAILABLE = "OUTCOME_UNAVAILABLE"
    OVERLOADED = "OVERLOADED"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    INTERNAL = "INTERNAL"
    # Reasons SubmitToolResult refuses a result.
    REQUEST_UNKNOWN = "REQUEST_UNKNOWN"
    REQUEST_ENDED = "REQUEST_ENDED"
    REQUEST_DUPLICATE = "REQUEST_DUPLICATE"
    HOST_SESSION_UNKNOWN = "HOST_SESSION_UNKNOWN"
    HOST_NOT_READING = "HOST_NOT_READING"
    # The invocation ledger.
    IDEMPOTENCY_KEY_REUSED = "IDEMPOTENCY_KEY_REUSED"
    INVOCATION_NOT_FOUND = "INVOCATION_NOT_FOUND"
    INVOCATION_RUNNING = "INVOCATION_RUNNING"
    RETRY_WINDOW_PASSED = "RETRY_WINDOW_PASSED"
    RESULT_NOT_JSON = "RESULT_NOT_JSON"
    RESULT_TOO_LARGE = "RESULT_TOO_LARGE"
    # Who may do what: refused before anything ran.
    UNAUTHENTICATED = "UNAUTHENTICATED"
    AUTH_THROTTLED = "AUTH_THROTTLED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    WRONG_LISTENER = "WRONG_LISTENER"
    # Limits (toolmesh.rules.limits): a request over a fixed bound, or a quota used up for now.
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    # An InvokeTools stream whose caller stopped reading its results.
    RESULTS_NOT_READ = "RESULTS_NOT_READ"
    # Seen by a caller that received no outcome at all.
    CALLER_DEADLINE_EXCEEDED = "CALLER_DEADLINE_EXCEEDED"
    TRANSPORT_FAILED = "TRANSPORT_FAILED"


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorSpec:
    """One row of the table.

    `status`: what an RPC failing with the code carries. `retryable`: the same
    call, sent again as it is, may succeed. `caller_fault`: the request itself
    is wrong (sending it again fails the same way): a client library raises
    such a failure to the program instead of reporting a call without an
    outcome. `message`: for people, the same for every occurrence.
    """

    status: Status
    retryable: bool
    message: str
    caller_fault: bool = False


S = Status

_TABLE: dict[Code, ErrorSpec] = {
    Code.TOOL_NOT_FOUND: ErrorSpec(
        status=S.NOT_FOUND, retryable=False, message="The session has no tool of that name."
    ),
    Code.TOOL_ARGS_INVALID: ErrorSpec(
        status=S.INVALID_ARGUMENT,
        retryable=False,
        caller_fault=True,
        message="The arguments are not a JSON object or do not match the schema.",
    ),
    Code.TOOL_HANDLER_NOT_FOUND: ErrorSpec(
        status=S.UNIMPLEMENTED, retryable=False, message="The handler host has no handler for this tool."
    ),
    Code.TOOL_HANDLER_ERROR: ErrorSpec(
        status=S.INTERNAL, retryable=False, message="The tool's handler failed."
    ),
    Code.TOOL_RESULT_INVALID: ErrorSpec(
        status=S.INTERNAL,
        retryable=False,
        message="The tool's handler returned a value that is not plain JSON, or too much.",
    ),
    Code.TOOL_TIMEOUT: ErrorSpec(
        status=S.DEADLINE_EXCEEDED,
        retryable=False,
        message=(
            "No answer before the deadline; the call has ended. "
            "Hosts that acknowledge starts never start it late."
        ),
    ),
    Code.TOOL_HOST_UNAVAILABLE: ErrorSpec(
        status=S.UNAVAILABLE,
        retryable=True,
        message="No handler host serves this session right now; the tool did not run.",
    ),
    Code.TOOL_HOST_DISCONNECTED: ErrorSpec(
        status=S.UNAVAILABLE,
        retryable=False,
        message="The handler host went away after the tool may have started; it may have run.",
    ),
    Code.TOOL_CANCELLED: ErrorSpec(
        status=S.CANCELLED,
        retryable=False,
        message="The invocation was cancelled (CancelInvocation); the tool may have partly run.",
    ),
    Code.SUBMIT_TOOL_RESULT_FAILED: ErrorSpec(
        status=S.FAILED_PRECONDITION,
        retryable=False,
        message="The tool's result could not be handed back to the runtime.",
    ),
    Code.INVALID_REQUEST: ErrorSpec(
        status=S.INVALID_ARGUMENT, retryable=False, caller_fault=True, message="The request is malformed."
    ),
    Code.INVALID_SCHEMA: ErrorSpec(
        status=S.INVALID_ARGUMENT,
        retryable=False,
        caller_fault=True,
        message="A tool definition is not valid.",
    ),
    Code.REVISION_CONFLICT: ErrorSpec(
        status=S.ABORTED,
        retryable=False,
        message="The tool list changed since the revision the caller expected.",
    ),
    Code.REGISTRY_UNAVAILABLE: ErrorSpec(
        status=S.UNAVAILABLE,
        retryable=True,
        message="The tool registry could not be reached; the tool did not run.",
    ),
    Code.BRIDGE_UNAVAILABLE: ErrorSpec(
        status=S.UNAVAILABLE,
        retryable=True,
        message="The bridge could not be reached; the outcome is unknown.",
    ),
    Code.STORE_UNAVAILABLE: ErrorSpec(
        status=S.UNAVAILABLE, retryable=True, message="The state store could not be reached; no tool ran."
    ),
    Code.OUTCOME_UNAVAILABLE: ErrorSpec(
        status=S.UNAVAILABLE,
        retryable=True,
        message="The store failed mid-call; the tool may have run. Exact retry safe until retrySafeUntil "
        "(default 10 min).",
    ),
    Code.OVERLOADED: ErrorSpec(
        status=S.RESOURCE_EXHAUSTED, retryable=True, message="The service is overloaded; try again."
    ),
    Code.SHUTTING_DOWN: ErrorSpec(
        status=S.UNAVAILABLE, retryable=True, message="The service is shutting down; try again."
    ),
    Code.INTERNAL: ErrorSpec(status=S.INTERNAL, retryable=False, message="An internal error occurred."),
    # Also a request sent to another host session: one answer, so that ids are no existence oracle.
    Code.REQUEST_UNKNOWN: ErrorSpec(
        status=S.NOT_FOUND, retryable=False, message="This host session has no tool request with that id."
    ),
    Code.REQUEST_ENDED: ErrorSpec(
        status=S.FAILED_PRECONDITION,
        retryable=False,
        message="The tool request has already ended (timed out, cancelled or answered).",
    ),
    Code.REQUEST_DUPLICATE: ErrorSpec(
        status=S.ALREADY_EXISTS, retryable=False, message="A tool request with that id is pending."
    ),
    Code.IDEMPOTENCY_KEY_REUSED: ErrorSpec(
        status=S.INVALID_ARGUMENT,
        retryable=False,
        caller_fault=True,
        message="That idempotency key was used with other arguments; nothing ran.",
    ),
    Code.INVOCATION_NOT_FOUND: ErrorSpec(
        status=S.NOT_FOUND,
        retryable=False,
        message="No invocation has that id, or it is older than the ledger keeps.",
    ),
    Code.RETRY_WINDOW_PASSED: ErrorSpec(
        status=S.FAILED_PRECONDITION,
        retryable=False,
        caller_fault=True,
        message="An exact retry came after the replay window; nothing ran. Reconcile toolRequestId, "
        "confirm it, call anew.",
    ),
    Code.INVOCATION_RUNNING: ErrorSpec(
        status=S.FAILED_PRECONDITION, retryable=False, message="The invocation has no outcome yet."
    ),
    Code.HOST_SESSION_UNKNOWN: ErrorSpec(
        status=S.NOT_FOUND, retryable=False, message="The host session does not exist or has ended."
    ),
    Code.HOST_NOT_READING: ErrorSpec(
        status=S.UNAVAILABLE,
        retryable=True,
        message="The host left a read check unanswered, so its session ended; open a new one.",
    ),
    Code.RESULT_NOT_JSON: ErrorSpec(
        status=S.INVALID_ARGUMENT, retryable=False, caller_fault=True, message="The result is not valid JSON."
    ),
    Code.RESULT_TOO_LARGE: ErrorSpec(
        status=S.INVALID_ARGUMENT,
        retryable=False,
        caller_fault=True,
        message="The result is larger than allowed.",
    ),
    Code.UNAUTHENTICATED: ErrorSpec(
        status=S.UNAUTHENTICATED,
        retryable=False,
        caller_fault=True,
        message="The call has no valid token: missing, malformed, expired, or not signed by a trusted key.",
    ),
    Code.AUTH_THROTTLED: ErrorSpec(
        status=S.RESOURCE_EXHAUSTED,
        retryable=True,
        message="Too many failed authentications from this address; retry after the delay in RetryInfo.",
    ),
    Code.PERMISSION_DENIED: ErrorSpec(
        status=S.PERMISSION_DENIED,
        retryable=False,
        caller_fault=True,
        message="The token does not allow this call for this session.",
    ),
    Code.WRONG_LISTENER: ErrorSpec(
        status=S.PERMISSION_DENIED,
        retryable=False,
        caller_fault=True,
        message="This RPC is not served on this port: internal RPCs only on the internal listener, "
        "the others only on the public one.",
    ),
    Code.LIMIT_EXCEEDED: ErrorSpec(
        status=S.INVALID_ARGUMENT,
        retryable=False,
        caller_fault=True,
        message="The request is over one of the service's limits; ErrorInfo names the limit and its value.",
    ),
    Code.QUOTA_EXCEEDED: ErrorSpec(
        status=S.RESOURCE_EXHAUSTED,
        retryable=True,
        message="A quota is used up for now; retry after the delay in RetryInfo. "
        "ErrorInfo names the quota and its value.",
    ),
    Code.RESULTS_NOT_READ: ErrorSpec(
        status=S.RESOURCE_EXHAUSTED,
        retryable=True,
        message="The caller did not read its results, so the stream ended; an exact retry replays them.",
    ),
    Code.CALLER_DEADLINE_EXCEEDED: ErrorSpec(
        status=S.DEADLINE_EXCEEDED,
        retryable=True,
        message="No outcome before the caller's own deadline; an exact retry joins or replays it until "
        "retrySafeUntil (default 10 min).",
    ),
    Code.TRANSPORT_FAILED: ErrorSpec(
        status=S.UNAVAILABLE,
        retryable=True,
        message="The connection failed before an outcome arrived; an exact retry is safe until "
        "retrySafeUntil (default 10 min).",
    ),
}

ERROR_TABLE: Mapping[Code, ErrorSpec] = MappingProxyType(_TABLE)

# A failed RPC that carries no code of ours (the transport's own failure, or a
# peer that is not toolmesh) may pass when sent again if its status is one the
# retryable codes fail with: the service was briefly unable, nothing says the
# request is wrong.
RETRYABLE_STATUSES: frozenset[Status] = frozenset(spec.status for spec in _TABLE.values() if spec.retryable)


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
    # How long to wait before the same call may pass (QUOTA_EXCEEDED): sent as google.rpc.RetryInfo.
    retry_delay_s: float | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's own reduce rebuilds from `args` (the message), which is not a code.
        return (type(self), (self.code, self.detail, self.metadata, self.retry_delay_s), self.__dict__)

    @property
    def message(self) -> str:
        base = ERROR_TABLE[self.code].message
        return f"{base} {self.detail}".strip()

    @property
    def status(self) -> Status:
        return ERROR_TABLE[self.code].status

    @property
    def retryable(self) -> bool:
        return ERROR_TABLE[self.code].retryable


def typed_error(exc: Exception, method: str, log: logging.Logger) -> ToolmeshError:
    """`exc` as the error an RPC answers with: a ToolmeshError as it is; anything else INTERNAL,
    logged by its type only (its text may quote request data)."""
    if isinstance(exc, ToolmeshError):
        return exc
    log.error(
        "unexpected error", extra={"method": method, "code": Code.INTERNAL.value} | exception_fields(exc)
    )
    return ToolmeshError(Code.INTERNAL)
