"""The one span exporter of the test process: the tracer provider is installed once per process,
so every test module that reads spans shares it."""

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

EXPORTER = InMemorySpanExporter()
