"""Spans for every toolmesh process, on the OpenTelemetry API alone.

Whether spans are recorded at all, the client and server span of each RPC,
trace context carried in messages, and the outcome on a span (spans that see
it add `toolmesh.outcome_code`). The correlation ids every span also carries
are toolmesh.core.correlation's.

Installing the SDK and exporting is toolmesh.core.otel's job (the `otlp`
extra); without it every helper here is a no-op that costs next to nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import grpc
from opentelemetry import metrics, propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from toolmesh.core.errors import ToolmeshError
from toolmesh.core.outcome import ErrorKind, Outcome

# Span attributes, all in the `toolmesh.` namespace.
PREFIX = "toolmesh."
SESSION_ID = "toolmesh.session_id"
TURN_ID = "toolmesh.turn_id"
TOOL_REQUEST_ID = "toolmesh.tool_request_id"
TOOL_NAME = "toolmesh.tool_name"
OUTCOME_CODE = "toolmesh.outcome_code"
JOINED = "toolmesh.joined"
REPLAYED = "toolmesh.replayed"

# The OpenTelemetry semantic conventions toolmesh follows besides its own names: GenAI
# (execute_tool, chat) and MCP, both in development, as of semantic conventions 1.44.0
# (the opentelemetry-semantic-conventions package 0.66b2). Written out, not imported
# from its `_incubating` modules, which may move.
SEMCONV_VERSION = "1.44.0"
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_TOOL_TYPE = "gen_ai.tool.type"
ERROR_TYPE = "error.type"
EXECUTE_TOOL = "execute_tool"

TRACER = trace.get_tracer("toolmesh")
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
    `end_on_exit`, whoever holds the span ends it. An exception that passes
    through marks the span as an error with its type only: its text may quote
    arguments or results, so it is never recorded.
    """
    if not enabled():
        return NO_SPAN
    parent = None if carrier is None else extract(carrier)
    return _span_naming_exceptions_by_type(
        TRACER.start_as_current_span(
            name,
            context=parent,
            kind=kind,
            attributes=attributes,
            end_on_exit=end_on_exit,
            record_exception=False,
            set_status_on_exception=False,
        )
    )


@contextlib.contextmanager
def _span_naming_exceptions_by_type(started: contextlib.AbstractContextManager[Any]) -> Iterator[Any]:
    with started as current:
        try:
            yield current
        except Exception as exc:
            current.set_status(Status(StatusCode.ERROR, type(exc).__qualname__))
            raise


def execute_tool_span(
    tool_name: str,
    tool_request_id: str,
    kind: SpanKind = SpanKind.INTERNAL,
    carrier: Mapping[str, str] | None = None,
) -> contextlib.AbstractContextManager[Any]:
    """The GenAI conventions' execute-tool span: `execute_tool {tool}`, with the gen_ai.tool.* ids.

    Beside the `toolmesh.*` attributes, which every span carries. Never the arguments or the
    result (the conventions' opt-in gen_ai.tool.call.arguments / .result are not set).
    """
    if not enabled():
        return NO_SPAN
    return span(
        f"{EXECUTE_TOOL} {tool_name}",
        kind,
        carrier,
        attributes={
            GEN_AI_OPERATION_NAME: EXECUTE_TOOL,
            GEN_AI_TOOL_NAME: tool_name,
            GEN_AI_TOOL_CALL_ID: tool_request_id,
            GEN_AI_TOOL_TYPE: "function",
            TOOL_NAME: tool_name,
            TOOL_REQUEST_ID: tool_request_id,
        },
    )


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


def record_tool_outcome(outcome: Outcome) -> None:
    """As record_outcome, on an execute-tool span: a runtime error's code is also its `error.type`.

    A domain error is the tool's answer, not a failure to execute it: no error.type, as no
    Error status (its code is in `toolmesh.outcome_code`).
    """
    if not enabled():
        return
    record_outcome(outcome)
    failure = outcome.failure
    if failure is not None and failure.kind is ErrorKind.RUNTIME:
        trace.get_current_span().set_attribute(ERROR_TYPE, failure.code)


def record_tool_failure(code: str) -> None:
    """An execute-tool span that ended without an outcome: the runtime code it ended with."""
    if not enabled():
        return
    target = trace.get_current_span()
    target.set_attribute(ERROR_TYPE, code)
    target.set_status(Status(StatusCode.ERROR, code))
