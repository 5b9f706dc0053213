"""What the bridge accepts from a host as an outcome: a plain-JSON result within its size, and
no runtime error code but the few a host may give."""

from __future__ import annotations

from toolmesh.core import jsontext
from toolmesh.core.errors import Code, ToolmeshError, code_for_reason
from toolmesh.core.limits import MAX_RESULT_BYTES
from toolmesh.core.outcome import ErrorKind, Outcome


def check_outcome(outcome: Outcome, metadata: dict[str, str]) -> None:
    """Raise a ToolmeshError for an outcome the bridge refuses from a host (its result, its error code)."""
    _check_result(outcome, metadata)
    _check_error_code(outcome, metadata)


def _check_result(outcome: Outcome, metadata: dict[str, str]) -> None:
    if outcome.result_json is None:
        return
    size = len(outcome.result_json.encode())
    if size > MAX_RESULT_BYTES:
        raise ToolmeshError(
            Code.RESULT_TOO_LARGE,
            f"{size} bytes, the limit is {MAX_RESULT_BYTES}.",
            {**metadata, "size": str(size), "limit": str(MAX_RESULT_BYTES)},
        )
    try:
        jsontext.parse(outcome.result_json)
    except jsontext.NotPlainJson:
        raise ToolmeshError(Code.RESULT_NOT_JSON, "", metadata) from None


# The runtime codes a host may answer with; every other runtime code is the runtime's own to give.
HOST_RUNTIME_CODES = frozenset(
    {Code.TOOL_HANDLER_NOT_FOUND, Code.TOOL_HANDLER_ERROR, Code.TOOL_RESULT_INVALID}
)


def from_host(outcome: Outcome) -> bool:
    """Whether `outcome` is one a host may give (as `check_outcome` takes it), not the runtime's own."""
    failure = outcome.failure
    if failure is None or failure.kind is ErrorKind.DOMAIN:
        return True
    return code_for_reason(failure.code) in HOST_RUNTIME_CODES


def _check_error_code(outcome: Outcome, metadata: dict[str, str]) -> None:
    """Refuse an error a host may not give: one that would pass for the runtime's own."""
    failure = outcome.failure
    if failure is None:
        return
    allowed = ", ".join(sorted(HOST_RUNTIME_CODES))
    if failure.kind is ErrorKind.RUNTIME and code_for_reason(failure.code) not in HOST_RUNTIME_CODES:
        raise ToolmeshError(
            Code.INVALID_REQUEST,
            f"A host's runtime error code must be one of {allowed}.",
            {**metadata, "field": "outcome.error.code"},
        )
    if failure.kind is ErrorKind.DOMAIN and code_for_reason(failure.code) is not None:
        raise ToolmeshError(
            Code.INVALID_REQUEST,
            f"A domain error's code must not be a runtime code such as {failure.code}: "
            "choose a code of the application's own.",
            {**metadata, "field": "outcome.error.code"},
        )
