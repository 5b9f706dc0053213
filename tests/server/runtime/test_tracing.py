"""One trace per tool call, across every hop, with correlation ids and outcome codes; and metrics."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Collection
from typing import Any

import pytest
import pytest_asyncio
from opentelemetry import trace
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import StatusCode

from spans import EXPORTER
from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.client import CallResult, InvocationClient, RegistryClient
from toolmesh.core import otel, telemetry
from toolmesh.core.tools import ToolSpec
from toolmesh.host import ToolContext, ToolHost
from toolmesh_testing import eventually, logged

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SESSION = "traced"
METRICS = InMemoryMetricReader()
# Calls of `ok` with {"hold": true} wait here until released.
HELD: list[str] = []
RELEASE = asyncio.Event()


async def ok(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    if args.get("hold"):
        HELD.append(ctx.tool_request_id)
        await RELEASE.wait()
    return {"fine": True}


def domain(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return {"error": {"code": "OUT_OF_STOCK", "message": "Nothing left."}}


def broken(args: dict[str, Any], ctx: ToolContext) -> None:
    raise ValueError("no")


async def slow(args: dict[str, Any], ctx: ToolContext) -> None:
    await asyncio.sleep(10)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def traced() -> AsyncIterator[tuple[LocalSystem, InvocationClient]]:
    otel.configure("toolmesh-test", span_processors=[SimpleSpanProcessor(EXPORTER)], metric_readers=[METRICS])
    assert isinstance(trace.get_tracer_provider(), TracerProvider), "another test configured tracing first"
    system = await start_local_system(heartbeat_s=0.5)
    async with RegistryClient(system.registry_target) as registry:
        await registry.put_tools(
            SESSION,
            [
                ToolSpec(name, "", '{"type": "object"}', timeout_ms=300)
                for name in ("ok", "domain", "broken", "slow")
            ],
        )
    host = ToolHost(system.bridge_target, SESSION)
    for name, handler in {"ok": ok, "domain": domain, "broken": broken, "slow": slow}.items():
        host.on_tool(name, handler)
    await host.start()
    async with InvocationClient(system.invocation_target) as client:
        yield system, client
    await host.stop()
    await system.stop(0.5)


def spans_of(trace_id: int) -> list[ReadableSpan]:
    return [
        span for span in EXPORTER.get_finished_spans() if span.context and span.context.trace_id == trace_id
    ]


def execute_tool(tool: str) -> str:
    """The GenAI execute-tool span's name: the invocation's run (INTERNAL) and the host's handler (SERVER)."""
    return f"execute_tool {tool}"


def expected_hops(tool: str) -> set[str]:
    return {
        "toolmesh.call_tool",
        "toolmesh.v1.InvocationService/InvokeTool",
        execute_tool(tool),
        "toolmesh.v1.BridgeService/DispatchToolRequests",
        "toolmesh.v1.BridgeService/SubmitToolResult",
    }


# Spans made on one side only; every other hop is a gRPC call, with a client and a server span.
ONE_SIDED = {"toolmesh.call_tool": ("CLIENT",)}


def sides(hop: str) -> tuple[str, ...]:
    if hop.startswith("execute_tool "):
        return ("INTERNAL", "SERVER")
    return ONE_SIDED.get(hop, ("CLIENT", "SERVER"))


async def traced_call(
    client: InvocationClient, tool: str, args: Any = None, hops: Collection[str] | None = None
) -> tuple[CallResult, list[ReadableSpan]]:
    """Make the call, and wait until the spans of every one of `hops` have ended."""
    hops = expected_hops(tool) if hops is None else hops
    result = await client.invoke(SESSION, tool, args or {}, turn_id=f"turn-{tool}")

    def trace_id() -> int | None:
        roots = [
            span
            for span in EXPORTER.get_finished_spans()
            if span.name == "toolmesh.call_tool"
            and span.attributes
            and span.attributes.get(telemetry.TOOL_REQUEST_ID) == result.tool_request_id
        ]
        assert len(roots) <= 1, roots
        return roots[0].context.trace_id if roots and roots[0].context else None

    found = await eventually(trace_id)
    expected = {(hop, side) for hop in hops for side in sides(hop)}
    await eventually(lambda: expected <= {(span.name, span.kind.name) for span in spans_of(found)})
    return result, spans_of(found)


# The tool request id exists once the ledger has the call: the registry lookup and
# the caller's InvokeTool span come before it (the caller's own span gets it from the response).
BEFORE_ID = {
    ("toolmesh.v1.RegistryService/GetTool", "CLIENT"),
    ("toolmesh.v1.RegistryService/GetTool", "SERVER"),
    ("toolmesh.v1.InvocationService/InvokeTool", "CLIENT"),
}
# Spans that see the outcome carry its code.
WITH_OUTCOME = {
    ("toolmesh.call_tool", "CLIENT"),
    ("toolmesh.v1.InvocationService/InvokeTool", "SERVER"),
    ("toolmesh.v1.BridgeService/DispatchToolRequests", "SERVER"),
    ("execute_tool", "INTERNAL"),
    ("execute_tool", "SERVER"),
    ("toolmesh.v1.BridgeService/SubmitToolResult", "SERVER"),
}


