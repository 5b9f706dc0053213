"""What a session's tool list must be to be taken: the registry's rule, which a bridge applies too
to the tools its hosts declare."""

from __future__ import annotations

from collections.abc import Sequence

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.names import require_tool_name
from toolmesh.core.tools import ToolSpec, check_timeout
from toolmesh.rules.limits import DEFAULT_LIMITS, Limits
from toolmesh.rules.schema_cost import check_schema


def check_tools(tools: Sequence[ToolSpec], limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse the whole list if any tool is malformed (names, timeouts, schemas) or over the limits."""
    if len(tools) > limits.tools_per_session:
        raise limits.over("tools_per_session", f"A session holds at most {limits.tools_per_session} tools.")
    seen: set[str] = set()
    for tool in tools:
        require_tool_name(tool.name)
        if tool.name in seen:
            raise ToolmeshError(
                Code.INVALID_REQUEST, f"The tool name {tool.name} appears twice.", {"tool": tool.name}
            )
        seen.add(tool.name)
        check_timeout(tool)
        check_schema(tool.input_schema_json, limits, tool=tool.name, which="inputSchema", require_object=True)
        if tool.output_schema_json:
            check_schema(
                tool.output_schema_json, limits, tool=tool.name, which="outputSchema", require_object=False
            )


def tools_bytes(tools: Sequence[ToolSpec]) -> int:
    """About what a list of tools takes stored: the bytes of its texts (names, descriptions, schemas)."""
    return sum(
        len(tool.name.encode())
        + len(tool.description.encode())
        + len(tool.input_schema_json.encode())
        + len(tool.output_schema_json.encode())
        for tool in tools
    )
