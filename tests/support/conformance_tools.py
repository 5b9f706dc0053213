"""The tools the MCP conformance suite's server scenarios call, served by a toolmesh host.

Only what toolmesh serves: results are JSON (so text and structuredContent),
never images, audio or embedded resources; no sampling, elicitation or
logging. tests/support/conformance_baseline.yml lists the scenarios this leaves out.
"""

from __future__ import annotations

import asyncio
from typing import Any

from toolmesh.host import ToolContext, ToolHost

# The bridge forwards at most one progress report per call every 100 ms: pace them past that.
PROGRESS_PACE_S = 0.15

JSON_SCHEMA_2020_12 = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "$defs": {
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
        }
    },
    "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/address"}},
    "additionalProperties": False,
}


async def simple_text(args: dict[str, Any], ctx: ToolContext) -> str:
    return "This is a simple text response for testing."


async def error_handling(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return {
        "error": {"code": "TEST_ERROR", "message": "This tool intentionally returns an error for testing"}
    }


async def with_progress(args: dict[str, Any], ctx: ToolContext) -> str:
    for done in (0, 50, 100):
        await ctx.report_progress(done, 100)
        await asyncio.sleep(PROGRESS_PACE_S)
    return "Progress test completed"


async def schema_tool(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return {"received": args}


def serve_conformance_tools(host: ToolHost) -> None:
    """Declare and serve the conformance tools on `host`."""
    host.on_tool("test_simple_text", simple_text, description="Returns simple text content")
    host.on_tool("test_error_handling", error_handling, description="Always returns an error")
    host.on_tool("test_tool_with_progress", with_progress, description="Reports progress 0, 50, 100 of 100")
    host.on_tool(
        "json_schema_2020_12_tool",
        schema_tool,
        description="Tool with JSON Schema 2020-12 features",
        input_schema=JSON_SCHEMA_2020_12,
    )
