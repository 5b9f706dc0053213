"""The session's tools as functions a model can be offered, or INVALID_SCHEMA.

Beyond the registry's own checks, a model can only be offered a tool whose
name is a function name ([A-Za-z0-9_-]{1,64}): toolmesh allows dots and up to
128 characters, chat-completions APIs do not.
"""

from __future__ import annotations

import re

from toolmesh.assistant.errors import AssistantError, TurnCode
from toolmesh.assistant.model import FunctionTool
from toolmesh.core import jsontext
from toolmesh.core.errors import ToolmeshError
from toolmesh.core.schemas import compile_schema
from toolmesh.core.tools import ToolSet

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def offer(tool_set: ToolSet) -> tuple[FunctionTool, ...]:
    """Raise AssistantError(INVALID_SCHEMA) naming the first tool that cannot be offered."""
    functions = []
    for tool in tool_set.tools:
        if not FUNCTION_NAME.fullmatch(tool.name):
            raise AssistantError(
                TurnCode.INVALID_SCHEMA,
                f"{tool.name}: a tool offered to a model needs a name matching [A-Za-z0-9_-]{{1,64}}.",
                {"tool": tool.name},
            )
        try:
            compile_schema(tool.input_schema_json, tool=tool.name, which="inputSchema", require_object=True)
        except ToolmeshError as refused:
            raise AssistantError(TurnCode.INVALID_SCHEMA, refused.detail, refused.metadata) from None
        functions.append(FunctionTool(tool.name, tool.description, jsontext.parse(tool.input_schema_json)))
    return tuple(functions)
