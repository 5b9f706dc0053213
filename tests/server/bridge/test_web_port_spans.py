"""The bridge's web port makes the same server spans as its gRPC port: name, attributes, parent, status."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from spans import hear_in_process
from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.v1 import bridge_pb2, bridge_pb2_grpc, tool_pb2
from toolmesh_testing import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

SPANS = InMemorySpanExporter()
METHOD = "toolmesh.v1.BridgeService/SubmitToolResult"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def system() -> AsyncIterator[LocalSystem]:
    hear_in_process(SPANS)
    running = await start_local_system(heartbeat_s=0.3)
    yield running
    await running.stop(0.2)


def traceparent() -> tuple[str, int, int]:
    trace_id, span_id = secrets.randbits(128) | 1, secrets.randbits(64) | 1
    return f"00-{trace_id:032x}-{span_id:016x}-01", trace_id, span_id


async def server_span(trace_id: int) -> ReadableSpan:
    def found() -> ReadableSpan | None:
        for span in SPANS.get_finished_spans():
            assert span.context is not None
            if span.context.trace_id == trace_id and span.kind is SpanKind.SERVER and span.name == METHOD:
                return span
        return None

    span: ReadableSpan = await eventually(found, message=f"no {METHOD} server span in the trace")
    return span


async def test_a_web_port_call_has_the_grpc_ports_server_span(system: LocalSystem) -> None:
    submit = {"hostSessionId": "hs_x", "toolRequestId": "tr_x", "outcome": {"resultJson": "1"}}
    header, web_trace, web_parent = traceparent()
    async with httpx.AsyncClient(base_url=system.web_url, timeout=10) as http:
        response = await http.post(f"/{METHOD}", json=submit, headers={"traceparent": header})
    assert response.status_code == 404  # HOST_SESSION_UNKNOWN: the span says so too
    web = await server_span(web_trace)

    header, grpc_trace, grpc_parent = traceparent()
    async with grpc.aio.insecure_channel(system.bridge_target) as channel:
        stub = bridge_pb2_grpc.BridgeServiceStub(channel)
        request = bridge_pb2.SubmitToolResultRequest(
            host_session_id="hs_x", tool_request_id="tr_x", outcome=tool_pb2.ToolOutcome(result_json="1")
        )
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.SubmitToolResult(request, metadata=(("traceparent", header),))
    on_grpc = await server_span(grpc_trace)

    for span, parent in ((web, web_parent), (on_grpc, grpc_parent)):
        assert span.parent is not None and span.parent.span_id == parent
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == "HOST_SESSION_UNKNOWN"
        assert span.attributes is not None
        assert span.attributes["rpc.service"] == "toolmesh.v1.BridgeService"
        assert span.attributes["rpc.method"] == "SubmitToolResult"
    assert web.attributes is not None and on_grpc.attributes is not None
    assert (web.attributes["rpc.system"], on_grpc.attributes["rpc.system"]) == ("connect_rpc", "grpc")
