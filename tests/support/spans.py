"""Spans as tests read them: the one in-memory exporter of the test process, and a real OTLP receiver.

The tracer provider is installed once per process, so every test module that reads spans in
process shares EXPORTER. Receiver is what a collector would get from service processes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from toolmesh.core import otel, telemetry

EXPORTER = InMemorySpanExporter()


def hear_in_process(exporter: InMemorySpanExporter) -> None:
    """Trace in this process (installed once per process, into EXPORTER), and let `exporter`, a
    module's own, hear every span from now on, whichever module installed the provider."""
    otel.configure("toolmesh-test", span_processors=[SimpleSpanProcessor(EXPORTER)])
    assert telemetry.enabled()
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))


def _service_of(resource: Any) -> str:
    return next((a.value.string_value for a in resource.attributes if a.key == "service.name"), "")


class Receiver(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    """A real OTLP/gRPC receiver of traces and metrics: (service.name, span or metric) as they arrive."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []
        self.metrics: list[tuple[str, Any]] = []

    async def Export(self, request: Any, context: Any) -> Any:
        if isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
            for resource_metrics in request.resource_metrics:
                service = _service_of(resource_metrics.resource)
                for scope in resource_metrics.scope_metrics:
                    self.metrics.extend((service, metric) for metric in scope.metrics)
            return metrics_service_pb2.ExportMetricsServiceResponse()
        for resource_spans in request.resource_spans:
            service = _service_of(resource_spans.resource)
            for scope in resource_spans.scope_spans:
                self.spans.extend((service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@asynccontextmanager
async def otlp_receiver() -> AsyncIterator[tuple[Receiver, int]]:
    """A Receiver on a free loopback port: it, and the port."""
    server = grpc.aio.server()
    sink = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)  # type: ignore[no-untyped-call]
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(sink, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield sink, port
    finally:
        await server.stop(0)
