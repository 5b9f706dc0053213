"""Validating arguments and results: at once when it is cheap, else in a worker within a time bound.

Most calls have a small schema and small arguments: validating them takes
microseconds, less than handing them to another process, so they are
validated on the event loop. The others (a schema whose expansion is large,
one registered under other limits, or arguments larger than INLINE_BYTES) go
to the ValidationPool, where one that takes longer than validation_timeout_ms
ends that call only (TOOL_ARGS_INVALID or TOOL_RESULT_INVALID, reason
"validation_time_limit") and delays nobody else.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

from toolmesh.core import jsontext
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.limits import FULL_VIOLATION_REPORT_CHARS
from toolmesh.core.outcome import Outcome
from toolmesh.core.schemas import Violation, compile_schema, violations
from toolmesh.core.tools import ToolSpec
from toolmesh.invocation.validation_pool import Job, OutOfMemory, SchemaUnusable, TimedOut, ValidationPool
from toolmesh.rules.limits import DEFAULT_LIMITS, Limits
from toolmesh.rules.schema_cost import schema_cost

log = logging.getLogger("toolmesh.invocation")

# At most this many subschema visits per value and this many bytes of instance
# are validated at once: at most about a hundred thousand visits, well under a
# millisecond. Anything costlier goes to a worker.
INLINE_EXPANSION = 200
INLINE_BYTES = 2 * 1024


class Validation:
    """Checks arguments and results against a tool's schemas, never holding the loop for long."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        # A schema's cost is counted on the loop only as far as the inline bound: past it, a worker.
        self._inline_limits = dataclasses.replace(limits, schema_expansion=INLINE_EXPANSION)
        # Cached per instance, keyed without the limits: hashing them (every field) on each call
        # cost more than the rest of the decision. Each entry keeps its schema's text: few enough.
        self._cheap = functools.lru_cache(maxsize=512)(functools.partial(_cheap, limits=self._inline_limits))
        self._pool = ValidationPool(
            limits.validation_workers,
            limits.validation_timeout_ms / 1000,
            limits.validation_memory_bytes,
        )

    def _inline(self, schema_json: str, which: str, tool: str, instance_bytes: int) -> bool:
        return instance_bytes <= INLINE_BYTES and self._cheap(schema_json, tool=tool, which=which)

    async def _violations(
        self, tool: ToolSpec, schema_json: str, which: str, instance_json: str, instance: object
    ) -> list[Violation]:
        """Raises SchemaUnusable, TimedOut or OutOfMemory (the pool's), ToolmeshError(OVERLOADED)."""
        all_of_them = len(instance_json) <= FULL_VIOLATION_REPORT_CHARS
        require_object = which == "inputSchema"
        if self._inline(schema_json, which, tool.name, len(instance_json)):
            try:
                validator = compile_schema(
                    schema_json,
                    tool=tool.name,
                    which=which,
                    require_object=require_object,
                    max_bytes=self._limits.schema_bytes,
                )
            except Exception:
                raise SchemaUnusable from None
            return violations(validator, instance, all_of_them=all_of_them)
        job = Job(
            schema_json,
            tool.name,
            which,
            require_object,
            instance,
            instance_json,
            all_of_them,
            self._limits.schema_bytes,
        )
        return await self._pool.validate(job)

    async def arguments(self, tool: ToolSpec, arguments: object, arguments_json: str) -> Outcome | None:
        """A TOOL_ARGS_INVALID outcome when the parsed arguments are not an object fitting the inputSchema."""
        if not isinstance(arguments, dict):
            return not_an_object(arguments)
        try:
            found = await self._violations(
                tool, tool.input_schema_json, "inputSchema", arguments_json, arguments
            )
        except (SchemaUnusable, TimedOut, OutOfMemory) as failure:
            return self._failed(Code.TOOL_ARGS_INVALID, tool, "inputSchema", failure)
        return arguments_outcome(found, len(arguments_json))

    async def result(self, tool: ToolSpec, outcome: Outcome) -> Outcome:
        """`outcome`, or TOOL_RESULT_INVALID with the violations when the result breaks the outputSchema.

        Errors pass as they are: the schema describes results only.
        """
        if not tool.output_schema_json or outcome.result_json is None:
            return outcome
        code = Code.TOOL_RESULT_INVALID
        try:
            result = jsontext.parse(outcome.result_json)
            found = await self._violations(
                tool, tool.output_schema_json, "outputSchema", outcome.result_json, result
            )
        except (SchemaUnusable, TimedOut, OutOfMemory, jsontext.NotPlainJson) as failure:
            return self._failed(code, tool, "outputSchema", failure)
        if not found:
            return outcome
        return Outcome.runtime_error(
            code,
            f"The result does not match the tool's outputSchema: {len(found)} violation(s).",
            {
                "reason": "output_schema",
                "violations": [{"path": v.path, "message": v.message} for v in found],
            },
        )

    def _failed(self, code: Code, tool: ToolSpec, which: str, failure: Exception) -> Outcome:
        if isinstance(failure, TimedOut):
            log.warning("validation over its time bound", extra={"tool": tool.name, "schema": which})
            return Outcome.runtime_error(
                code,
                f"Validating against the {which} took longer than {self._limits.validation_timeout_ms} ms.",
                {
                    "reason": "validation_time_limit",
                    "limit": "validation_timeout_ms",
                    "value": str(self._limits.validation_timeout_ms),
                },
            )
        if isinstance(failure, OutOfMemory):
            log.warning("validation over its memory bound", extra={"tool": tool.name, "schema": which})
            return Outcome.runtime_error(
                code,
                f"Validating against the {which} needed more memory than allowed.",
                {
                    "reason": "validation_memory_limit",
                    "limit": "validation_memory_bytes",
                    "value": str(self._limits.validation_memory_bytes),
                },
            )
        log.warning("schema could not be applied", extra={"tool": tool.name, "schema": which})
        what = "schema" if which == "inputSchema" else "outputSchema"
        return Outcome.runtime_error(
            code, f"The tool's {what} cannot be applied.", {"reason": "schema_unusable"}
        )

    async def aclose(self) -> None:
        await self._pool.aclose()


