"""A tool call as the caller makes it, and as it travels to a handler host."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ToolCall:
    session_id: str
    turn_id: str
    tool_name: str
    arguments_json: str
    # The caller's own deadline on its clock (ms since the Unix epoch; 0: none). Not part of the
    # call's identity: it only says when the call is too late to begin (limits.CALLER_DEADLINE_SLACK_MS).
    deadline_unix_ms: int = 0


@dataclass(frozen=True, slots=True)
class ToolRequest:
    session_id: str
    turn_id: str
    tool_request_id: str
    tool_name: str
    arguments_json: str
    timeout_ms: int
    trace_context: Mapping[str, str] = field(default_factory=dict)
    # Read-only or idempotent: may be sent again to another host if its host leaves.
    redeliverable: bool = False
    # The deadline on the bridge's clock (ms since the Unix epoch), set by the bridge for its
    # hosts; 0 elsewhere (timeout_ms rules).
    deadline_unix_ms: int = 0
    # The invocation's deadline on the invocation service's clock (ms since the Unix epoch), sent
    # to the bridge, which folds it into timeout_ms when it reads the request; 0 elsewhere.
    invocation_deadline_unix_ms: int = 0
    # The start fence: this delivery's dispatch generation in the shared ledger (set by the
    # invocation service when it shares one with the bridge); 0: not fenced.
    dispatch_generation: int = 0
