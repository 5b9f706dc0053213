"""Requests sent while their claim is on its way to the ledger.

On a ledger whose claim is a round trip (Redis), a new invocation's request goes to its bridge
replica as its claim goes to the store, so that the two overlap, rather than the request waiting
for the claim's reply. A call alone saves that round trip.

It stays at most once because the bridge lets no host start a fenced request (one carrying a
dispatch generation: not read-only nor idempotent, replicas sharing the ledger) before its start
is marked in the ledger, and the mark needs the invocation stored, running, on that generation
(toolmesh.store.ledger: a mark finds it ABSENT until its claim is in, and is asked again). An
invocation id is new for each call, so only this call's claim can store it. When the claim makes
nothing (the call joins or replays another invocation, or its session's place is refused), the
request is withdrawn, as a cancellation, and no host ever starts it. A bridge not known to fence
starts gets the request only once the claim made it new (StreamDispatcher.dispatch).

A claim whose fate is not known (the store went away with its reply, or its caller went) may have
stored the invocation: its request goes on, and its outcome is finished in the ledger when it
comes (nothing when the claim was never made: the request then never started).

Only while few invocations run in this process (QUIET_BELOW): under load a claim's round trip
grows (it waits behind others' in the pipeline) past the request's way to its host's start ask,
whose mark would find it ABSENT and be asked again, and the requests of many calls go together
anyway: the overlap would cost more than it saves.

Not for claims that wait for a replica (durable claims): a claim stored on the primary and not
confirmed is ended as not run, which must not race a start. Nor for a call with an idempotency
key, or one with the same session, tool and arguments text as one this process sent early and
runs: both most likely join or replay, and their requests would only be withdrawn.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from toolmesh.core.calls import ToolCall, ToolRequest
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome
from toolmesh.invocation.ports import ProgressSink

# Requests go early while fewer invocations than this are dispatched by this process.
QUIET_BELOW = 4


class EarlyDispatcher(Protocol):
    async def dispatch(
        self,
        request: ToolRequest,
        on_progress: ProgressSink | None = None,
        *,
        claimed: asyncio.Future[None] | None = None,
    ) -> Outcome:
        """As Dispatcher.dispatch, for a fenced request whose claim is on its way: it is sent where
        starts are fenced, elsewhere once `claimed` is done (raising as it does when it fails)."""
        ...


class EarlyDispatches:
    """The requests this process sent while their claims were on their way, until claimed."""

    def __init__(self, dispatcher: EarlyDispatcher) -> None:
        self._dispatcher = dispatcher
        # Each one's dispatch, and the future its claim settles.
        self._sent: dict[str, tuple[asyncio.Task[Outcome], asyncio.Future[None]]] = {}
        # The calls (session, tool, arguments text) of those sent, until their dispatch ends.
        self._calls: set[tuple[str, str, str]] = set()

    def __len__(self) -> int:
        return len(self._sent)

    def running(self, call: ToolCall) -> bool:
        """Whether a request of the same session, tool and arguments text was sent early and has
        not ended (an exact retry, which would join it)."""
        return (call.session_id, call.tool_name, call.arguments_json) in self._calls

    def send(self, call: ToolCall, request: ToolRequest, on_progress: ProgressSink | None) -> None:
        """Send `call`'s `request` now; its claim is on its way."""
        claimed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(self._dispatcher.dispatch(request, on_progress, claimed=claimed))
        self._sent[request.tool_request_id] = (task, claimed)
        key = (call.session_id, call.tool_name, call.arguments_json)
        self._calls.add(key)
        task.add_done_callback(lambda _: self._calls.discard(key))

    def task(self, tool_request_id: str) -> asyncio.Task[Outcome] | None:
        """The dispatch of a request sent early and not taken yet."""
        sent = self._sent.get(tool_request_id)
        return None if sent is None else sent[0]

    def take(self, tool_request_id: str) -> asyncio.Task[Outcome] | None:
        """The dispatch of a request sent early, for the invocation its claim made new (or may have
        made: `unknown`), which awaits its outcome from now on."""
        sent = self._sent.pop(tool_request_id, None)
        return None if sent is None else sent[0]

    def claimed(self, tool_request_id: str) -> None:
        """Its claim made the invocation: any bridge may have the request now."""
        sent = self._sent.get(tool_request_id)
        if sent is not None and not sent[1].done():
            sent[1].set_result(None)

    def unknown(self, tool_request_id: str) -> None:
        """Its claim's fate is unknown: a bridge that fences starts keeps it (no host starts it
        unless the claim was made); one that does not, or none yet, never gets it."""
        sent = self._sent.get(tool_request_id)
        if sent is not None and not sent[1].done():
            sent[1].set_exception(ToolmeshError(Code.STORE_UNAVAILABLE, "Its claim's fate is unknown."))
            sent[1].exception()  # seen: a dispatch already sent never looks at it

    def withdraw(self, tool_request_id: str) -> None:
        """Its claim made nothing: the request is withdrawn (its bridge told), unstarted."""
        sent = self._sent.pop(tool_request_id, None)
        if sent is None:
            return
        task, claimed = sent
        task.cancel()
        claimed.cancel()
        task.add_done_callback(_seen)


def _seen(task: asyncio.Task[Outcome]) -> None:
    if not task.cancelled():
        task.exception()  # withdrawn: nobody waits for its outcome or its error
