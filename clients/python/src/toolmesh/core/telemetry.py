"""Spans and correlation ids for every toolmesh process, on the OpenTelemetry API alone.

Correlation ids travel as W3C baggage entries named `toolmesh.*` (through gRPC
metadata on unary calls, and inside ToolRequest.trace_context across the
bridge stream). A span processor copies them onto every span as attributes,
so each span of a call (caller, invocation, registry, bridge, handler host)
carries the same `toolmesh.session_id`, `toolmesh.turn_id`,
`toolmesh.tool_request_id` and `toolmesh.tool_name`; spans that see the
outcome add `toolmesh.outcome_code`.

Installing the SDK and exporting is toolmesh.core.otel's job (the `otlp`
extra); without it every helper here is a no-op that costs next to nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import grpc
from opentelemetry import baggage, context, metrics, propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from toolmesh.core.errors import ToolmeshError
from toolmesh.core.outcome import ErrorKind, Outcome

PREFIX = "toolmesh."
SESSION_ID = "toolmesh.session_id"
TURN_ID = "toolmesh.turn_id"
TOOL_REQUEST_ID = "toolmesh.tool_request_id"
TOOL_NAME = "toolmesh.tool_name"
OUTCOME_CODE = "toolmesh.outcome_code"
JOINED = "toolmesh.joined"
REPLAYED = "toolmesh.replayed"

TRACER = trace.get_tracer("toolmesh")
# The correlation ids of the work in hand, for logs; a plain context variable
# so that it costs next to nothing when nothing is traced.
_IDS: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "toolmesh_ids", default=MappingProxyType({})
)
METER = metrics.get_meter("toolmesh")


class _SdkInstalled:
    """Whether the SDK's TracerProvider is installed, asked at most once a second while it is not.

    Asking OpenTelemetry reads the environment each time, and every call asks
    several times. Once installed it stays (a provider cannot be replaced);
    an application that installs its own later is seen within a second.
    """

    recheck_s = 1.0

    def __init__(self) -> None:
        self.installed = False
        self._next_check = 0.0

    def __call__(self) -> bool:
        if self.installed:
            return True
        now = time.monotonic()
        if now >= self._next_check:
            self.installed = not isinstance(trace.get_tracer_provider(), _API_DEFAULTS)
            self._next_check = now + self.recheck_s
        return self.installed


# What the API returns while no SDK provider is installed.
_API_DEFAULTS = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
_sdk_installed = _SdkInstalled()


def mark_installed() -> None:
    """Called by toolmesh.core.otel once it installs the SDK's provider."""
    _sdk_installed.installed = True


def enabled() -> bool:
    """Whether spans are recorded in this process (the SDK is installed)."""
    return _sdk_installed()


_CONTEXT_KEYS = ("traceparent", "tracestate", "baggage")


def extract_metadata(metadata: Any) -> Context:
    """The caller's trace context and baggage from gRPC invocation metadata."""
    carrier = {key: value for key, value in metadata or () if key in _CONTEXT_KEYS}
    return propagate.extract(carrier)


# Returned while not tracing: shared, immutable, nothing allocated per call.
_NO_CARRIER: Mapping[str, str] = MappingProxyType({})
_NO_METADATA: contextlib.nullcontext[list[tuple[str, str]]] = contextlib.nullcontext([])
_NO_CLIENT_SPAN: contextlib.nullcontext[Mapping[str, str]] = contextlib.nullcontext(_NO_CARRIER)
NO_SPAN: contextlib.nullcontext[Any] = contextlib.nullcontext(trace.INVALID_SPAN)


def client_call(full_method: str) -> contextlib.AbstractContextManager[list[tuple[str, str]]]:
    """A CLIENT span for one outgoing RPC (`package.Service/Method`); gives the metadata carrying it.

    Our own, instead of generic aio client interceptors: those cost an extra
    task and several protocol checks on every call.
    """
    if not enabled():
        return _NO_METADATA
    return _client_call(full_method)


@contextlib.contextmanager
def _client_call(full_method: str) -> Iterator[list[tuple[str, str]]]:
    with _client_span(full_method) as carrier:
        yield list(carrier.items())


