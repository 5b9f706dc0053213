"""What a handler returned, turned into an outcome the runtime accepts."""

from __future__ import annotations

from dataclasses import dataclass

from toolmesh.core import jsontext
from toolmesh.core.errors import Code, code_for_reason
from toolmesh.core.limits import MAX_RESULT_BYTES
from toolmesh.core.outcome import ErrorKind, Outcome, ToolFailure


@dataclass(frozen=True, slots=True)
class Converted:
    """A handler's return value as the outcome to submit, and whether it had to be refused."""

    outcome: Outcome
    # Set when the handler's own value could not be handed back as it was:
    # RESULT_NOT_JSON or RESULT_TOO_LARGE.
    refused_because: Code | None = None


def convert_return(value: object) -> Converted:
    """A returned `{"error": {...}}` is a domain error passed through; anything else is the result."""
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get("error"), dict):
        return _domain_error(value["error"])
    try:
        text = jsontext.dumps(value)
    except jsontext.NotPlainJson as problem:
        return Converted(
            Outcome.runtime_error(
                Code.TOOL_RESULT_INVALID,
                f"The result is not plain JSON: {problem}.",
                {"reason": "not_json", "path": problem.path},
            ),
            Code.RESULT_NOT_JSON,
        )
    size = len(text.encode())
    if size > MAX_RESULT_BYTES:
        return Converted(
            Outcome.runtime_error(
                Code.TOOL_RESULT_INVALID,
                f"The result is {size} bytes; the limit is {MAX_RESULT_BYTES}. Return an id for large data.",
                {"reason": "too_large", "size": size, "limit": MAX_RESULT_BYTES},
            ),
            Code.RESULT_TOO_LARGE,
        )
    return Converted(Outcome.success(text))


def _domain_error(error: dict[object, object]) -> Converted:
    code, message = error.get("code"), error.get("message")
    details, retryable = error.get("details"), error.get("retryable", False)
    well_formed = (
        isinstance(code, str)
        and code != ""
        and isinstance(message, str)
        and (details is None or isinstance(details, dict))
        and isinstance(retryable, bool)
        and set(error) <= {"code", "message", "details", "retryable"}
    )
    if not well_formed:
        return Converted(
            Outcome.runtime_error(
                Code.TOOL_RESULT_INVALID,
                "A returned error needs a string code and message, and optional object details and "
                "boolean retryable.",
                {"reason": "malformed_error"},
            )
        )
    assert isinstance(code, str) and isinstance(message, str) and isinstance(retryable, bool)
    if code_for_reason(code) is not None:
        # The bridge refuses it: a domain error must not pass for one of the runtime's codes.
        return Converted(
            Outcome.runtime_error(
                Code.TOOL_RESULT_INVALID,
                f"A returned error's code must be the application's own, not the runtime code {code}.",
                {"reason": "runtime_code"},
            )
        )
    try:
        jsontext.check_plain(details)
    except jsontext.NotPlainJson as problem:
        return Converted(
            Outcome.runtime_error(
                Code.TOOL_RESULT_INVALID,
                f"The error's details are not plain JSON: {problem}.",
                {"reason": "not_json", "path": problem.path},
            ),
            Code.RESULT_NOT_JSON,
        )
    failure = ToolFailure(
        ErrorKind.DOMAIN, code, message, details if isinstance(details, dict) else None, retryable
    )
    return Converted(Outcome.error(failure))
