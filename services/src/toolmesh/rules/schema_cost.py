"""How costly a schema can be to validate against, decided before anything is validated against it.

A valid JSON Schema can still take exponential time and memory per value:
anyOf nested twenty deep, each branch applying the next level, makes about a
million subschema visits for one argument (and a million errors to report when
it fails). So a schema is refused at registration (LIMIT_EXCEEDED, naming the
rule) when

- its objects and arrays nest deeper than `schema_depth`;
- the subschemas one value may be checked against, counted with every $ref,
  anyOf, oneOf and allOf expanded where it is used, exceed `schema_expansion`
  (counting stops there, so the count costs at most that many steps);
- a $ref leads back into itself (a cycle: the expansion never ends);
- a `pattern` or `patternProperties` key needs a backtracking regex engine
  (lookaround, backreferences) or exceeds the linear-time engine's size bound:
  validation uses the linear-time engine only (toolmesh.core.schemas).

$ref must point inside the schema: a JSON Pointer ("#/$defs/x") or an
$anchor. Anything else is refused as INVALID_SCHEMA (nothing is fetched).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import jsonschema_rs

from toolmesh.core import jsontext
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.schemas import LINEAR_PATTERNS, compile_schema
from toolmesh.rules.limits import Limits

# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = (
    "additionalProperties",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contentSchema",
)
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "dependentSchemas", "dependencies")
_REFS = ("$ref", "$dynamicRef", "$recursiveRef")
# Rule names (ErrorInfo `limit`) of the rules that are not numbers.
PATTERN_RULE = "schema_patterns"
PATTERN_RULE_VALUE = "linear-time (no lookaround or backreferences)"
CYCLE_RULE = "schema_ref_cycles"


@dataclass(frozen=True, slots=True)
class SchemaCost:
    """What validating against one schema may take: `expansion` subschema visits per value, at most."""

    expansion: int
    depth: int


def check_schema(text: str, limits: Limits, *, tool: str, which: str, require_object: bool) -> SchemaCost:
    """Refuse a schema over the limits (LIMIT_EXCEEDED) or invalid (INVALID_SCHEMA); else its cost.

    In this order: its size, its depth and patterns, its validity as a schema, its expansion.
    """
    if len(text.encode()) > limits.schema_bytes:
        raise limits.over(
            "schema_bytes",
            f"{tool}: {which} is larger than {limits.schema_bytes} bytes.",
            tool=tool,
            schema=which,
        )
    try:
        schema = jsontext.parse(text)
    except jsontext.NotPlainJson:
        schema = None  # compile_schema says why
    if schema is not None:
        _check_shape(schema, limits, tool, which)
    compile_schema(text, tool=tool, which=which, require_object=require_object, max_bytes=limits.schema_bytes)
    return schema_cost(text, limits, tool=tool, which=which)


def schema_cost(text: str, limits: Limits, *, tool: str, which: str) -> SchemaCost:
    """The cost of a schema compile_schema accepts; LIMIT_EXCEEDED past the limits. Cached."""
    return _cost(text, limits, tool, which)


# Each entry holds its schema's text (up to schema_bytes): few enough to bound memory.
@functools.lru_cache(maxsize=512)
def _cost(text: str, limits: Limits, tool: str, which: str) -> SchemaCost:
    schema = jsontext.parse(text)
    depth = _check_shape(schema, limits, tool, which)
    return SchemaCost(_Expansion(schema, limits, tool, which).count(), depth)


def _check_shape(schema: Any, limits: Limits, tool: str, which: str) -> int:
    """The schema's depth, once its depth and patterns are found within the rules."""
    depth = _depth(schema, limits.schema_depth)
    if depth > limits.schema_depth:
        raise limits.over(
            "schema_depth",
            f"{tool}: {which} nests deeper than {limits.schema_depth} levels.",
            tool=tool,
            schema=which,
        )
    _check_patterns(schema, tool, which)
    return depth


