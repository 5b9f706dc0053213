"""toolmesh's tools and outcomes in MCP's terms, and back: the plain conversions of toolmesh.mcp.mapping."""

from __future__ import annotations

import json

import mcp_types as types
import pytest
from mcp.shared.exceptions import MCPError

from toolmesh.client.invocation import CallResult
from toolmesh.core.errors import ERROR_TABLE, Code
from toolmesh.core.outcome import ErrorKind, Outcome, ToolFailure
from toolmesh.core.tools import ToolAnnotations, ToolSpec
from toolmesh.mcp.mapping import (
    MCP_TOOL_ERROR,
    NO_OUTCOME,
    call_tool_result,
    handler_value,
    mcp_tool,
    tool_spec,
)

pytestmark = pytest.mark.unit


def test_flags_become_hints_and_the_rest_meta() -> None:
    read_only = mcp_tool(ToolSpec("look", "Looks", annotations=ToolAnnotations(read_only=True)))
    assert read_only.annotations == types.ToolAnnotations(
        read_only_hint=True, destructive_hint=False, idempotent_hint=True
    )
    writes = mcp_tool(
        ToolSpec(
            "put", annotations=ToolAnnotations(idempotent=True, requires_confirmation=True), timeout_ms=5000
        )
    )
    assert writes.annotations is not None
    assert writes.annotations.read_only_hint is False and writes.annotations.idempotent_hint is True
    # MCP's own default (it may destroy) stands for a tool that writes.
    assert writes.annotations.destructive_hint is None
    assert writes.meta == {"toolmesh/timeoutMs": 5000, "toolmesh/requiresConfirmation": True}
    assert writes.description is None


def test_only_an_object_output_schema_is_listed() -> None:
    listed = mcp_tool(ToolSpec("n", output_schema_json='{"type":"integer"}'))
    assert listed.output_schema is None
    objects = mcp_tool(ToolSpec("o", output_schema_json='{"type":"object"}'))
    assert objects.output_schema == {"type": "object"}


def test_results_become_text_and_structured_content() -> None:
    obj = call_tool_result(CallResult("tr_1", Outcome.success('{"a":1}'), replayed=True))
    assert obj.structured_content == {"a": 1} and obj.content == [types.TextContent(text='{"a":1}')]
    assert obj.meta == {"toolmesh/joined": False, "toolmesh/replayed": True, "toolmesh/toolRequestId": "tr_1"}
    text = call_tool_result(CallResult("tr_2", Outcome.success('"plain words"')))
    assert text.structured_content is None and text.content == [types.TextContent(text="plain words")]


def test_errors_become_is_error_with_code_and_retryable() -> None:
    failure = ToolFailure(ErrorKind.DOMAIN, "OUT_OF_STOCK", "None left.", {"sku": "x"}, True)
    result = call_tool_result(CallResult("tr_3", Outcome.error(failure)))
    assert result.is_error and result.content == [types.TextContent(text="OUT_OF_STOCK: None left.")]
    assert result.structured_content["error"] == {
        "code": "OUT_OF_STOCK",
        "kind": "domain",
        "message": "None left.",
        "retryable": True,
        "details": {"sku": "x"},
    }
    timeout = call_tool_result(CallResult("tr_4", Outcome.runtime_error(Code.TOOL_TIMEOUT, "late", {})))
    assert timeout.is_error and timeout.structured_content["error"]["kind"] == "runtime"
    # The model reads the code, the message and whether retrying may help.
    [block] = timeout.content
    assert isinstance(block, types.TextContent)
    text = block.text
    assert text.startswith(f"TOOL_TIMEOUT: {ERROR_TABLE[Code.TOOL_TIMEOUT].message}")
    assert text.endswith("fail the same way.")


def test_an_unknown_tool_is_invalid_params() -> None:
    unknown = Outcome.runtime_error(Code.TOOL_NOT_FOUND, "The session has no tool of that name.", {})
    with pytest.raises(MCPError) as raised:
        call_tool_result(CallResult(None, unknown))
    assert raised.value.code == types.INVALID_PARAMS and raised.value.message.startswith("Unknown tool")


def test_no_outcome_says_an_exact_retry_is_safe() -> None:
    with pytest.raises(MCPError) as raised:
        call_tool_result(
            CallResult(
                "tr_5", None, Code.CALLER_DEADLINE_EXCEEDED, retry_safe_until="2026-01-01T00:10:00.000Z"
            )
        )
    assert raised.value.code == NO_OUTCOME
    assert raised.value.data == {
        "code": "CALLER_DEADLINE_EXCEEDED",
        "retryable": True,
        "toolRequestId": "tr_5",
        "exactRetrySafe": True,
        "retrySafeUntil": "2026-01-01T00:10:00.000Z",
    }


def test_an_mcp_tool_becomes_a_declaration() -> None:
    tool = types.Tool(
        name="search",
        description="Searches",
        input_schema={"type": "object", "properties": {"q": {"type": "string"}}},
        output_schema={"type": "object"},
        annotations=types.ToolAnnotations(read_only_hint=True),
        _meta={"toolmesh/timeoutMs": 2500},
    )
    spec = tool_spec(tool)
    assert spec.annotations == ToolAnnotations(read_only=True, idempotent=False)
    assert json.loads(spec.input_schema_json) == tool.input_schema and spec.timeout_ms == 2500
    # Out of toolmesh's range, or not a number: the default timeout.
    for timeout in (0, 10**9, "soon", True):
        assert tool_spec(tool.model_copy(update={"meta": {"toolmesh/timeoutMs": timeout}})).timeout_ms == 0
    assert tool_spec(types.Tool(name="bare", input_schema={"type": "object"})).description == "bare"


def test_mcp_results_become_handler_values() -> None:
    failed = types.CallToolResult(content=[types.TextContent(text="disk full")], is_error=True)
    assert handler_value(failed) == {"error": {"code": MCP_TOOL_ERROR, "message": "disk full"}}
    structured = types.CallToolResult(content=[types.TextContent(text="{}")], structured_content={"n": 1})
    assert handler_value(structured) == {"n": 1}
    image = types.CallToolResult(content=[types.ImageContent(data="AAAA", mime_type="image/png")])
    assert handler_value(image) == {"content": [{"type": "image", "data": "AAAA", "mimeType": "image/png"}]}