def _cheap(schema_json: str, *, limits: Limits, tool: str, which: str) -> bool:
    """Whether a value is validated against the schema at once (Validation caches it)."""
    try:
        schema_cost(schema_json, limits, tool=tool, which=which)
    except ToolmeshError:
        return False  # past the inline bound, or registered under other limits: a worker bounds it
    return True


def validate_now(tool: ToolSpec, arguments: object, arguments_json: str) -> Outcome | None:
    """As Validation.arguments, on the calling thread whatever it costs (for benchmarks and tools)."""
    if not isinstance(arguments, dict):
        return not_an_object(arguments)
    try:
        validator = compile_schema(
            tool.input_schema_json, tool=tool.name, which="inputSchema", require_object=True
        )
    except ToolmeshError:
        return Outcome.runtime_error(
            Code.TOOL_ARGS_INVALID, "The tool's schema cannot be applied.", {"reason": "schema_unusable"}
        )
    all_of_them = len(arguments_json) <= FULL_VIOLATION_REPORT_CHARS
    return arguments_outcome(violations(validator, arguments, all_of_them=all_of_them), len(arguments_json))


def arguments_outcome(found: list[Violation], size: int) -> Outcome | None:
    """TOOL_ARGS_INVALID listing `found`, or None when empty. `size`: the arguments' text length."""
    if not found:
        return None
    all_of_them = size <= FULL_VIOLATION_REPORT_CHARS
    return Outcome.runtime_error(
        Code.TOOL_ARGS_INVALID,
        f"{len(found)} schema violation(s)."
        if all_of_them
        else "The first schema violation found (arguments this large are not checked further).",
        {"reason": "schema", "violations": [{"path": v.path, "message": v.message} for v in found]},
    )


def not_an_object(arguments: object) -> Outcome:
    return Outcome.runtime_error(
        Code.TOOL_ARGS_INVALID,
        f"Arguments must be a JSON object, not {_json_type(arguments)}.",
        {"reason": "not_object"},
    )


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array"
