"""toolmesh's tools and outcomes in MCP's terms, and MCP's tools in toolmesh's: plain conversions."""

from __future__ import annotations

import json
from typing import Any

import grpc
import mcp_types as types
from mcp.shared.exceptions import MCPError

from toolmesh.client.invocation import CallResult
from toolmesh.client.views import outcome_json
from toolmesh.core import jsontext
from toolmesh.core.errors import ERROR_TABLE, Code
from toolmesh.core.limits import MAX_TOOL_TIMEOUT_MS
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.tools import ToolAnnotations, ToolSpec

# `_meta` keys toolmesh adds to MCP messages ("toolmesh/" is its prefix).
META_TOOL_REQUEST_ID = "toolmesh/toolRequestId"
META_JOINED = "toolmesh/joined"
META_REPLAYED = "toolmesh/replayed"
META_TIMEOUT_MS = "toolmesh/timeoutMs"
META_REQUIRES_CONFIRMATION = "toolmesh/requiresConfirmation"
# A client may name its call for the ledger: the same key, the same invocation for 24 h.
META_IDEMPOTENCY_KEY = "toolmesh/idempotencyKey"

# A JSON-RPC error in the implementation range: the call has no outcome (the invocation
# service could not be reached, or the call gave up waiting). `data` carries the
# toolRequestId when one was given, and says that an exact retry is safe.
NO_OUTCOME = -32010


def mcp_tool(spec: ToolSpec) -> types.Tool:
    """A session's tool as MCP lists it: flags become annotations (hints), the rest goes into `_meta`."""
    flags = spec.annotations
    annotations = types.ToolAnnotations(
        read_only_hint=flags.read_only,
        # Meaningful only for a tool that writes; MCP's default (true) is the safe assumption there.
        destructive_hint=False if flags.read_only else None,
        idempotent_hint=flags.idempotent or flags.read_only,
    )
    meta: dict[str, Any] = {META_TIMEOUT_MS: spec.effective_timeout_ms}
    if flags.requires_confirmation:
        meta[META_REQUIRES_CONFIRMATION] = True
    output_schema = jsontext.parse(spec.output_schema_json) if spec.output_schema_json else None
    return types.Tool(
        name=spec.name,
        description=spec.description or None,
        input_schema=jsontext.parse(spec.input_schema_json),
        # structuredContent is an object, so only an object schema can describe it.
        output_schema=output_schema if _is_object_schema(output_schema) else None,
        annotations=annotations,
        # Any call may be a task (protocol 2025-11-25): the ledger keeps every invocation.
        execution=types.ToolExecution(task_support="optional"),
        _meta=meta,
    )


def _is_object_schema(schema: object) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "object"


def call_tool_result(result: CallResult) -> types.CallToolResult:
    """An outcome as a CallToolResult: a result as text (and structuredContent, an object); an error, isError.

    Raises MCPError: INVALID_PARAMS for an unknown tool (as MCP specifies), NO_OUTCOME
    when no outcome arrived.
    """
    meta: dict[str, Any] = {META_JOINED: result.joined, META_REPLAYED: result.replayed}
    if result.tool_request_id:
        meta[META_TOOL_REQUEST_ID] = result.tool_request_id
    outcome = result.outcome
    if outcome is None:
        raise no_outcome_error(result)
    failure = outcome.failure
    if failure is None:
        assert outcome.result_json is not None
        value = jsontext.parse(outcome.result_json)
        # A string result is text as it is; any other value, its JSON text.
        text = value if isinstance(value, str) else outcome.result_json
        return types.CallToolResult(
            content=[types.TextContent(text=text)],
            structured_content=value if isinstance(value, dict) else None,
            is_error=False,
            _meta=meta,
        )
    if failure.code == Code.TOOL_NOT_FOUND.value:
        raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {failure.message}", {"code": failure.code})
    shown = outcome_json(outcome)
    text = f"{failure.code}: {failure.message}"
    if shown["error"]["kind"] == "runtime":
        # What the model reads: the runtime's code, its message, and whether trying again may help.
        text += " Retrying may succeed." if failure.retryable else " Retrying will fail the same way."
    return types.CallToolResult(
        content=[types.TextContent(text=text)],
        structured_content=shown,
        is_error=True,
        _meta=meta,
    )


def no_outcome_error(result: CallResult) -> MCPError:
    """The JSON-RPC error of a call without an outcome: the code, and the id an exact retry joins."""
    code = result.code or Code.TRANSPORT_FAILED
    row = ERROR_TABLE[code]
    message = f"{code.value}: {row.message} {result.detail}".strip()
    message += " The same call again is safe: it joins the call or replays its outcome, never runs it twice."
    return MCPError(
        NO_OUTCOME,
        message,
        {
            "code": code.value,
            "retryable": row.retryable,
            "toolRequestId": result.tool_request_id,
            "exactRetrySafe": True,
            # Until when (RFC 3339, UTC), when the service said: the ledger's replay window.
            "retrySafeUntil": result.retry_safe_until,
        },
    )


def tool_spec(tool: types.Tool) -> ToolSpec:
    """An MCP server's tool as a toolmesh declaration: hints become flags, schemas stay as they are.

    `_meta["toolmesh/timeoutMs"]` (an integer within toolmesh's limit) sets the
    tool's timeout; otherwise the default applies.
    """
    hints = tool.annotations or types.ToolAnnotations()
    read_only = hints.read_only_hint is True
    # A server written for toolmesh may say how long its tool may take.
    timeout = (tool.meta or {}).get(META_TIMEOUT_MS, 0)
    return ToolSpec(
        name=tool.name,
        description=tool.description or tool.name,
        input_schema_json=json.dumps(tool.input_schema),
        output_schema_json=json.dumps(tool.output_schema) if tool.output_schema is not None else "",
        timeout_ms=timeout if _is_timeout(timeout) else 0,
        annotations=ToolAnnotations(read_only=read_only, idempotent=hints.idempotent_hint is True),
    )


def _is_timeout(value: object) -> bool:
    """A number of milliseconds toolmesh takes as a tool's timeout (a bool is no number here)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_TOOL_TIMEOUT_MS


def handler_value(result: types.CallToolResult) -> object:
    """What a host handler returns for an MCP server's CallToolResult.

    isError becomes a domain error (code MCP_TOOL_ERROR, the text as its
    message); a result is its structuredContent, else `{"content": [...]}`.
    """
    text = "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))
    if result.is_error:
        return {"error": {"code": MCP_TOOL_ERROR, "message": text or "The MCP server's tool failed."}}
    if result.structured_content is not None:
        return result.structured_content
    return {
        "content": [
            block.model_dump(by_alias=True, mode="json", exclude_none=True) for block in result.content
        ]
    }


# The domain error code of an MCP server's isError result.
MCP_TOOL_ERROR = "MCP_TOOL_ERROR"


def refused(error: grpc.aio.AioRpcError) -> MCPError:
    """A refused RPC as a JSON-RPC error, with the error table's code; never the request's values."""
    code = error_code(error)
    return refusal(Code.TRANSPORT_FAILED if code is None else code)


def refusal(code: Code) -> MCPError:
    """A request refused for `code` as a JSON-RPC error, with the error table's message and retryability."""
    row = ERROR_TABLE[code]
    number = types.INVALID_PARAMS if code is Code.INVALID_REQUEST else types.INTERNAL_ERROR
    if code in (Code.UNAUTHENTICATED, Code.PERMISSION_DENIED):
        number = types.INVALID_REQUEST
    return MCPError(number, f"{code.value}: {row.message}", {"code": code.value, "retryable": row.retryable})
