"""One trace from an MCP client through toolmesh to an MCP server, in the MCP conventions' names.

Every process exports to a real OTLP receiver: the services, the HTTP gateway (`toolmesh mcp
--http`), `toolmesh host --mcp` and the MCP server behind it (the MCP SDK's). The MCP SDK
client sends the call with `_meta.traceparent` of a trace of the test's own.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from opentelemetry import context, propagate
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from prometheus_client.parser import text_string_to_metric_families

from spans import Receiver, otlp_receiver
from toolmesh.client import RegistryClient
from toolmesh_testing import (
    SUPPORT,
    HostProcess,
    ServiceProcess,
    eventually,
    start_service_process,
    toolmesh_command,
)

# Seven processes start in the first test's fixture: slow on a loaded machine.
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

SESSION = "mcp-traced"


def attributes(span: Any) -> dict[str, Any]:
    values = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        values[a.key] = getattr(a.value, kind) if kind else None
    return values


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def receiver() -> AsyncIterator[tuple[Receiver, int]]:
    async with otlp_receiver() as running:
        yield running


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def traced(
    receiver: tuple[Receiver, int], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Any]:
    """The services, the host of the MCP server and the HTTP gateway, all exporting; yields the
    gateway's session URL and metrics URL."""
    env = dict(
        os.environ,
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver[1]}",
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_METRIC_EXPORT_INTERVAL="300",
    )
    processes: list[ServiceProcess] = []
    children: list[asyncio.subprocess.Process] = []
    try:
        registry = await start_service_process("registry", env=env)
        processes.append(registry)
        bridge = await start_service_process("bridge", "--registry", registry.internal_target, env=env)
        processes.append(bridge)
        invocation = await start_service_process(
            "invocation", "--registry", registry.internal_target, "--bridge", bridge.internal_target, env=env
        )
        processes.append(invocation)
        env.update(TOOLMESH_REGISTRY_ADDR=registry.target, TOOLMESH_INVOCATION_ADDR=invocation.target)
        # The MCP SDK starts a stdio server with a minimal environment: the OTLP settings said here.
        exporting = " ".join(f"{k}={v}" for k, v in env.items() if k.startswith("OTEL_"))
        server = (
            f"env {exporting} {sys.executable} {SUPPORT / 'mcp_server.py'} "
            f"{tmp_path_factory.mktemp('mcp-markers')}"
        )
        host_process = await asyncio.create_subprocess_exec(
            *toolmesh_command(),
            *("host", "--thread-id", SESSION, "--mcp", server, "--bridge", bridge.target),
            cwd=SUPPORT,
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        children.append(host_process)
        host = HostProcess(host_process)

        async def read() -> None:
            assert host_process.stderr is not None
            async for line in host_process.stderr:
                host.stderr_lines.append(line.decode(errors="replace"))

        host._reader = asyncio.create_task(read())
        await host.wait_for_log(msg="host ready", timeout=60)
        gateway = await asyncio.create_subprocess_exec(
            *toolmesh_command(),
            *("mcp", "--http", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        children.append(gateway)
        assert gateway.stdout is not None
        metrics_line = (await asyncio.wait_for(gateway.stdout.readline(), 60)).decode()
        serving_line = (await asyncio.wait_for(gateway.stdout.readline(), 60)).decode()
        assert metrics_line.startswith("toolmesh mcp: metrics on http://127.0.0.1:"), metrics_line
        base = serving_line.split("serving ", 1)[1].split("/sessions/", 1)[0]
        async with RegistryClient(registry.target) as client:

            async def declared() -> bool:
                tools = await client.list_tools(SESSION)
                return {"add", "fail"} <= {tool.name for tool in tools.tools}

            await eventually(declared, timeout=30, message="the MCP server's tools were never declared")
        yield f"{base}/sessions/{SESSION}/mcp", metrics_line.split("metrics on ", 1)[1].strip()
    finally:
        for child in children:
            if child.returncode is None:
                child.terminate()
                await asyncio.wait_for(child.wait(), 15)
        for process in processes:
            await process.stop()


async def call_in_trace(url: str, tool: str, arguments: dict[str, Any]) -> tuple[bytes, bytes]:
    """The tools/call, sent from within a span context of the test's own: its trace and span ids."""
    trace_id, span_id = secrets.token_bytes(16), secrets.token_bytes(8)
    parent = propagate.extract({"traceparent": f"00-{trace_id.hex()}-{span_id.hex()}-01"})
    token = context.attach(parent)
    try:
        async with Client(streamable_http_client(url), mode="legacy") as client:
            await client.call_tool(tool, arguments)
    finally:
        context.detach(token)
    return trace_id, span_id


async def spans_of_trace(
    sink: Receiver, trace_id: bytes, wanted: set[tuple[str, str]]
) -> list[tuple[str, Any]]:
    """The trace's spans once every (service, span name) of `wanted` has arrived."""

    def all_there() -> list[tuple[str, Any]]:
        found = [(service, span) for service, span in sink.spans if span.trace_id == trace_id]
        missing = wanted - {(service, span.name) for service, span in found}
        assert not missing, f"{sorted(missing)} missing; there: {sorted({s for s, _ in found})}"
        return found

    spans: list[tuple[str, Any]] = await eventually(all_there, timeout=30)
    return spans


async def test_one_trace_runs_from_the_mcp_client_through_toolmesh_to_the_mcp_server(
    traced: tuple[str, str], receiver: tuple[Receiver, int]
) -> None:
    trace_id, _ = await call_in_trace(traced[0], "add", {"a": 2, "b": 3})
    wanted = {
        ("toolmesh-mcp", "tools/call add"),
        ("toolmesh-invocation", "execute_tool add"),
        ("toolmesh-bridge", "toolmesh.v1.BridgeService/SubmitToolResult"),
        ("toolmesh-host", "tools/call add"),
        ("toolmesh-test-mcp-server", "tools/call add"),
    }
    spans = await spans_of_trace(receiver[0], trace_id, wanted)
    by_service: dict[str, list[Any]] = {}
    for service, span in spans:
        by_service.setdefault(service, []).append(span)

    # The gateway's SERVER span, as the MCP conventions name it, continues the client's trace.
    # (The session's initialize is in the trace too: the client sent it from the same context.)
    (served,) = [
        s
        for s in by_service["toolmesh-mcp"]
        if s.kind == Span.SPAN_KIND_SERVER and s.name == "tools/call add"
    ]
    served_attributes = attributes(served)
    assert served_attributes["mcp.method.name"] == "tools/call"
    assert served_attributes["jsonrpc.request.id"]
    assert served_attributes["mcp.protocol.version"]
    assert served.parent_span_id  # the client's span (from _meta.traceparent)
    # toolmesh's own spans (the invocation's execute_tool, the bridge's, the host's) are in this
    # trace: `wanted` waited for them.
    # The host's CLIENT span to the MCP server, in the conventions' names.
    (sent,) = [s for s in by_service["toolmesh-host"] if s.name == "tools/call add"]
    assert sent.kind == Span.SPAN_KIND_CLIENT
    assert attributes(sent)["mcp.method.name"] == "tools/call"
    assert attributes(sent)["mcp.protocol.version"]
    # The MCP server's span is a child of the host's (via the request's _meta.traceparent).
    host_ids = {s.span_id for s in by_service["toolmesh-host"]}
    (behind,) = [
        s
        for s in by_service["toolmesh-test-mcp-server"]
        if s.kind == Span.SPAN_KIND_SERVER and s.name == "tools/call add"
    ]
    assert behind.parent_span_id in host_ids
    # An MCP session id is a bearer capability: on no span.
    assert not any("mcp.session.id" in attributes(span) for _, span in spans)


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
        return body.decode()


async def test_both_durations_are_recorded_by_method_and_error_type(
    traced: tuple[str, str], receiver: tuple[Receiver, int]
) -> None:
    await call_in_trace(traced[0], "add", {"a": 1, "b": 1})
    await call_in_trace(traced[0], "fail", {"reason": "no"})
    # Server side: the gateway's scrape endpoint.
    text = await asyncio.to_thread(fetch, traced[1])
    served = {
        (s.labels["mcp_method_name"], s.labels.get("error_type", "")): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "mcp_server_operation_duration_seconds"
        for s in family.samples
        if s.name.endswith("_count")
    }
    assert served.get(("tools/call", ""), 0) >= 1, served
    assert served.get(("tools/call", "tool_error"), 0) >= 1, served
    assert ("_OTHER", "") not in served, served  # every method the SDK client sends is MCP's
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert "gen_ai_tool_name" not in sample.labels  # no tool names on metrics

    # Client side: the host's OTLP metrics.
    async def client_points() -> set[tuple[str, str]] | None:
        seen = set()
        for service, metric in receiver[0].metrics:
            if service == "toolmesh-host" and metric.name == "mcp.client.operation.duration":
                assert metric.unit == "s"
                for point in metric.histogram.data_points:
                    labels = attributes(point)
                    seen.add((labels["mcp.method.name"], labels.get("error.type", "")))
        return seen if {("tools/call", ""), ("tools/call", "tool_error")} <= seen else None

    seen = await eventually(
        client_points, timeout=30, message="no mcp.client.operation.duration from the host"
    )
    assert ("tools/list", "") in seen