def client_span(full_method: str) -> contextlib.AbstractContextManager[Mapping[str, str]]:
    """A CLIENT span for one request to `package.Service/Method`; gives the carrier of its context.

    For a request sent as a stream message, the carrier travels in the message.
    """
    if not enabled():
        return _NO_CLIENT_SPAN
    return _client_span(full_method)


@contextlib.contextmanager
def _client_span(full_method: str) -> Iterator[Mapping[str, str]]:
    service, _, name = full_method.rpartition("/")
    with TRACER.start_as_current_span(
        full_method,
        kind=SpanKind.CLIENT,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        record_exception=False,
        set_status_on_exception=False,
    ) as current:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        try:
            yield carrier
        except grpc.aio.AioRpcError as error:
            current.set_attribute("rpc.grpc.status_code", error.code().value[0])
            current.set_status(Status(StatusCode.ERROR, error.code().name))
            raise
        except ToolmeshError as error:
            current.set_status(Status(StatusCode.ERROR, error.code.value))
            raise
        current.set_attribute("rpc.grpc.status_code", 0)


def span(
    name: str,
    kind: SpanKind,
    carrier: Mapping[str, str] | None = None,
    *,
    attributes: Mapping[str, str] | None = None,
    end_on_exit: bool = True,
) -> contextlib.AbstractContextManager[Any]:
    """A current span (continuing the trace in `carrier`, if given); none at all when not tracing.

    Even the API's no-op tracer costs several microseconds per span. Without
    `end_on_exit`, whoever holds the span ends it.
    """
    if not enabled():
        return NO_SPAN
    parent = None if carrier is None else extract(carrier)
    return TRACER.start_as_current_span(
        name, context=parent, kind=kind, attributes=attributes, end_on_exit=end_on_exit
    )


class correlation:
    """Make ids (session_id=..., turn_id=...) current: for logs always; when tracing, also as
    `toolmesh.*` baggage (so they travel with the next call) and on the current span.

    A small class rather than a generator: calls hold it across awaits, by the thousand.
    """

    __slots__ = ("_context_token", "_given", "_ids_token")

    def __init__(self, **ids: str) -> None:
        self._given = tuple((name, value) for name, value in ids.items() if value)

    def __enter__(self) -> None:
        given = self._given
        ids = dict(_IDS.get())
        ids.update(given)
        self._ids_token = _IDS.set(ids)
        self._context_token: contextvars.Token[Context] | None = None
        if enabled():
            ctx = context.get_current()
            current = trace.get_current_span()
            for name, value in given:
                ctx = baggage.set_baggage(PREFIX + name, value, ctx)
                current.set_attribute(PREFIX + name, value)
            self._context_token = context.attach(ctx)

    def __exit__(self, *exc_info: object) -> None:
        if self._context_token is not None:
            context.detach(self._context_token)
        _IDS.reset(self._ids_token)


def correlation_ids() -> dict[str, str]:
    """The ids made current by `correlation` (for logs)."""
    return dict(_IDS.get())


def inject() -> dict[str, str]:
    """The current trace context and baggage as a carrier for a message (empty when not tracing)."""
    carrier: dict[str, str] = {}
    if enabled():
        propagate.inject(carrier)
    return carrier


_TRACE_CONTEXT = TraceContextTextMapPropagator()


def trace_carrier() -> dict[str, str]:
    """Only the current span's W3C traceparent (no baggage): cheap enough to keep for links."""
    carrier: dict[str, str] = {}
    if trace.get_current_span().get_span_context().is_valid:
        _TRACE_CONTEXT.inject(carrier)
    return carrier


def extract(carrier: Mapping[str, str]) -> Context:
    return propagate.extract(dict(carrier))


def record_outcome(outcome: Outcome) -> None:
    """Put the outcome code on the current span; runtime errors (not domain errors) mark it as an error."""
    if not enabled():
        return
    target = trace.get_current_span()
    target.set_attribute(OUTCOME_CODE, outcome.code)
    failure = outcome.failure
    if failure is not None and failure.kind is ErrorKind.RUNTIME:
        target.set_status(Status(StatusCode.ERROR, failure.code))
