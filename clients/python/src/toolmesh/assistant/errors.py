"""The assistant's turn codes, their table, and the error an assistant raises.

Thirteen turn codes say how a turn went wrong, plus INTERNAL for a failure of
the assistant's own code. Each row: whether sending the same message again may
succeed, whether the code ends the turn (the others reach the model as a
failed tool result and the turn goes on), and the message shown to people.
Nothing else decides these. How a tool call's runtime code becomes a turn
code: toolmesh.assistant.mapping.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


class TurnCode(enum.StrEnum):
    """How an assistant turn, or one tool call in it, went wrong."""

    UNSUPPORTED_WEBMCP = "UNSUPPORTED_WEBMCP"
    DISCOVERY_FAILED = "DISCOVERY_FAILED"
    INVALID_SCHEMA = "INVALID_SCHEMA"
    TOOL_UNAVAILABLE = "TOOL_UNAVAILABLE"
    STALE_TOOLS = "STALE_TOOLS"
    INVALID_ARGUMENTS = "INVALID_ARGUMENTS"
    EXECUTION_FAILED = "EXECUTION_FAILED"
    CONFIRMATION_DENIED = "CONFIRMATION_DENIED"
    ABORTED = "ABORTED"
    TIMEOUT = "TIMEOUT"
    MODEL_ERROR = "MODEL_ERROR"
    TURN_LIMIT = "TURN_LIMIT"
    BUSY = "BUSY"
    # Not one of the thirteen: the assistant's own code failed (a bug), which ends the turn.
    INTERNAL = "INTERNAL"


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnSpec:
    """One row of the turn-code table."""

    retryable: bool
    ends_turn: bool
    message: str


_TABLE: dict[TurnCode, TurnSpec] = {
    TurnCode.UNSUPPORTED_WEBMCP: TurnSpec(
        retryable=False,
        ends_turn=True,
        message="The tool services this assistant needs are missing, incomplete or not secure.",
    ),
    TurnCode.DISCOVERY_FAILED: TurnSpec(
        retryable=True,
        ends_turn=True,
        message="The assistant could not read the tools of this session.",
    ),
    TurnCode.INVALID_SCHEMA: TurnSpec(
        retryable=False, ends_turn=True, message="A tool definition is not valid."
    ),
    TurnCode.TOOL_UNAVAILABLE: TurnSpec(
        retryable=False, ends_turn=False, message="That tool cannot be used right now."
    ),
    TurnCode.STALE_TOOLS: TurnSpec(
        retryable=True,
        ends_turn=False,
        message="The tools changed while the assistant was working; please ask again.",
    ),
    TurnCode.INVALID_ARGUMENTS: TurnSpec(
        retryable=False,
        ends_turn=False,
        message="The assistant gave the tool input that it does not accept.",
    ),
    TurnCode.EXECUTION_FAILED: TurnSpec(
        retryable=False, ends_turn=False, message="The tool ran into a problem."
    ),
    TurnCode.CONFIRMATION_DENIED: TurnSpec(
        retryable=False,
        ends_turn=False,
        message="The action was not confirmed, so it did not run.",
    ),
    TurnCode.ABORTED: TurnSpec(
        retryable=False,
        ends_turn=True,
        message="The assistant stopped because it was cancelled.",
    ),
    TurnCode.TIMEOUT: TurnSpec(
        retryable=False,
        ends_turn=True,
        message="The assistant waited too long for an answer and stopped.",
    ),
    TurnCode.MODEL_ERROR: TurnSpec(
        retryable=True,
        ends_turn=True,
        message="The assistant's model failed or gave an answer it could not use.",
    ),
    TurnCode.TURN_LIMIT: TurnSpec(
        retryable=False,
        ends_turn=True,
        message="The assistant stopped after taking too many steps for one message.",
    ),
    TurnCode.BUSY: TurnSpec(
        retryable=True,
        ends_turn=False,
        message="The assistant is still working on the previous message.",
    ),
    TurnCode.INTERNAL: TurnSpec(retryable=False, ends_turn=True, message="An internal error occurred."),
}

TURN_TABLE: Mapping[TurnCode, TurnSpec] = MappingProxyType(_TABLE)


@dataclass(eq=False)
class AssistantError(Exception):
    """A turn that ended with a turn code, or a send refused with BUSY.

    `message` is the table's message followed by a detail for developers;
    `human_message` is the table's message alone, the one to show people.
    `metadata` holds the detail's variables, never arguments or results.
    """

    code: TurnCode
    detail: str = ""
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's own reduce rebuilds from `args` (the message), which is not a code.
        return (type(self), (self.code, self.detail, self.metadata), self.__dict__)

    @property
    def message(self) -> str:
        """The table's message followed by the detail: for developers and logs."""
        return f"{self.human_message} {self.detail}".strip()

    @property
    def human_message(self) -> str:
        """The turn table's message for the code: plain words, safe to show people."""
        return TURN_TABLE[self.code].message

    @property
    def retryable(self) -> bool:
        """Whether sending the same message again may succeed (the turn table's `retryable`)."""
        return TURN_TABLE[self.code].retryable

    @property
    def ends_turn(self) -> bool:
        """Whether the code ends a turn (the turn table's `ends_turn`)."""
        return TURN_TABLE[self.code].ends_turn