def kind_of(span: ReadableSpan) -> tuple[str, str]:
    name = "execute_tool" if span.name.startswith("execute_tool ") else span.name
    return name, span.kind.name


def check_one_trace(result: CallResult, spans: list[ReadableSpan], tool: str, code: str) -> None:
    names = {span.name for span in spans}
    hops = expected_hops(tool)
    assert names >= hops, names
    # Client and server span of each gRPC hop: the trace is connected through every process boundary.
    for hop in hops:
        kinds = {span.kind.name for span in spans if span.name == hop}
        assert kinds == set(sides(hop)), (hop, kinds)
    ids = {span.context.span_id for span in spans if span.context}
    orphans = [span.name for span in spans if span.parent is not None and span.parent.span_id not in ids]
    assert orphans == []
    for span in spans:
        attributes = dict(span.attributes or {})
        assert attributes[telemetry.SESSION_ID] == SESSION, span.name
        assert attributes[telemetry.TURN_ID] == f"turn-{tool}", span.name
        assert attributes[telemetry.TOOL_NAME] == tool, span.name
        if kind_of(span) not in BEFORE_ID:
            assert attributes.get(telemetry.TOOL_REQUEST_ID) == result.tool_request_id, span.name
        if kind_of(span) in WITH_OUTCOME:
            assert attributes.get(telemetry.OUTCOME_CODE) == code, span.name
    check_execute_tool_spans(result, spans, tool, code)


def check_execute_tool_spans(result: CallResult, spans: list[ReadableSpan], tool: str, code: str) -> None:
    """The GenAI execute-tool spans: the invocation's run, and its child in the host, under it."""
    executing = {span.kind.name: span for span in spans if span.name == execute_tool(tool)}
    assert set(executing) == {"INTERNAL", "SERVER"}
    run, handler = executing["INTERNAL"], executing["SERVER"]
    assert run.context is not None and handler.parent is not None
    assert handler.context is not None and handler.context.trace_id == run.context.trace_id
    runtime_error = code.startswith("TOOL_") and code != "OK"
    for span in (run, handler):
        attributes = dict(span.attributes or {})
        assert attributes["gen_ai.operation.name"] == "execute_tool"
        assert attributes["gen_ai.tool.name"] == tool
        assert attributes["gen_ai.tool.call.id"] == result.tool_request_id
        assert attributes["gen_ai.tool.type"] == "function"
        assert attributes.get("error.type") == (code if runtime_error else None), span.kind.name
        assert (span.status.status_code is StatusCode.ERROR) is runtime_error
    # The run is an ancestor of the dispatch to the bridge, and so of the handler.
    dispatch = next(
        span for span in spans if span.name.endswith("DispatchToolRequests") and span.kind.name == "CLIENT"
    )
    assert dispatch.parent is not None and dispatch.parent.span_id == run.context.span_id


async def test_success_is_one_connected_trace(traced: Any) -> None:
    result, spans = await traced_call(traced[1], "ok")
    check_one_trace(result, spans, "ok", "OK")
    assert all(span.status.status_code is not StatusCode.ERROR for span in spans)


async def test_domain_error_is_not_a_span_error(traced: Any) -> None:
    result, spans = await traced_call(traced[1], "domain")
    check_one_trace(result, spans, "domain", "OUT_OF_STOCK")
    assert all(span.status.status_code is not StatusCode.ERROR for span in spans)


async def test_handler_error_marks_spans_as_errors(traced: Any) -> None:
    result, spans = await traced_call(traced[1], "broken")
    check_one_trace(result, spans, "broken", "TOOL_HANDLER_ERROR")
    errored = {span.name for span in spans if span.status.status_code is StatusCode.ERROR}
    assert {
        "toolmesh.call_tool",
        "execute_tool broken",
        "toolmesh.v1.InvocationService/InvokeTool",
    } <= errored


async def test_timeout_trace_includes_the_cancelled_handler(traced: Any) -> None:
    hops = {"toolmesh.call_tool", "execute_tool slow", "toolmesh.v1.BridgeService/DispatchToolRequests"}
    result, spans = await traced_call(traced[1], "slow", hops=hops)
    assert result.outcome is not None and result.outcome.code == "TOOL_TIMEOUT"
    handle = [span for span in spans if span.name == "execute_tool slow" and span.kind.name == "SERVER"]
    assert len(handle) == 1 and (handle[0].attributes or {}).get("toolmesh.cancelled") is True
    run = [span for span in spans if span.name == "execute_tool slow" and span.kind.name == "INTERNAL"]
    assert len(run) == 1 and (run[0].attributes or {}).get("error.type") == "TOOL_TIMEOUT"
    dispatch = [s for s in spans if s.name.endswith("DispatchToolRequests") and s.kind.name == "SERVER"]
    assert (dispatch[0].attributes or {})[telemetry.OUTCOME_CODE] == "TOOL_TIMEOUT"
    assert dispatch[0].status.status_code is StatusCode.ERROR


