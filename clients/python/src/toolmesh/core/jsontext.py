"""Plain JSON in and out: strict parsing, strict encoding, canonical form.

Plain JSON here means text that every JSON reader takes as the same value, so
that what toolmesh checks is what the other side reads (I-JSON, RFC 7493, as
far as readers differ in practice): objects with string keys, each key once;
arrays; strings of Unicode characters (no lone surrogate); numbers a 64-bit
float holds (no overflow to infinity, no integer that a float reader would
round); booleans and null. Python's own `json` accepts more: a duplicate key
keeps its last value (other readers keep the first or refuse), `1e400` becomes
infinity, `"\\ud800"` a string that cannot be encoded, and integers of any size.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import rfc8785

JsonValue = Any  # the JSON data model; precise recursive types buy nothing here

# Integers every reader holds exactly: within ±2**53, or beyond it where a 64-bit float is exact.
_SAFE_INTEGER = 2**53
# An escaped UTF-16 surrogate: the only way a lone surrogate gets into parsed text.
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


class NotPlainJson(ValueError):
    """A value or text that is not plain JSON. `path` points at the first offending part."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{problem} at {path}")
        self.path = path
        self.problem = problem


def _reject_constant(name: str) -> None:
    raise NotPlainJson("$", f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        raise NotPlainJson("$", f"the key {_quoted(_repeated(pairs))} appears twice in one object")
    return value


def _repeated(pairs: list[tuple[str, Any]]) -> str:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    return ""


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise NotPlainJson("$", f"the number {_quoted(text)} is too large for a 64-bit float")
    return value


def _exact_int(text: str) -> int:
    value = int(text)
    if not _exact(value):
        raise NotPlainJson("$", f"the integer {_quoted(text)} is not exact in a 64-bit float")
    return value


def _exact(value: int) -> bool:
    if -_SAFE_INTEGER <= value <= _SAFE_INTEGER:
        return True
    try:
        return int(float(value)) == value
    except OverflowError:
        return False


def _quoted(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")


# Built once: json.loads with any option builds a new decoder on every call.
_DECODER = json.JSONDecoder(
    parse_constant=_reject_constant,
    object_pairs_hook=_unique_keys,
    parse_float=_finite_float,
    parse_int=_exact_int,
)


def parse(text: str) -> JsonValue:
    """Parse JSON text that every reader takes as the same value; raise NotPlainJson for anything else.

    Refused: NaN and Infinity, a key twice in one object, a number that
    overflows a 64-bit float, an integer that a float would round, an escaped
    lone surrogate, and text that is not JSON at all.
    """
    try:
        value = _DECODER.decode(text)
    except NotPlainJson:
        raise
    except (ValueError, RecursionError) as exc:
        raise NotPlainJson("$", f"invalid JSON ({exc.__class__.__name__})") from None
    if _ESCAPED_SURROGATE.search(text) is not None:
        check_plain(value)  # finds a lone surrogate; a pair was decoded into one character
    return value


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
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, str):
            _check_text(item, path)
            continue
        if isinstance(item, int):
            if not _exact(item):
                raise NotPlainJson(path, "an integer beyond ±2**53 that a 64-bit float would round")
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
                    _check_text(key, path)
                    stack.append((child, f"{path}.{key}"))
            else:
                stack.extend((child, f"{path}[{index}]") for index, child in enumerate(item))
            continue
        raise NotPlainJson(path, f"a value of type {type(item).__name__} is not JSON")
    while exits:
        open_containers.discard(exits.pop()[0])


def _check_text(text: str, path: str) -> None:
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            raise NotPlainJson(path, "a string with a lone surrogate is not Unicode text") from None


# Built once: json.dumps with any option builds a new encoder on every call.
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def dumps(value: object) -> str:
    """Encode a plain JSON value compactly; raise NotPlainJson for anything else."""
    check_plain(value)
    return _COMPACT.encode(value)


def canonical(value: JsonValue) -> bytes:
    """RFC 8785 canonical form: equal for semantically identical JSON values.

    An integer beyond ±2**53 (exact in a float, or parse would have refused it)
    is written as the float it equals, as RFC 8785 writes every number.
    """
    try:
        return bytes(rfc8785.dumps(value))
    except rfc8785.IntegerDomainError:
        return bytes(rfc8785.dumps(_big_integers_as_floats(value)))


def _big_integers_as_floats(value: JsonValue) -> JsonValue:
    if isinstance(value, dict):
        return {key: _big_integers_as_floats(child) for key, child in value.items()}
    if isinstance(value, list | tuple):
        return [_big_integers_as_floats(child) for child in value]
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= _SAFE_INTEGER:
        return float(value)
    return value
