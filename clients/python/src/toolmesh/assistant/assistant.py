"""Assistant: one conversation with a model over one session's tools, a turn at a time."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from toolmesh.assistant.channel import ToolChannel
from toolmesh.assistant.chat_completions import OpenAIChatModel
from toolmesh.assistant.config import ModelEndpoint, ToolServices, TurnLimits
from toolmesh.assistant.confirmation import Confirm
from toolmesh.assistant.errors import AssistantError, TurnCode
from toolmesh.assistant.grpc_channel import GrpcToolChannel
from toolmesh.assistant.messages import Message
from toolmesh.assistant.model import ChatModel
from toolmesh.assistant.state import AssistantState, AssistantStatus, StateStore, Subscriber
from toolmesh.assistant.turn import Turn, TurnDeps
from toolmesh.core.exceptions import exception_fields

log = logging.getLogger("toolmesh.assistant")


def new_turn_id() -> str:
    """A fresh turn id: `turn_` and 16 random hex digits."""
    return f"turn_{uuid.uuid4().hex[:16]}"


class Assistant:
    """`send()` runs one turn; `cancel()`, `clear()` and `dispose()` end it with ABORTED.

    A send while a turn runs raises AssistantError(BUSY) and changes nothing.
    A turn that ends without an answer raises the AssistantError that is also
    the state's `error`. For applications that embed an agent: most build one
    with `connect()`; the constructor takes any ToolChannel and ChatModel.

    Args:
        session_id: The session whose tools the assistant may call.
        channel: The session's tool services.
        model: The model that plans the turns.
        confirm: Asked before a tool that needs confirmation runs; without it such tools are refused.
        limits: Rounds per turn, a cap on each tool call, the system prompt.
    """

    def __init__(
        self,
        session_id: str,
        *,
        channel: ToolChannel,
        model: ChatModel,
        confirm: Confirm | None = None,
        limits: TurnLimits | None = None,
    ) -> None:
        self.session_id = session_id
        self._deps = TurnDeps(session_id, channel, model, confirm, limits or TurnLimits())
        self._store = StateStore()
        self._task: asyncio.Task[str] | None = None

    @classmethod
    def connect(
        cls,
        session_id: str,
        *,
        model: ModelEndpoint,
        services: ToolServices,
        confirm: Confirm | None = None,
        limits: TurnLimits | None = None,
    ) -> Assistant:
        """An assistant over toolmesh's gRPC services and an OpenAI-compatible model endpoint."""
        limits = limits or TurnLimits()
        return cls(
            session_id,
            channel=GrpcToolChannel(session_id, services),
            model=OpenAIChatModel(model, system_prompt=limits.system_prompt),
            confirm=confirm,
            limits=limits,
        )

    @property
    def state(self) -> AssistantState:
        """The state now: status, conversation, the last turn's error and turn id."""
        return self._store.state

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Call `subscriber` with every new state; returns the function that unsubscribes."""
        return self._store.subscribe(subscriber)

    async def send(self, text: str) -> str:
        """Run one turn on the user's `text`; returns the model's answer.

        Tool failures do not raise: the model reads them as failed results and
        goes on, unless their code ends the turn. Raises AssistantError with BUSY
        while another turn runs (nothing changes), ABORTED when the turn is
        cancelled or the assistant disposed, and the turn code that ended the turn
        otherwise (TIMEOUT, MODEL_ERROR, TURN_LIMIT, DISCOVERY_FAILED,
        UNSUPPORTED_WEBMCP, INVALID_SCHEMA, ...; INTERNAL for a bug). If the caller
        of `send` is itself cancelled, the turn is cancelled and CancelledError raised.
        """
        if self._store.state.status is AssistantStatus.DISPOSED:
            raise AssistantError(TurnCode.ABORTED, "The assistant was disposed.")
        if self._task is not None:
            raise AssistantError(TurnCode.BUSY)
        turn_id = new_turn_id()
        generation = self._store.begin_turn(turn_id, Message.user(text))
        turn = Turn(
            self._deps,
            turn_id,
            lambda: self._store.state.messages,
            lambda message: self._store.append(generation, message),
        )
        task = asyncio.create_task(self._run(turn, turn_id, generation))
        self._task = task
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # whoever awaits send() was cancelled; the turn was cancelled with it
            raise AssistantError(TurnCode.ABORTED) from None

    async def _run(self, turn: Turn, turn_id: str, generation: int) -> str:
        error: AssistantError | None = None
        try:
            return await turn.run()
        except AssistantError as ended:
            error = ended
            raise
        except asyncio.CancelledError:
            error = AssistantError(TurnCode.ABORTED)
            raise
        except Exception as exc:
            log.error(
                "an assistant turn failed",
                extra={"session_id": self.session_id, "turn_id": turn_id, "code": TurnCode.INTERNAL.value}
                | exception_fields(exc),
            )
            error = AssistantError(TurnCode.INTERNAL, type(exc).__name__)
            raise error from exc
        finally:
            self._store.end_turn(generation, error)
            if self._task is asyncio.current_task():
                self._task = None
            log.info(
                "turn ended",
                extra={
                    "session_id": self.session_id,
                    "turn_id": turn_id,
                    "code": error.code.value if error else "OK",
                },
            )

    def cancel(self) -> bool:
        """End the running turn with ABORTED (the state says so at once); False when none runs."""
        task, self._task = self._task, None
        if task is None:
            return False
        self._store.abort(AssistantError(TurnCode.ABORTED))
        task.cancel()
        return True

    def clear(self) -> None:
        """End the running turn (ABORTED) and forget the conversation."""
        self.cancel()
        self._store.reset()

    async def dispose(self) -> None:
        """End the running turn (ABORTED), close the channels; every later send is ABORTED."""
        task = self._task
        self.cancel()
        self._store.dispose()
        if task is not None:
            await asyncio.wait({task}, timeout=1.0)
        await self._deps.channel.close()
        await self._deps.model.close()
