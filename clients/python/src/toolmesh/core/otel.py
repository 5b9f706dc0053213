"""Installing the OpenTelemetry SDK in a toolmesh process, and exporting over OTLP.

Export follows the standard OTEL_* environment variables: OTLP over gRPC when
OTEL_EXPORTER_OTLP_ENDPOINT (or the _TRACES_/_METRICS_ variant) is set, nothing
exported otherwise. OTEL_SDK_DISABLED=true turns the SDK off entirely.

The SDK and the exporter are optional for the client distribution (the `otlp`
extra) and always there for the servers; they are imported only when
something will receive the data, so a host or caller without them pays nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import baggage, metrics, trace
from opentelemetry.context import Context

from toolmesh.core import telemetry

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricReader
    from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

_log = logging.getLogger(__name__)


def _exporting(signal: str) -> bool:
    if os.environ.get(f"OTEL_{signal}_EXPORTER", "otlp").lower() == "none":
        return False
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    )


def configure(
    service_name: str,
    *,
    span_processors: Sequence[SpanProcessor] = (),
    metric_readers: Sequence[MetricReader] = (),
) -> None:
    """Install the SDK for this process when something will receive its data (once).

    With an OTLP endpoint configured, spans and metrics are exported; tests
    pass their own processors and readers. Otherwise the SDK is not installed:
    no span is made and the OpenTelemetry API stays a no-op, so telemetry
    costs nothing (logs still carry the correlation ids, set in each process).
    """
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return
    wanted = bool(span_processors or metric_readers) or _exporting("TRACES") or _exporting("METRICS")
    if not wanted:
        return
    try:
        _install(service_name, span_processors, metric_readers)
    except ImportError:
        # Asked to export, but the SDK is not installed: say so once, run without it.
        _log.warning("OTEL_* asks for export but the OpenTelemetry SDK is not installed (toolmesh[otlp])")


def _install(
    service_name: str, span_processors: Sequence[SpanProcessor], metric_readers: Sequence[MetricReader]
) -> None:
    # Imported here: the SDK is an optional dependency of the client distribution.
    from opentelemetry.sdk.metrics import MeterProvider  # noqa: PLC0415
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader  # noqa: PLC0415
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

    class CorrelationSpanProcessor(SpanProcessor):
        """Copies `toolmesh.*` baggage entries onto every span as it starts."""

        def on_start(self, span: Span, parent_context: Context | None = None) -> None:
            for key, value in baggage.get_all(parent_context).items():
                if key.startswith(telemetry.PREFIX):
                    span.set_attribute(key, str(value))

        def on_end(self, span: ReadableSpan) -> None:
            pass

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    processors = list(span_processors)
    if _exporting("TRACES"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: PLC0415

        processors.append(BatchSpanProcessor(OTLPSpanExporter()))
    if processors and not telemetry.enabled():
        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(CorrelationSpanProcessor())
        for processor in processors:
            tracer_provider.add_span_processor(processor)
        trace.set_tracer_provider(tracer_provider)
        telemetry.mark_installed()
    readers = list(metric_readers)
    if _exporting("METRICS"):
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter  # noqa: PLC0415

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if readers:
        metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))


def shutdown() -> None:
    """Flush and stop exporters; call before a process exits."""
    for provider in (trace.get_tracer_provider(), metrics.get_meter_provider()):
        stop: Any = getattr(provider, "shutdown", None)
        if callable(stop):
            stop()