async def test_joined_retry_links_to_the_original_invocation(
    traced: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client: InvocationClient = traced[1]
    HELD.clear()
    RELEASE.clear()
    with caplog.at_level(logging.INFO, logger="toolmesh.invocation"):
        first = asyncio.ensure_future(client.invoke(SESSION, "ok", {"hold": True}, turn_id="turn-ok"))
        await eventually(lambda: HELD)  # the original runs
        retry = asyncio.ensure_future(client.invoke(SESSION, "ok", {"hold": True}, turn_id="turn-ok"))
        await eventually(lambda: logged(caplog.records, "joined a running invocation"))
        RELEASE.set()
        original, second = await first, await retry
    assert second.joined and second.tool_request_id == original.tool_request_id
    assert [original.tool_request_id] == HELD  # it ran once

    def attributes(span: ReadableSpan) -> dict[str, Any]:
        return dict(span.attributes or {})

    def joined_span() -> ReadableSpan | None:
        return next(
            (
                span
                for span in EXPORTER.get_finished_spans()
                if span.name == "toolmesh.joined"
                and attributes(span).get(telemetry.TOOL_REQUEST_ID) == original.tool_request_id
            ),
            None,
        )

    def original_span() -> ReadableSpan | None:
        return next(
            (
                span
                for span in EXPORTER.get_finished_spans()
                if span.name == "toolmesh.v1.InvocationService/InvokeTool"
                and span.kind.name == "SERVER"
                and attributes(span).get(telemetry.TOOL_REQUEST_ID) == original.tool_request_id
                and not attributes(span).get(telemetry.JOINED)
            ),
            None,
        )

    span = await eventually(joined_span, message="no span for the joined call, with the original's id")
    invocation = await eventually(original_span, message="no span for the original invocation")
    assert invocation.context is not None
    assert [link.context.trace_id for link in span.links] == [invocation.context.trace_id]


async def test_metrics_count_calls_by_outcome_with_bounded_labels(traced: Any) -> None:
    await traced_call(traced[1], "ok")
    await traced_call(traced[1], "domain")
    data = METRICS.get_metrics_data()
    assert data is not None
    points: dict[str, list[Any]] = {}
    for resource_metrics in data.resource_metrics:
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                points.setdefault(metric.name, []).extend(metric.data.data_points)
    # No tool name (each tenant names its own) nor a domain error's own code: bounded labels.
    assert {key for p in points["toolmesh.invocations"] for key in p.attributes} == {"toolmesh.outcome_code"}
    calls = {p.attributes["toolmesh.outcome_code"]: p.value for p in points["toolmesh.invocations"]}
    assert calls["OK"] >= 1
    assert calls["TOOL_HANDLER_ERROR"] >= 1
    assert calls["DOMAIN_ERROR"] >= 1
    assert sum(p.count for p in points["toolmesh.invocation.duration"]) >= 4
    assert [p.value for p in points["toolmesh.invocations.in_flight"]] == [0]
    assert sum(p.value for p in points["toolmesh.invocations.attached"]) >= 1
    assert [p.value for p in points["toolmesh.bridge.hosts"]] == [1]


async def test_a_call_on_the_invoke_tools_stream_is_one_connected_trace(traced: Any) -> None:
    system: LocalSystem = traced[0]
    streamed_hops = expected_hops("ok") - {"toolmesh.v1.InvocationService/InvokeTool"} | {
        "toolmesh.v1.InvocationService/InvokeTools"
    }
    async with InvocationClient(system.invocation_target, multiplex=True) as client:
        result, spans = await traced_call(client, "ok", hops=streamed_hops)
    assert {span.name for span in spans} >= streamed_hops
    kinds = {span.kind.name for span in spans if span.name == "toolmesh.v1.InvocationService/InvokeTools"}
    assert kinds == {"CLIENT", "SERVER"}
    ids = {span.context.span_id for span in spans if span.context}
    assert [span.name for span in spans if span.parent is not None and span.parent.span_id not in ids] == []
    for span in spans:
        attributes = dict(span.attributes or {})
        assert attributes[telemetry.SESSION_ID] == SESSION, span.name
        assert attributes[telemetry.TOOL_NAME] == "ok", span.name
    server = [s for s in spans if s.name.endswith("InvokeTools") and s.kind.name == "SERVER"]
    assert (server[0].attributes or {}).get(telemetry.TOOL_REQUEST_ID) == result.tool_request_id
