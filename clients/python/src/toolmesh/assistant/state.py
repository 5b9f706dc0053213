"""An assistant's observable state, and the one place that changes it.

Every change makes a new AssistantState and tells the subscribers. Changes
made on behalf of a turn carry the turn's generation: once cancel(), clear()
or dispose() has moved the generation on, a turn that is still unwinding can
no longer touch the state.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from toolmesh.assistant.errors import AssistantError
from toolmesh.assistant.messages import Message, unanswered_calls
from toolmesh.assistant.results import ToolResult
from toolmesh.core.exceptions import exception_fields

log = logging.getLogger("toolmesh.assistant")


class AssistantStatus(enum.StrEnum):
    """Whether a turn is running, none is, or the assistant was disposed."""

    IDLE = "idle"
    RUNNING = "running"
    DISPOSED = "disposed"


@dataclass(frozen=True, slots=True)
class AssistantState:
    """One immutable snapshot of an assistant, as subscribers receive it."""

    status: AssistantStatus = AssistantStatus.IDLE
    messages: tuple[Message, ...] = ()
    # The error that ended the last turn; None after a turn that answered.
    error: AssistantError | None = None
    turn_id: str = ""


Subscriber = Callable[[AssistantState], None]


class StateStore:
    """The assistant's state and its subscribers: every change goes through here.

    Changes on behalf of a turn name its generation and are dropped once the
    generation has moved on (the turn was cancelled, cleared or disposed).
    """

    def __init__(self) -> None:
        self._state = AssistantState()
        self._generation = 0
        self._subscribers: list[Subscriber] = []

    @property
    def state(self) -> AssistantState:
        """The current state."""
        return self._state

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Call `subscriber` with every new state; returns the function that unsubscribes."""
        self._subscribers.append(subscriber)

        def unsubscribe() -> None:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

        return unsubscribe

    def begin_turn(self, turn_id: str, message: Message) -> int:
        """Start a turn with the user's message; returns the turn's generation."""
        self._generation += 1
        self._set(
            replace(
                self._state,
                status=AssistantStatus.RUNNING,
                messages=(*self._state.messages, message),
                error=None,
                turn_id=turn_id,
            )
        )
        return self._generation

    def append(self, generation: int, message: Message) -> None:
        """Add a message of the turn `generation`, unless that turn is no longer current."""
        if generation == self._generation:
            self._set(replace(self._state, messages=(*self._state.messages, message)))

    def end_turn(self, generation: int, error: AssistantError | None) -> None:
        """End the turn `generation` (with `error`, or answered), unless it is no longer current."""
        if generation == self._generation:
            self._end(error)

    def abort(self, error: AssistantError) -> None:
        """End the running turn now, whatever it is doing."""
        self._generation += 1
        self._end(error)

    def reset(self) -> None:
        """Forget everything: a new, idle state; a running turn can no longer change it."""
        self._generation += 1
        self._set(AssistantState())

    def dispose(self) -> None:
        """Mark the state disposed and drop every subscriber."""
        self._generation += 1
        self._set(replace(self._state, status=AssistantStatus.DISPOSED))
        self._subscribers.clear()

    def _end(self, error: AssistantError | None) -> None:
        messages = self._state.messages
        if error is not None:
            # Every tool call the model asked for gets an answer, so that the
            # conversation stays valid for the next turn.
            messages += tuple(
                Message.tool(call, ToolResult.failure(error.code, "The call was not run.", cause="not_run"))
                for call in unanswered_calls(messages)
            )
        self._set(replace(self._state, status=AssistantStatus.IDLE, messages=messages, error=error))

    def _set(self, state: AssistantState) -> None:
        self._state = state
        for subscriber in list(self._subscribers):
            try:
                subscriber(state)
            except Exception as exc:
                log.error("an assistant state subscriber failed", extra=exception_fields(exc))
