"""What the caller libraries return about a call, as plain values with the JSON shapes the CLI prints."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from toolmesh.core import jsontext
from toolmesh.core.outcome import ErrorKind, Outcome
from toolmesh.core.wire import outcome_from_pb
from toolmesh.v1 import invocation_pb2


def outcome_json(outcome: Outcome) -> dict[str, Any]:
    """`{"result": value}` or `{"error": {code, kind, message, retryable, details}}`, as the CLI prints it."""
    failure = outcome.failure
    if failure is None:
        assert outcome.result_json is not None
        return {"result": jsontext.parse(outcome.result_json)}
    return {
        "error": {
            "code": failure.code,
            "kind": "domain" if failure.kind is ErrorKind.DOMAIN else "runtime",
            "message": failure.message,
            "retryable": failure.retryable,
            "details": failure.details,
        }
    }


class InvocationState(enum.IntEnum):
    """Where an invocation is in the ledger; the numbers are the wire's (toolmesh.v1.InvocationState)."""

    UNSPECIFIED = invocation_pb2.INVOCATION_STATE_UNSPECIFIED
    RUNNING = invocation_pb2.INVOCATION_STATE_RUNNING
    COMPLETED = invocation_pb2.INVOCATION_STATE_COMPLETED
    TIMED_OUT = invocation_pb2.INVOCATION_STATE_TIMED_OUT
    FAILED = invocation_pb2.INVOCATION_STATE_FAILED
    CANCELLED = invocation_pb2.INVOCATION_STATE_CANCELLED


@dataclass(frozen=True)
class Invocation:
    """One invocation as the ledger shows it (InvocationClient.get_invocation).

    `outcome` is None while it runs; `delivered` says whether a caller confirmed
    receiving it; `started_at` when a host was allowed to start it (None: no host is known to
    have started it; see the proto's Invocation.started_at); `late_outcome`, for one that timed
    out, the outcome its host handed in after that (None: none came), and `late_at` when;
    `message` is the wire message it was read from.
    """

    tool_request_id: str
    session_id: str
    turn_id: str
    tool_name: str
    state: InvocationState
    outcome: Outcome | None
    delivered: bool
    created_at: datetime
    finished_at: datetime | None
    started_at: datetime | None
    message: invocation_pb2.Invocation = field(repr=False, compare=False)
    late_outcome: Outcome | None = None
    late_at: datetime | None = None

    @classmethod
    def from_pb(cls, message: invocation_pb2.Invocation) -> Invocation:
        """The value of a wire message."""
        return cls(
            tool_request_id=message.tool_request_id,
            session_id=message.session_id,
            turn_id=message.turn_id,
            tool_name=message.tool_name,
            state=InvocationState(message.state),
            outcome=outcome_from_pb(message.outcome) if message.HasField("outcome") else None,
            delivered=message.delivered,
            created_at=message.created_at.ToDatetime(tzinfo=UTC),
            finished_at=message.finished_at.ToDatetime(tzinfo=UTC)
            if message.HasField("finished_at")
            else None,
            started_at=message.started_at.ToDatetime(tzinfo=UTC) if message.HasField("started_at") else None,
            message=message,
            late_outcome=outcome_from_pb(message.late_outcome) if message.HasField("late_outcome") else None,
            late_at=message.late_outcome_at.ToDatetime(tzinfo=UTC)
            if message.HasField("late_outcome_at")
            else None,
        )

    def to_json(self) -> dict[str, Any]:
        """The shape `toolmesh invocations show` prints.

        Ids, `state`, `delivered`, times (`startedAt` only once a host is known to have started it),
        then `ok` with `result` or `error` once it has ended, then `late` (`at`, `ok`, `result` or
        `error`) when its host handed an outcome in after it timed out.
        """
        shown: dict[str, Any] = {
            "toolRequestId": self.tool_request_id,
            "sessionId": self.session_id,
            "turnId": self.turn_id,
            "toolName": self.tool_name,
            "state": self.state.name.lower(),
            "delivered": self.delivered,
            "createdAt": self.message.created_at.ToJsonString(),
            "finishedAt": self.message.finished_at.ToJsonString() if self.finished_at is not None else None,
        }
        if self.started_at is not None:
            shown["startedAt"] = self.message.started_at.ToJsonString()
        if self.outcome is not None:
            shown |= {"ok": self.outcome.ok, **outcome_json(self.outcome)}
        if self.late_outcome is not None:
            at = self.message.late_outcome_at.ToJsonString()
            shown["late"] = {"at": at, "ok": self.late_outcome.ok, **outcome_json(self.late_outcome)}
        return shown
