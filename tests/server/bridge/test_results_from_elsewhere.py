"""A redeliverable request's result from another host of its session than the one holding it.

When the bridge replica that sent a read-only or idempotent request is lost, the invocation
service sends it again through another replica, perhaps to another host, while the host it first
went to runs it and hands its result to that replica: the result is the request's outcome there
(`python -m bench.chaos --seed 97` lost 18 such results, refused as REQUEST_UNKNOWN). The chaos
run checks the whole way; here, the router's rule.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from toolmesh.bridge.router import EndReason, HostSession, Router, ToolRequestCancelled
from toolmesh.core.calls import ToolRequest
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.outcome import Outcome

pytestmark = pytest.mark.unit

FIRST = Outcome.success('"from the host it first went to"')


def request(tool_request_id: str, *, redeliverable: bool) -> ToolRequest:
    return ToolRequest("s", "turn", tool_request_id, "tool", "{}", 10_000, redeliverable=redeliverable)


async def next_event(host: HostSession) -> ToolRequest | ToolRequestCancelled:
    """The host's next request or cancellation (heartbeats and read checks left out)."""
    while True:
        event = await asyncio.wait_for(host.next_event(), 2)
        if isinstance(event, ToolRequest | ToolRequestCancelled):
            return event


def refusal(router: Router, host: HostSession, tool_request_id: str) -> Code:
    with pytest.raises(ToolmeshError) as refused:
        router.submit(host.host_session_id, tool_request_id, FIRST)
    return refused.value.code


@dataclass
class Sent:
    """A request delivered to `holder`; `first`, another host of its session, has no handler for
    its tool (so it is never picked) and stands for the host it first went to."""

    router: Router
    holder: HostSession
    first: HostSession
    outcomes: list[Outcome]


async def sent(tool_request_id: str, *, redeliverable: bool) -> Sent:
    router = Router(heartbeat_s=60)
    holder = router.open_host("s", "holder", ["tool"], False)
    first = router.open_host("s", "first", [], False)
    outcomes: list[Outcome] = []
    router.start(request(tool_request_id, redeliverable=redeliverable), outcomes.append)
    assert isinstance(await next_event(holder), ToolRequest)
    return Sent(router, holder, first, outcomes)


async def test_the_result_of_the_host_it_first_went_to_settles_it_and_calls_the_holder_off() -> None:
    it = await sent("tr_1", redeliverable=True)
    # A host of another session may not settle it, nor learn that it exists.
    stranger = it.router.open_host("other", "stranger", ["tool"], False)
    assert refusal(it.router, stranger, "tr_1") is Code.REQUEST_UNKNOWN
    it.router.submit(it.first.host_session_id, "tr_1", FIRST)
    assert it.outcomes == [FIRST]
    assert await next_event(it.holder) == ToolRequestCancelled("tr_1", EndReason.CANCELLED)
    # Ended: the holder's own result, or a second one, is refused as such.
    assert refusal(it.router, it.holder, "tr_1") is Code.REQUEST_ENDED
    assert refusal(it.router, it.first, "tr_1") is Code.REQUEST_UNKNOWN
    it.router.shutdown()


async def test_a_request_that_is_not_redeliverable_is_only_its_holders() -> None:
    # It may have started where it was sent; another run's result would be a second execution.
    it = await sent("tr_2", redeliverable=False)
    assert refusal(it.router, it.first, "tr_2") is Code.REQUEST_UNKNOWN
    assert it.outcomes == []
    it.router.submit(it.holder.host_session_id, "tr_2", FIRST)
    assert it.outcomes == [FIRST]
    it.router.shutdown()


async def test_a_malformed_outcome_from_elsewhere_ends_nothing() -> None:
    it = await sent("tr_3", redeliverable=True)
    with pytest.raises(ToolmeshError) as refused:
        it.router.submit(it.first.host_session_id, "tr_3", Outcome.success("{not json"))
    assert refused.value.code is Code.RESULT_NOT_JSON
    assert it.outcomes == []
    it.router.submit(it.holder.host_session_id, "tr_3", FIRST)
    assert it.outcomes == [FIRST]
    it.router.shutdown()