def _depth(value: Any, bound: int) -> int:
    """How deep objects and arrays nest in `value`, counted up to just past `bound`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > bound:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


def _check_patterns(schema: Any, tool: str, which: str) -> None:
    for location, pattern in _patterns(schema, ""):
        if not _linear(pattern):
            raise ToolmeshError(
                Code.LIMIT_EXCEEDED,
                f"{tool}: {which} has a pattern at {location or '/'} that the linear-time regex engine "
                "does not take (lookaround, backreferences, or too large once compiled).",
                {
                    "tool": tool,
                    "schema": which,
                    "at": location or "/",
                    "limit": PATTERN_RULE,
                    "value": PATTERN_RULE_VALUE,
                },
            )


def _patterns(value: Any, location: str) -> Iterator[tuple[str, str]]:
    """Every `pattern` string and `patternProperties` key, with where it is (a JSON Pointer)."""
    stack = [(value, location)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("pattern"), str):
                yield f"{at}/pattern", item["pattern"]
            keyed = item.get("patternProperties")
            if isinstance(keyed, dict):
                for key in keyed:
                    yield f"{at}/patternProperties", key
            stack.extend((child, f"{at}/{_escape(key)}") for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((child, f"{at}/{index}") for index, child in enumerate(item))


@functools.lru_cache(maxsize=4096)
def _linear(pattern: str) -> bool:
    try:
        jsonschema_rs.Draft202012Validator({"pattern": pattern}, pattern_options=LINEAR_PATTERNS)
    except (jsonschema_rs.ValidationError, ValueError):
        return False
    return True


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


class _Expansion:
    """Counts subschema visits with every reference expanded, stopping past the limit."""

    def __init__(self, root: Any, limits: Limits, tool: str, which: str) -> None:
        self._root = root
        self._limits = limits
        self._tool = tool
        self._which = which
        self._anchors = _anchors(root)

    def count(self) -> int:
        bound = self._limits.schema_expansion
        visits = 0
        # Each subschema to visit, with the references followed to reach it (a cycle repeats one).
        stack: list[tuple[Any, tuple[str, ...]]] = [(self._root, ())]
        while stack:
            schema, followed = stack.pop()
            visits += 1
            if visits > bound:
                raise self._limits.over(
                    "schema_expansion",
                    f"{self._tool}: {self._which} may visit more than {bound} subschemas per value "
                    "once its $ref, anyOf, oneOf and allOf are expanded.",
                    tool=self._tool,
                    schema=self._which,
                )
            if not isinstance(schema, dict):
                continue  # true or false
            for keyword in _REFS:
                reference = schema.get(keyword)
                if isinstance(reference, str):
                    if reference in followed:
                        raise self._cycle(reference)
                    stack.append((self._resolve(reference), (*followed, reference)))
            stack.extend((child, followed) for child in _subschemas(schema))
        return visits

    def _cycle(self, reference: str) -> ToolmeshError:
        return ToolmeshError(
            Code.LIMIT_EXCEEDED,
            f"{self._tool}: {self._which} refers back into itself through {reference} "
            "(recursive schemas are not accepted).",
            {"tool": self._tool, "schema": self._which, "limit": CYCLE_RULE, "value": "none"},
        )

    def _resolve(self, reference: str) -> Any:
        if reference == "#" or reference.startswith("#/"):
            target = self._root
            for escaped in reference[2:].split("/") if reference != "#" else ():
                part = unquote(escaped).replace("~1", "/").replace("~0", "~")
                if isinstance(target, dict) and part in target:
                    target = target[part]
                elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                    target = target[int(part)]
                else:
                    raise self._unresolved(reference)
            return target
        if reference.startswith("#") and reference[1:] in self._anchors:
            return self._anchors[reference[1:]]
        raise self._unresolved(reference)

    def _unresolved(self, reference: str) -> ToolmeshError:
        return ToolmeshError(
            Code.INVALID_SCHEMA,
            f"{self._tool}: {self._which} has a $ref that is not a JSON Pointer or $anchor within it.",
            {"tool": self._tool, "schema": self._which},
        )


def _subschemas(schema: dict[str, Any]) -> Iterator[Any]:
    for keyword in _ONE:
        if keyword in schema:
            yield schema[keyword]
    items = schema.get("items")
    if isinstance(items, list):  # draft-07's tuple form
        yield from items
    elif items is not None:
        yield items
    for keyword in _LIST:
        value = schema.get(keyword)
        if isinstance(value, list):
            yield from value
    for keyword in _MAP:
        value = schema.get(keyword)
        if isinstance(value, dict):
            # draft-07's dependencies may also map to lists of names: not schemas.
            yield from (child for child in value.values() if isinstance(child, dict | bool))


def _anchors(root: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    stack = [root]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for keyword in ("$anchor", "$dynamicAnchor"):
                if isinstance(item.get(keyword), str):
                    found.setdefault(item[keyword], item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found
