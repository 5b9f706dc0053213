"""Plain JSON in and out: strict parsing, strict encoding, canonical form.

Plain JSON here means what survives a round trip through any JSON library:
objects with string keys, arrays, strings, finite numbers, booleans and null.
"""

from __future__ import annotations

import json
import math
from typing import Any

import rfc8785

JsonValue = Any  # the JSON data model; precise recursive types buy nothing here


class NotPlainJson(ValueError):
    """A value or text that is not plain JSON. `path` points at the first offending part."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{problem} at {path}")
        self.path = path
        self.problem = problem


def _reject_constant(name: str) -> None:
    raise NotPlainJson("$", f"{name} is not JSON")


def parse(text: str) -> JsonValue:
    """Parse JSON text, refusing NaN and Infinity (which Python accepts by default)."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except NotPlainJson:
        raise
    except (ValueError, RecursionError) as exc:
        raise NotPlainJson("$", f"invalid JSON ({exc.__class__.__name__})") from None


def check_plain(value: object) -> None:
    """Raise NotPlainJson for the first part of `value` that JSON cannot carry as it is."""
    stack: list[tuple[object, str]] = [(value, "$")]
    open_containers: set[int] = set()
    # Iterative walk with explicit exit markers so that a cycle is found
    # without recursing into it, and deep values do not hit the recursion limit.
    exits: list[tuple[int, int]] = []
    while stack:
        while exits and exits[-1][1] >= len(stack):
            open_containers.discard(exits.pop()[0])
        item, path = stack.pop()
        if item is None or isinstance(item, bool | str | int):
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                raise NotPlainJson(path, f"{item!r} is not a finite number")
            continue
        if isinstance(item, dict | list | tuple):
            if id(item) in open_containers:
                raise NotPlainJson(path, "the value contains itself (a cycle)")
            open_containers.add(id(item))
            exits.append((id(item), len(stack)))
            if isinstance(item, dict):
                for key, child in item.items():
                    if not isinstance(key, str):
                        raise NotPlainJson(path, f"object key of type {type(key).__name__} is not a string")
                    stack.append((child, f"{path}.{key}"))
            else:
                stack.extend((child, f"{path}[{index}]") for index, child in enumerate(item))
            continue
        raise NotPlainJson(path, f"a value of type {type(item).__name__} is not JSON")
    while exits:
        open_containers.discard(exits.pop()[0])


# Built once: json.dumps with any option builds a new encoder on every call.
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def dumps(value: object) -> str:
    """Encode a plain JSON value compactly; raise NotPlainJson for anything else."""
    check_plain(value)
    return _COMPACT.encode(value)


def canonical(value: JsonValue) -> bytes:
    """RFC 8785 canonical form: equal for semantically identical JSON values."""
    return bytes(rfc8785.dumps(value))
