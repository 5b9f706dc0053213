"""JSON Schema: which dialects toolmesh accepts, compiled validators, argument checks.

Validation runs on every tool call, so it uses jsonschema-rs (a compiled
validator, about a hundred times faster here than a pure-Python one), compiled
once per schema text. It never fetches a remote `$ref`: a schema that refers
outside itself is refused when it is registered.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jsonschema_rs

from toolmesh.core import jsontext
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.limits import MAX_SCHEMA_BYTES

Validator = jsonschema_rs.Draft202012Validator | jsonschema_rs.Draft7Validator

DIALECTS: dict[str, type[Validator]] = {
    "json-schema.org/draft/2020-12/schema": jsonschema_rs.Draft202012Validator,
    "json-schema.org/draft-07/schema": jsonschema_rs.Draft7Validator,
}
DEFAULT_DIALECT: type[Validator] = jsonschema_rs.Draft202012Validator
MAX_REPORTED_VIOLATIONS = 20


def _dialect(schema: dict[str, Any]) -> type[Validator] | None:
    uri = schema.get("$schema")
    if uri is None:
        return DEFAULT_DIALECT
    if not isinstance(uri, str):
        return None
    bare = uri.removeprefix("https://").removeprefix("http://").rstrip("#")
    return DIALECTS.get(bare)


def compile_schema(text: str, *, tool: str, which: str, require_object: bool) -> Validator:
    """Check a schema and return its validator; raise ToolmeshError(INVALID_SCHEMA) when it is refused."""
    return _compile(text, tool, which, require_object)


@functools.lru_cache(maxsize=2048)
def _compile(text: str, tool: str, which: str, require_object: bool) -> Validator:
    def refuse(detail: str) -> ToolmeshError:
        return ToolmeshError(
            Code.INVALID_SCHEMA, f"{tool}: {which} {detail}", {"tool": tool, "schema": which}
        )

    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise refuse(f"is larger than {MAX_SCHEMA_BYTES} bytes.")
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
        return validator_class(schema, offline=True)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as exc:
        # e.g. a $ref to something outside the schema: never fetched.
        raise refuse(f"cannot be used: {str(exc).splitlines()[0]}") from None


@dataclass(frozen=True, slots=True)
class Violation:
    path: str
    message: str


def violations(validator: Validator, instance: Any) -> list[Violation]:
    """Where `instance` breaks the schema, first ones by path; empty when it conforms."""
    if validator.is_valid(instance):
        return []
    found = sorted(validator.iter_errors(instance), key=lambda error: [str(p) for p in error.instance_path])
    return [
        Violation("/" + "/".join(str(part) for part in error.instance_path), error.message)
        for error in found[:MAX_REPORTED_VIOLATIONS]
    ]
