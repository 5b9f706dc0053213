"""An assistant that runs agent turns against a model endpoint over a session's toolmesh tools."""

from toolmesh.assistant.assistant import Assistant
from toolmesh.assistant.config import ModelEndpoint, ToolServices, TurnLimits
from toolmesh.assistant.confirmation import Confirm, ConfirmationRequest
from toolmesh.assistant.errors import TURN_TABLE, AssistantError, TurnCode
from toolmesh.assistant.messages import Author, Message, ToolCallRequest
from toolmesh.assistant.results import TEXT_LIMIT, ToolResult
from toolmesh.assistant.state import AssistantState, AssistantStatus

__all__ = [
    "TEXT_LIMIT",
    "TURN_TABLE",
    "Assistant",
    "AssistantError",
    "AssistantState",
    "AssistantStatus",
    "Author",
    "Confirm",
    "ConfirmationRequest",
    "Message",
    "ModelEndpoint",
    "ToolCallRequest",
    "ToolResult",
    "ToolServices",
    "TurnCode",
    "TurnLimits",
]
