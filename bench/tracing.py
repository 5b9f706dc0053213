"""Tracing overhead: the same no-op call through toolmesh with tracing off and on, in one run.

"On" means every service and the host export their spans over OTLP/gRPC to a
receiver in this process (which counts them), as they would to a collector.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            for scope in resource_spans.scope_spans:
                self.spans += len(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@asynccontextmanager
async def otlp_receiver() -> AsyncIterator[tuple[SpanSink, dict[str, str]]]:
    """A running OTLP trace receiver and the environment that points exporters at it."""
    server = grpc.aio.server()
    sink = SpanSink()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_METRICS_EXPORTER": "none",
    }
    try:
        yield sink, env
    finally:
        await server.stop(0)


def ratios(off: dict[str, Any], on: dict[str, Any]) -> dict[str, float]:
    return {
        "p50": on["latency"]["p50_ms"] / off["latency"]["p50_ms"],
        "p99": on["latency"]["p99_ms"] / off["latency"]["p99_ms"],
        "calls_per_s": on["throughput"]["calls_per_s"] / off["throughput"]["calls_per_s"],
        "cpu_per_call": on["latency"]["cpu_ms_per_call"]["total"]
        / off["latency"]["cpu_ms_per_call"]["total"],
    }
