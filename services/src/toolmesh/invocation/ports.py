"""What the invoker needs from the rest of the system, independent of transport: tools, hosts, an observer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Protocol

from toolmesh.contracts.ledger import InvocationRecord
from toolmesh.core.calls import ToolCall, ToolRequest
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome
from toolmesh.core.progress import ToolProgress
from toolmesh.core.tools import ToolSpec

# Told each progress report of a running request (best effort, never about its outcome).
ProgressSink = Callable[[ToolProgress], None]
# How long a tool lookup may take before it fails as REGISTRY_UNAVAILABLE.
REGISTRY_TIMEOUT_S = 5.0


class ToolCatalog(Protocol):
    async def get_tool(self, session_id: str, name: str) -> ToolSpec | None:
        """The session's tool, or None when it has none of that name.

        Raises ToolmeshError(REGISTRY_UNAVAILABLE) when the registry cannot answer.
        """
        ...


class OutcomeElsewhere(Exception):
    """The link to the bridge broke after the request was sent, and bridges record outcomes in the
    shared ledger: the host may still run it and hand its outcome to another bridge replica, which
    records it. Ending the call now (BRIDGE_UNAVAILABLE) would let an exact retry run it again."""


class BridgeLost(ToolmeshError):
    """BRIDGE_UNAVAILABLE, knowing whether the request may have reached the bridge: `sent` is
    False when it never left this process (the bridge could not be connected to, or the stream
    ended before the request was handed to it), so nothing ran. `fenced`: the bridge said it
    fences starts in the shared ledger (DispatchToolRequestsResponse.starts_fenced), so the
    ledger knows whether a host started it."""

    def __init__(self, metadata: dict[str, str], *, sent: bool, fenced: bool = False) -> None:
        super().__init__(Code.BRIDGE_UNAVAILABLE, "", metadata)
        self.sent = sent
        self.fenced = fenced


class Dispatcher(Protocol):
    async def dispatch(self, request: ToolRequest, on_progress: ProgressSink | None = None) -> Outcome:
        """Run the request on a handler host within its timeout and return the outcome.

        `on_progress` gets the host's progress reports while it runs.

        Raises ToolmeshError(BRIDGE_UNAVAILABLE) when the bridge cannot be reached, or
        OutcomeElsewhere when its outcome, if any, is to come from the ledger.
        """
        ...


class CallObservation(Protocol):
    """One call as the observer sees it: entered around the call, told its answer."""

    def __enter__(self) -> None: ...

    def __exit__(self, *exc_info: object) -> None: ...

    def answered(self, tool_request_id: str, outcome: Outcome) -> None:
        """The call got `outcome` from invocation `tool_request_id` (run, joined or replayed)."""
        ...


class ExecuteObservation(Protocol):
    """A new invocation running its tool, as the observer sees it: entered around the run."""

    def __enter__(self) -> ExecuteObservation: ...

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def ran(self, outcome: Outcome) -> None:
        """The run ended with `outcome` (an exception passing through `__exit__` is its failure)."""
        ...


class InvocationObserver(Protocol):
    """What the invoker tells whoever watches it (spans, metrics, logs): the one seam for all of it.

    The invoker calls these at fixed points and knows nothing of what they do.
    Every method is on the call path: an implementation must cost next to
    nothing when there is no one to tell.
    """

    def call(self, call: ToolCall) -> CallObservation:
        """A call begins (its envelope is valid, it is admitted)."""
        ...

    def invocation(self, tool_request_id: str) -> AbstractContextManager[None]:
        """Entered once the ledger has given the call its invocation, for the rest of the call."""
        ...

    def attached(self, record: InvocationRecord, how: str) -> AbstractContextManager[None]:
        """Entered around a call that `how` ("joined" or "replayed") the invocation `record`."""
        ...

    def executing(self, request: ToolRequest) -> ExecuteObservation:
        """Entered around a new invocation's run: the dispatch to a host until its outcome is kept."""
        ...

    def in_flight(self, change: int) -> None:
        """Invocations running in this process went up (1) or down (-1)."""
        ...

    def trace_context(self) -> dict[str, str]:
        """What the ledger keeps with a new invocation so that later calls can refer to it."""
        ...


class _Unobserved:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None

    def answered(self, tool_request_id: str, outcome: Outcome) -> None:
        return None


class _NotExecuting:
    __slots__ = ()

    def __enter__(self) -> _NotExecuting:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def ran(self, outcome: Outcome) -> None:
        return None


_UNOBSERVED = _Unobserved()
NOT_EXECUTING = _NotExecuting()
_NOTHING: AbstractContextManager[None] = contextlib.nullcontext()


class NoInvocationObserver:
    """The default InvocationObserver: tells nobody anything."""

    __slots__ = ()

    def call(self, call: ToolCall) -> CallObservation:
        return _UNOBSERVED

    def invocation(self, tool_request_id: str) -> AbstractContextManager[None]:
        return _NOTHING

    def attached(self, record: InvocationRecord, how: str) -> AbstractContextManager[None]:
        return _NOTHING

    def executing(self, request: ToolRequest) -> ExecuteObservation:
        return NOT_EXECUTING

    def in_flight(self, change: int) -> None:
        return None

    def trace_context(self) -> dict[str, str]:
        return {}
