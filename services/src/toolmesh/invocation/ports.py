"""What the invoker needs from the rest of the system, independent of transport."""

from __future__ import annotations

from typing import Protocol

from toolmesh.core.calls import ToolRequest
from toolmesh.core.outcome import Outcome
from toolmesh.core.tools import ToolSpec

# How long a tool lookup may take before it fails as REGISTRY_UNAVAILABLE.
REGISTRY_TIMEOUT_S = 5.0


class ToolCatalog(Protocol):
    async def get_tool(self, session_id: str, name: str) -> ToolSpec | None:
        """The session's tool, or None when it has none of that name.

        Raises ToolmeshError(REGISTRY_UNAVAILABLE) when the registry cannot answer.
        """
        ...


class Dispatcher(Protocol):
    async def dispatch(self, request: ToolRequest) -> Outcome:
        """Run the request on a handler host within its timeout and return the outcome.

        Raises ToolmeshError(BRIDGE_UNAVAILABLE) when the bridge cannot be reached.
        """
        ...
