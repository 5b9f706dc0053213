"""Every outcome of the runtime's error table, over real servers and a real host process."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from toolmesh.assembly.system import LocalSystem
from toolmesh.client import CallResult, InvocationClient, RegistryClient
from toolmesh.core.errors import Code
from toolmesh.core.outcome import ErrorKind
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.tools import ToolAnnotations, ToolSpec
from toolmesh_testing import HostProcess, eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

OBJECT = '{"type": "object"}'
TOOLS = [
    ToolSpec("echo", "Echo the arguments", '{"type":"object","properties":{"n":{"type":"integer"}}}'),
    ToolSpec("domain_fail", "Always a domain error", OBJECT),
    ToolSpec("boom", "Raises", OBJECT),
    ToolSpec("slow_async", "Waits, cancellable", OBJECT, timeout_ms=400),
    ToolSpec("slow_sync", "Sleeps in a thread", OBJECT, timeout_ms=300),
    ToolSpec("not_json", "Returns a non-JSON value", OBJECT),
    ToolSpec("too_large", "Returns too much", OBJECT),
    ToolSpec("unhandled", "Registered but the host has no handler", OBJECT),
    ToolSpec(
        "checked",
        "Echo, with a result schema",
        OBJECT,
        output_schema_json=json.dumps(
            {
                "type": "object",
                "required": ["echo"],
                "properties": {
                    "echo": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}}}
                },
            }
        ),
    ),
    ToolSpec(
        "typed",
        "Strict schema",
        json.dumps(
            {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "type": "object",
                "required": ["name", "count"],
                "properties": {"name": {"type": "string"}, "count": {"type": "integer", "minimum": 1}},
                "additionalProperties": False,
            }
        ),
        annotations=ToolAnnotations(read_only=True),
    ),
]


# Every test runs with unary InvokeTool calls and with calls on one InvokeTools stream.
@pytest_asyncio.fixture(loop_scope="module", scope="module", params=["unary", "stream"])
async def client(
    system: LocalSystem, e2e_host: HostProcess, request: pytest.FixtureRequest
) -> AsyncIterator[InvocationClient]:
    async with RegistryClient(system.registry_target) as registry:
        await registry.put_tools("e2e", TOOLS)
    async with InvocationClient(system.invocation_target, multiplex=request.param == "stream") as invocation:
        yield invocation


async def call(client: InvocationClient, tool: str, args: Any = None, **kwargs: Any) -> CallResult:
    return await client.invoke("e2e", tool, args if args is not None else {}, turn_id="turn-1", **kwargs)


def failure_of(result: CallResult) -> Any:
    assert result.outcome is not None and result.outcome.failure is not None, result
    return result.outcome.failure


async def test_success_returns_the_handlers_result(client: InvocationClient) -> None:
    result = await call(client, "echo", {"n": 3})
    assert result.outcome is not None and result.outcome.ok
    assert result.tool_request_id and result.tool_request_id.startswith("tr_")
    body = result.to_json()["result"]
    assert body == {"echo": {"n": 3}, "turnId": "turn-1", "toolRequestId": result.tool_request_id}


async def test_domain_error_passes_through_untouched(client: InvocationClient) -> None:
    failure = failure_of(await call(client, "domain_fail"))
    assert failure.kind is ErrorKind.DOMAIN
    assert failure.code == "NO_ACTIVE_SELECTION"
    assert failure.message == "Select text before using replace_selection."
    assert failure.details == {"documentId": "doc-7"}
    assert failure.retryable is True


async def test_unknown_tool_is_tool_not_found(client: InvocationClient) -> None:
    failure = failure_of(await call(client, "no_such_tool"))
    assert (failure.kind, failure.code) == (ErrorKind.RUNTIME, "TOOL_NOT_FOUND")
    assert failure.retryable is False


@pytest.mark.parametrize("raw", ["[1, 2]", '"text"', "42", "null", "not json", '{"n": NaN}'])
async def test_non_object_arguments_are_tool_args_invalid(client: InvocationClient, raw: str) -> None:
    failure = failure_of(await client.invoke("e2e", "echo", turn_id="t", arguments_json=raw))
    assert failure.code == "TOOL_ARGS_INVALID"
    assert failure.details["reason"] in {"not_object", "not_json"}


async def test_schema_violations_are_listed(client: InvocationClient) -> None:
    failure = failure_of(await call(client, "typed", {"count": 0, "extra": True}))
    assert failure.code == "TOOL_ARGS_INVALID"
    assert failure.details["reason"] == "schema"
    messages = " | ".join(v["message"] for v in failure.details["violations"])
    assert '"name" is a required property' in messages
    assert "minimum of 1" in messages
    assert "Additional properties are not allowed" in messages
    paths = {v["path"] for v in failure.details["violations"]}
    assert "/count" in paths


async def test_valid_arguments_reach_a_strict_tool(client: InvocationClient) -> None:
    result = await call(client, "typed", {"name": "a", "count": 2})
    assert failure_of(result).code == "TOOL_HANDLER_NOT_FOUND"  # validated, then delivered


async def test_missing_handler_is_tool_handler_not_found(client: InvocationClient) -> None:
    failure = failure_of(await call(client, "unhandled"))
    assert (failure.kind, failure.code) == (ErrorKind.RUNTIME, "TOOL_HANDLER_NOT_FOUND")


async def test_raising_handler_is_compact_and_host_survives(
    client: InvocationClient, e2e_host: HostProcess
) -> None:
    failure = failure_of(await call(client, "boom"))
    assert failure.code == "TOOL_HANDLER_ERROR"
    assert failure.details == {"tool": "boom", "exception": "RuntimeError"}
    assert "hunter2" not in json.dumps(failure.details) + failure.message
    # Logged locally with correlation ids, and the host keeps serving.
    record = await e2e_host.wait_for_log(msg="host error", code="TOOL_HANDLER_ERROR", tool_name="boom")
    assert record["turn_id"] == "turn-1" and record["detail"] == "RuntimeError"
    assert (await call(client, "echo", {"n": 1})).outcome is not None


async def test_timeout_ends_the_call_and_the_host_cancels(client: InvocationClient, marker_dir: Path) -> None:
    name = f"t1-{uuid.uuid4().hex}"  # this run's own marker and arguments
    result = await call(client, "slow_async", {"marker": name})
    failure = failure_of(result)
    assert failure.code == "TOOL_TIMEOUT"
    assert failure.details["timeoutMs"] == 400
    assert failure.retryable is False
    marker = marker_dir / f"cancelled-{name}"
    await eventually(lambda: marker.exists() and marker.read_text())  # written, not only created
    assert marker.read_text() == "timeout"


async def test_late_result_gets_submit_tool_result_failed(
    client: InvocationClient, e2e_host: HostProcess, marker_dir: Path
) -> None:
    name = f"late1-{uuid.uuid4().hex}"  # this run's own marker and arguments
    result = await call(client, "slow_sync", {"seconds": 0.8, "marker": name})
    assert failure_of(result).code == "TOOL_TIMEOUT"
    record = await e2e_host.wait_for_log(
        msg="host error", code="SUBMIT_TOOL_RESULT_FAILED", tool_request_id=result.tool_request_id or ""
    )
    assert record["cause"] == "REQUEST_ENDED" and record["tool_name"] == "slow_sync"
    # The handler learned it was cancelled while it ran.
    assert (marker_dir / f"sync-finished-{name}").read_text() == "True"


@pytest.mark.parametrize("kind", ["bytes", "set", "nan", "cycle", "object", "function"])
async def test_non_json_result_is_a_clear_error(
    client: InvocationClient, e2e_host: HostProcess, kind: str
) -> None:
    result = await call(client, "not_json", {"kind": kind})
    failure = failure_of(result)
    assert failure.code == "TOOL_RESULT_INVALID"
    assert failure.details["reason"] == "not_json"
    assert failure.details["path"] in {"$.value", "$.value[0]"}
    record = await e2e_host.wait_for_log(msg="host error", tool_request_id=result.tool_request_id or "")
    assert record["code"] == "SUBMIT_TOOL_RESULT_FAILED" and record["cause"] == "RESULT_NOT_JSON"
    assert (await call(client, "echo")).outcome is not None  # the host is still alive


async def test_too_large_result_is_a_clear_error(client: InvocationClient) -> None:
    failure = failure_of(await call(client, "too_large"))
    assert failure.code == "TOOL_RESULT_INVALID"
    assert failure.details["reason"] == "too_large"


async def test_malformed_envelope_is_a_failed_rpc_with_error_info(client: InvocationClient) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await client.invoke("bad session id!", "echo", {}, turn_id="t")
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error_code(raised.value) is Code.INVALID_REQUEST


async def test_callers_own_deadline_is_distinct_from_tool_timeout(client: InvocationClient) -> None:
    # Arguments of their own: an earlier identical call's unconfirmed outcome would replay.
    result = await call(client, "slow_async", {"marker": f"own-deadline-{uuid.uuid4().hex}"}, timeout=0.1)
    assert result.outcome is None
    assert result.code is Code.CALLER_DEADLINE_EXCEEDED
    assert result.to_json()["error"]["retryable"] is True


async def test_no_host_for_session_is_tool_host_unavailable(system: LocalSystem) -> None:
    async with RegistryClient(system.registry_target) as registry:
        await registry.put_tools("nobody-home", [ToolSpec("echo", "", OBJECT)])
    async with InvocationClient(system.invocation_target) as client:
        result = await client.invoke("nobody-home", "echo", {}, turn_id="t")
    failure = failure_of(result)
    assert failure.code == "TOOL_HOST_UNAVAILABLE"
    assert failure.retryable is True


async def test_a_result_that_breaks_the_output_schema_is_tool_result_invalid(
    client: InvocationClient,
) -> None:
    fits = await call(client, "checked", {"n": 3})
    assert fits.outcome is not None and fits.outcome.ok
    result = await call(client, "checked", {"n": 9})
    failure = failure_of(result)
    assert failure.code == Code.TOOL_RESULT_INVALID and failure.kind is ErrorKind.RUNTIME
    assert failure.details["reason"] == "output_schema"
    assert [v["path"] for v in failure.details["violations"]] == ["/echo/n"]
    # The ledger keeps what the caller got.
    assert result.tool_request_id is not None
    invocation = await client.get_invocation(result.tool_request_id)
    assert invocation.message.outcome.error.code == "TOOL_RESULT_INVALID"
