"""What the invocation service tells operators: the InvocationObserver over OpenTelemetry and the log.

Correlation ids (for logs always, as baggage when tracing), span attributes,
links from joined and replayed calls to the original invocation, metrics,
and one log line per call.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from types import MappingProxyType, TracebackType

from opentelemetry import trace
from opentelemetry.trace import Link

from toolmesh.contracts.ledger import InvocationRecord
from toolmesh.core import correlation, telemetry
from toolmesh.core.calls import ToolCall, ToolRequest
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import ErrorKind, Outcome
from toolmesh.invocation.ports import NOT_EXECUTING, ExecuteObservation

log = logging.getLogger("toolmesh.invocation")

CALLS = telemetry.METER.create_counter(
    "toolmesh.invocations", unit="{call}", description="Tool calls by outcome code"
)
DURATION = telemetry.METER.create_histogram(
    "toolmesh.invocation.duration", unit="s", description="Time from InvokeTool to its outcome"
)
IN_FLIGHT = telemetry.METER.create_up_down_counter(
    "toolmesh.invocations.in_flight", unit="{invocation}", description="Invocations running in this process"
)
ATTACHED = telemetry.METER.create_counter(
    "toolmesh.invocations.attached", unit="{call}", description="Calls that joined or replayed an invocation"
)


class _ObservedCall(correlation.ids):
    """The call's ids made current, and when it began; one object per call, as `ids` alone was."""

    __slots__ = ("_started", "_tool_name")

    def __init__(self, call: ToolCall) -> None:
        # As ids(session_id=..., turn_id=..., tool_name=...), without the keywords: a checked
        # call has all three.
        self._given = (
            ("session_id", call.session_id),
            ("turn_id", call.turn_id),
            ("tool_name", call.tool_name),
        )
        self._tool_name = call.tool_name
        self._started = time.monotonic()

    def answered(self, tool_request_id: str, outcome: Outcome) -> None:
        if tool_request_id:
            trace.get_current_span().set_attribute(telemetry.TOOL_REQUEST_ID, tool_request_id)
        observe(self._tool_name, tool_request_id, outcome, self._started)


class _Executing:
    """The GenAI execute-tool span around a new invocation's run (toolmesh.core.telemetry)."""

    __slots__ = ("_span",)

    def __init__(self, request: ToolRequest) -> None:
        self._span = telemetry.execute_tool_span(request.tool_name, request.tool_request_id)

    def __enter__(self) -> _Executing:
        self._span.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(error, ToolmeshError):
            # The run failed with a runtime code (the bridge could not be reached, ...): that code.
            telemetry.record_tool_failure(error.code.value)
            self._span.__exit__(None, None, None)
            return
        self._span.__exit__(kind, error, tb)

    def ran(self, outcome: Outcome) -> None:
        telemetry.record_tool_outcome(outcome)


class InvocationTelemetry:
    """The invocation service's InvocationObserver in every process that serves it."""

    __slots__ = ()

    def call(self, call: ToolCall) -> _ObservedCall:
        return _ObservedCall(call)

    def invocation(self, tool_request_id: str) -> correlation.ids:
        return correlation.ids(tool_request_id=tool_request_id)

    def attached(self, record: InvocationRecord, how: str) -> contextlib.AbstractContextManager[None]:
        return attaching(record, how)

    def executing(self, request: ToolRequest) -> ExecuteObservation:
        return _Executing(request) if telemetry.enabled() else NOT_EXECUTING

    def in_flight(self, change: int) -> None:
        IN_FLIGHT.add(change)

    def trace_context(self) -> dict[str, str]:
        return telemetry.trace_carrier()


# Metric labels are bounded and name no tenant (an operator scrapes them, toolmesh.core.scrape):
# never a session, a tool name (each tenant's host names its own tools) or a domain error's own
# code (the tool's); a runtime code is one of the error table's.
DOMAIN_ERROR = "DOMAIN_ERROR"
_RUNTIME_CODES = frozenset(code.value for code in Code)
_BY_CODE = {
    code: MappingProxyType({telemetry.OUTCOME_CODE: code}) for code in {"OK", DOMAIN_ERROR, *_RUNTIME_CODES}
}


def metric_attributes(outcome: Outcome) -> Mapping[str, str]:
    """The call's metric labels: `toolmesh.outcome_code` OK, a runtime code, or DOMAIN_ERROR."""
    failure = outcome.failure
    if failure is None:
        return _BY_CODE["OK"]
    if failure.kind is ErrorKind.DOMAIN:
        return _BY_CODE[DOMAIN_ERROR]
    return _BY_CODE.get(failure.code, _BY_CODE[Code.INTERNAL.value])


def observe(tool_name: str, tool_request_id: str, outcome: Outcome, started: float) -> None:
    """Span, metrics and one log line per call; the log carries ids and the code, never data."""
    elapsed = time.monotonic() - started
    telemetry.record_outcome(outcome)
    attributes = metric_attributes(outcome)
    CALLS.add(1, attributes)
    DURATION.record(elapsed, attributes)
    failed_in_runtime = outcome.failure is not None and outcome.failure.kind is ErrorKind.RUNTIME
    level = logging.INFO if failed_in_runtime else logging.DEBUG
    if not log.isEnabledFor(level):
        return
    log.log(
        level,
        "tool call ended",
        extra={
            "tool_request_id": tool_request_id,
            "code": outcome.code,
            "duration_ms": round(elapsed * 1000, 2),
        },
    )


_ATTACHED_BY_KIND = {how: MappingProxyType({"kind": how}) for how in ("joined", "replayed")}


@contextlib.contextmanager
def attaching(record: InvocationRecord, how: str) -> Iterator[None]:
    """A span for a call that joined or replayed `record`, linked to the original invocation's span."""
    original = trace.get_current_span(telemetry.extract(record.trace_context)).get_span_context()
    links = [Link(original, {"toolmesh.link": "original_invocation"})] if original.is_valid else []
    ATTACHED.add(1, _ATTACHED_BY_KIND[how])
    trace.get_current_span().set_attribute(f"toolmesh.{how}", True)
    # An exception's text may quote arguments: the span never records it (the caller's span has the code).
    with telemetry.TRACER.start_as_current_span(
        f"toolmesh.{how}", links=links, record_exception=False, set_status_on_exception=False
    ) as span:
        span.set_attribute(f"toolmesh.{how}", True)
        yield
