"""The outcome of one tool call, independent of the wire."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from toolmesh.core.errors import ERROR_TABLE, Code
from toolmesh.core.jsontext import JsonValue


class ErrorKind(enum.Enum):
    DOMAIN = "domain"
    RUNTIME = "runtime"


@dataclass(frozen=True, slots=True)
class ToolFailure:
    kind: ErrorKind
    code: str
    message: str
    details: dict[str, JsonValue] | None = None
    retryable: bool = False

    @classmethod
    def runtime(
        cls, code: Code, detail: str = "", details: dict[str, JsonValue] | None = None
    ) -> ToolFailure:
        spec = ERROR_TABLE[code]
        message = f"{spec.message} {detail}".strip()
        return cls(ErrorKind.RUNTIME, code.value, message, details, spec.retryable)


@dataclass(frozen=True, slots=True)
class Outcome:
    """Exactly one of `result_json` (JSON text) or `failure` is set."""

    result_json: str | None = None
    failure: ToolFailure | None = field(default=None)

    def __post_init__(self) -> None:
        if (self.result_json is None) == (self.failure is None):
            raise ValueError("an outcome holds either a result or a failure")

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def code(self) -> str:
        """The outcome code: OK, a runtime code, or a domain error's own code."""
        return "OK" if self.failure is None else self.failure.code

    @classmethod
    def success(cls, result_json: str) -> Outcome:
        return cls(result_json=result_json)

    @classmethod
    def error(cls, failure: ToolFailure) -> Outcome:
        return cls(failure=failure)

    @classmethod
    def runtime_error(
        cls, code: Code, detail: str = "", details: dict[str, JsonValue] | None = None
    ) -> Outcome:
        return cls(failure=ToolFailure.runtime(code, detail, details))
