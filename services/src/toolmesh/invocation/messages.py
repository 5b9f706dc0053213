"""InvocationService messages to and from the invoker's types."""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf.timestamp_pb2 import Timestamp

from toolmesh.contracts.ledger import InvocationRecord, InvocationState
from toolmesh.core.calls import ToolCall
from toolmesh.core.names import require_id
from toolmesh.core.wire import outcome_to_pb
from toolmesh.invocation.invoker import InvokeResult
from toolmesh.store.ledger import Delivered
from toolmesh.v1 import invocation_pb2

_STATES = {
    InvocationState.RUNNING: invocation_pb2.INVOCATION_STATE_RUNNING,
    InvocationState.COMPLETED: invocation_pb2.INVOCATION_STATE_COMPLETED,
    InvocationState.TIMED_OUT: invocation_pb2.INVOCATION_STATE_TIMED_OUT,
    InvocationState.FAILED: invocation_pb2.INVOCATION_STATE_FAILED,
    InvocationState.CANCELLED: invocation_pb2.INVOCATION_STATE_CANCELLED,
}


def call_from_pb(request: invocation_pb2.InvokeToolRequest) -> ToolCall:
    return ToolCall(
        session_id=request.session_id,
        turn_id=request.turn_id,
        tool_name=request.tool_name,
        arguments_json=request.arguments_json,
        deadline_unix_ms=request.deadline_unix_ms,
    )


def deliveries_from_pb(
    tool_request_ids: Iterable[str], attachments: Iterable[invocation_pb2.DeliveredAttachment]
) -> list[Delivered]:
    """The confirmations of a request: ids alone (every attachment), then single attachments.

    Raises ToolmeshError(INVALID_REQUEST) for an attachment without its id (it
    must not pass for the id-only form, which confirms every attachment).
    """
    deliveries = [Delivered(tool_request_id) for tool_request_id in tool_request_ids]
    for item in attachments:
        require_id(item.attachment_id, "attachment_id")
        deliveries.append(Delivered(item.tool_request_id, item.attachment_id))
    return deliveries


def response_to_pb(result: InvokeResult) -> invocation_pb2.InvokeToolResponse:
    return invocation_pb2.InvokeToolResponse(
        tool_request_id=result.tool_request_id,
        outcome=outcome_to_pb(result.outcome),
        joined=result.joined,
        replayed=result.replayed,
        attachment_id=result.attachment_id,
    )


def timestamp(seconds: float) -> Timestamp:
    """Whole milliseconds, rounded down: an invocation's start mark is the store's clock in whole
    milliseconds, so its other times at a finer grain could read as later than its start."""
    stamp = Timestamp()
    stamp.FromMilliseconds(round(seconds * 1e6) // 1000)
    return stamp


def record_to_pb(record: InvocationRecord) -> invocation_pb2.Invocation:
    message = invocation_pb2.Invocation(
        tool_request_id=record.tool_request_id,
        session_id=record.session_id,
        turn_id=record.turn_id,
        tool_name=record.tool_name,
        state=_STATES[record.state],
        delivered=record.delivered,
        created_at=timestamp(record.created_at),
    )
    if record.outcome is not None:
        message.outcome.CopyFrom(outcome_to_pb(record.outcome))
    if record.finished_at is not None:
        message.finished_at.CopyFrom(timestamp(record.finished_at))
    if record.started_at is not None:
        message.started_at.CopyFrom(timestamp(record.started_at))
    if record.late_outcome is not None and record.late_at is not None:
        message.late_outcome.CopyFrom(outcome_to_pb(record.late_outcome))
        message.late_outcome_at.CopyFrom(timestamp(record.late_at))
    return message
