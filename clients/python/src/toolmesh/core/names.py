"""Checks on names and ids that cross the wire."""

from __future__ import annotations

import re

from toolmesh.core.errors import Code, ToolmeshError

TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
# Session, turn and request ids: printable, no spaces, bounded so that they are
# safe in logs, span attributes and store keys.
IDENTIFIER = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")


def require_tool_name(name: str) -> str:
    if not TOOL_NAME.fullmatch(name):
        raise ToolmeshError(
            Code.INVALID_REQUEST, "A tool name must match [A-Za-z0-9_.-]{1,128}.", {"field": "tool_name"}
        )
    return name


def require_id(value: str, field_name: str, *, optional: bool = False) -> str:
    if optional and value == "":
        return value
    if not IDENTIFIER.fullmatch(value):
        raise ToolmeshError(
            Code.INVALID_REQUEST,
            f"{field_name} must match [A-Za-z0-9_.:-]{{1,128}}.",
            {"field": field_name},
        )
    return value
