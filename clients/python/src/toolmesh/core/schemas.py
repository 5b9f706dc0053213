"""JSON Schema: which dialects toolmesh accepts, compiled validators, argument checks.

Validation runs on every tool call, so it uses jsonschema-rs (a compiled
validator, about a hundred times faster here than a pure-Python one), compiled
once per schema text. It never fetches a remote `$ref`: a schema that refers
outside itself is refused when it is registered. Patterns use jsonschema-rs's
linear-time regex engine only: a pattern that needs backtracking (lookaround,
backreferences) makes the schema unusable, so no argument can make a pattern
take more than linear time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jsonschema_rs

from toolmesh.core import jsontext
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.limits import MAX_REPORTED_VIOLATIONS, MAX_SCHEMA_BYTES, MAX_VIOLATION_TEXT

Validator = jsonschema_rs.Draft202012Validator | jsonschema_rs.Draft7Validator

DIALECTS: dict[str, type[Validator]] = {
    "json-schema.org/draft/2020-12/schema": jsonschema_rs.Draft202012Validator,
    "json-schema.org/draft-07/schema": jsonschema_rs.Draft7Validator,
}
DEFAULT_DIALECT: type[Validator] = jsonschema_rs.Draft202012Validator
# The linear-time engine, each compiled pattern bounded (a{1000}{1000} is refused, not built).
LINEAR_PATTERNS = jsonschema_rs.RegexOptions(size_limit=1024 * 1024, dfa_size_limit=2 * 1024 * 1024)


def _dialect(schema: dict[str, Any]) -> type[Validator] | None:
    uri = schema.get("$schema")
    if uri is None:
        return DEFAULT_DIALECT
    if not isinstance(uri, str):
        return None
    bare = uri.removeprefix("https://").removeprefix("http://").rstrip("#")
    return DIALECTS.get(bare)


def compile_schema(
    text: str, *, tool: str, which: str, require_object: bool, max_bytes: int = MAX_SCHEMA_BYTES
) -> Validator:
    """Check a schema and return its validator; raise ToolmeshError(INVALID_SCHEMA) when it is refused."""
    return _compile(text, tool, which, require_object, max_bytes)


@functools.lru_cache(maxsize=2048)
def _compile(text: str, tool: str, which: str, require_object: bool, max_bytes: int) -> Validator:
    def refuse(detail: str) -> ToolmeshError:
        return ToolmeshError(
            Code.INVALID_SCHEMA, f"{tool}: {which} {detail}", {"tool": tool, "schema": which}
        )

    if len(text.encode()) > max_bytes:
        raise refuse(f"is larger than {max_bytes} bytes.")
    try:
        schema = jsontext.parse(text)
    except jsontext.NotPlainJson:
        raise refuse("is not JSON.") from None
    if not isinstance(schema, dict):
        raise refuse("is not a JSON object.")
    validator_class = _dialect(schema)
    if validator_class is None:
        raise refuse("uses an unsupported dialect (supported: JSON Schema 2020-12, draft-07).")
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as exc:
        raise refuse(f"is not a valid schema: {exc.message}") from None
    if require_object:
        declared = schema.get("type", "object")
        if declared != "object" and not (isinstance(declared, list) and "object" in declared):
            raise refuse("must describe an object (type: object).")
    try:
        return validator_class(schema, offline=True, pattern_options=LINEAR_PATTERNS)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as exc:
        # e.g. a $ref to something outside the schema: never fetched.
        raise refuse(f"cannot be used: {str(exc).splitlines()[0]}") from None


@dataclass(frozen=True, slots=True)
class Violation:
    """Where the instance breaks the schema (a JSON Pointer) and how, each cut to MAX_VIOLATION_TEXT."""

    path: str
    message: str


def violations(validator: Validator, instance: Any, *, all_of_them: bool = True) -> list[Violation]:
    """Where `instance` breaks the schema, first ones by path; empty when it conforms.

    At most MAX_REPORTED_VIOLATIONS. Listing them all costs time in proportion
    to how many there are; with `all_of_them` false only the first one found
    is reported, at a cost that does not grow with the instance.
    """
    if validator.is_valid(instance):
        return []
    if not all_of_them:
        try:
            validator.validate(instance)
        except jsonschema_rs.ValidationError as error:
            return [_violation(_pointer(error.instance_path), error.message, _pointer(error.schema_path))]
        return []  # is_valid said otherwise: not reached
    found = [
        _violation(error["instanceLocation"], error["error"], error["schemaLocation"])
        for error in validator.evaluate(instance).errors()
    ]
    found.sort(key=lambda violation: violation.path.split("/"))
    return found[:MAX_REPORTED_VIOLATIONS]


def _pointer(parts: Any) -> str:
    return "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in parts)


def _violation(path: str, message: str, schema_location: str) -> Violation:
    """A violation whose text is bounded: messages quote the value, which may be as large as the arguments."""
    if len(message) > MAX_VIOLATION_TEXT:
        keyword = schema_location.rsplit("/", 1)[-1]
        message = f'does not satisfy "{keyword}" at {schema_location} (the value is too long to quote)'
    return Violation(_cut(path), _cut(message))


def _cut(text: str) -> str:
    return text if len(text) <= MAX_VIOLATION_TEXT else text[: MAX_VIOLATION_TEXT - 1] + "…"
