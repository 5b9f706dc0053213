"""A request whose bridge replica was lost before it let a host start it, sent through another.

The start fence (toolmesh.store.ledger): a bridge that fences starts marks the invocation
started in the shared ledger, compare-and-set on the dispatch generation of the delivery it
holds, before any host may start it. When the dispatch stream to such a replica breaks, the
ledger says whether a start was marked: if not, moving the generation on (`redispatch`) makes
the lost delivery unable to start anywhere, and the request goes, with the new generation and
the time it has left, to the replica the session's route names (the one a host of the session
reconnected to, or the same address once a restarted replica is back). A request already
started keeps the outcome it had before the fence: its host may still hand its outcome to
another replica, which records it, and the ledger decides (OutcomeElsewhere).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Protocol

from toolmesh.core.calls import ToolRequest
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome
from toolmesh.invocation.ports import BridgeLost, OutcomeElsewhere

log = logging.getLogger("toolmesh.invocation")

# The dispatch generation of an invocation's first delivery (LedgerStore's claims start there).
FIRST_GENERATION = 1
# While it waits for a replica with a host of its session, the route is read again this often.
REDISPATCH_POLL_S = 0.25

# Sends the request (with the time it has left) to a bridge replica, with its dispatch generation.
SendTo = Callable[[str, ToolRequest, int], Awaitable[Outcome]]
# The bridge replica the session's route names now (else the default one).
RouteOf = Callable[[str], Awaitable[str]]


class DispatchFence(Protocol):
    """The invocation side of the start fence (toolmesh.contracts.ledger.Ledger.redispatch)."""

    async def redispatch(self, tool_request_id: str, generation: int) -> int: ...


async def redispatch_unstarted(
    request: ToolRequest,
    generation: int,
    fence: DispatchFence,
    send: SendTo,
    route_of: RouteOf,
    *,
    poll_s: float = REDISPATCH_POLL_S,
) -> Outcome:
    """The outcome of `request` (its delivery of `generation` lost with its bridge replica), sent
    again with the generation moved on, within the time it has left, if it never started.

    Raises OutcomeElsewhere when it may have started (a start was marked, it ended, or the
    ledger cannot say): its outcome, if any, comes from the ledger, as before the fence. A
    replica that holds no host of the session yet (TOOL_HOST_UNAVAILABLE: nothing ran there)
    is asked again every `poll_s`, the route read again each time; at the deadline the last
    such answer is the call's (nothing ran anywhere).
    """
    give_up = _deadline(request)
    outcome: Outcome | None = None
    while True:
        try:
            moved = await fence.redispatch(request.tool_request_id, generation)
        except ToolmeshError as error:
            if error.code is not Code.STORE_UNAVAILABLE:
                raise
            raise OutcomeElsewhere from None
        if not moved:
            raise OutcomeElsewhere  # it may have started: the ledger decides
        generation = moved
        log.warning(
            "bridge replica lost before a start: sending the request through another",
            extra={"tool_request_id": request.tool_request_id, "generation": generation},
        )
        while (left_s := give_up - time.monotonic()) > 0:
            target = await route_of(request.session_id)
            again = replace(request, timeout_ms=max(1, math.floor(left_s * 1000)))
            try:
                outcome = await send(target, again, generation)
            except BridgeLost as lost:
                if "reason" in lost.metadata or (lost.sent and not lost.fenced):
                    raise OutcomeElsewhere from None
                if lost.sent:
                    break  # lost again after it reached that replica: fence that delivery too
                await asyncio.sleep(min(poll_s, left_s))  # not reached: nothing ran there
                continue
            if not _no_host(outcome):
                return outcome
            await asyncio.sleep(min(poll_s, max(give_up - time.monotonic(), 0)))
        else:
            if outcome is not None:
                return outcome  # every later delivery found no host: nothing ran
            raise OutcomeElsewhere


def _deadline(request: ToolRequest) -> float:
    """When the request's time is up, on the monotonic clock (from the invocation's deadline)."""
    left_s = request.timeout_ms / 1000
    if request.invocation_deadline_unix_ms:
        left_s = min(left_s, request.invocation_deadline_unix_ms / 1000 - time.time())
    return time.monotonic() + left_s


def _no_host(outcome: Outcome) -> bool:
    return outcome.failure is not None and outcome.failure.code == Code.TOOL_HOST_UNAVAILABLE
