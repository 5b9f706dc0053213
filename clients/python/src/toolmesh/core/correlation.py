"""Correlation ids: which session, turn, tool request and tool the work in hand is for.

`ids(...)` makes ids current for the code under it. Logs always carry them
(toolmesh.core.logs reads `current_ids()`). When tracing, they are also W3C
baggage entries named `toolmesh.*`, so they travel with the next call (in gRPC
metadata, or inside ToolRequest.trace_context across the bridge stream), and a
span processor (toolmesh.core.otel) copies them onto every span as
attributes: each span of a call, in every process, carries the same
`toolmesh.session_id`, `toolmesh.turn_id`, `toolmesh.tool_request_id` and
`toolmesh.tool_name`.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from types import MappingProxyType

from opentelemetry import baggage, context, trace
from opentelemetry.context import Context

from toolmesh.core.telemetry import PREFIX, enabled

# The ids of the work in hand, for logs; a plain context variable so that it
# costs next to nothing when nothing is traced.
_IDS: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "toolmesh_ids", default=MappingProxyType({})
)


class ids:
    """Make ids (session_id=..., turn_id=...) current: for logs always; when tracing, also as
    `toolmesh.*` baggage (so they travel with the next call) and on the current span.

    A small class rather than a generator: calls hold it across awaits, by the thousand.
    """

    __slots__ = ("_context_token", "_given", "_ids_token")

    def __init__(self, **given: str) -> None:
        self._given = tuple((name, value) for name, value in given.items() if value)

    def __enter__(self) -> None:
        given = self._given
        current_ids = dict(_IDS.get())
        current_ids.update(given)
        self._ids_token = _IDS.set(current_ids)
        self._context_token: contextvars.Token[Context] | None = None
        if enabled():
            ctx = context.get_current()
            current = trace.get_current_span()
            for name, value in given:
                ctx = baggage.set_baggage(PREFIX + name, value, ctx)
                current.set_attribute(PREFIX + name, value)
            self._context_token = context.attach(ctx)

    def __exit__(self, *exc_info: object) -> None:
        if self._context_token is not None:
            context.detach(self._context_token)
        _IDS.reset(self._ids_token)


def current_ids() -> dict[str, str]:
    """The ids made current by `ids` (for logs)."""
    return dict(_IDS.get())
