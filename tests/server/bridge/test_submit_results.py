"""SubmitToolResults on a real bridge, with raw stubs as hosts: each result answered on its own, the
limits refusing a request whole. Who may call it is in tests/server/auth/test_trust.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from toolmesh.assembly.system import start_bridge
from toolmesh.core.errors import Code
from toolmesh.core.limits import MAX_CALLS_PER_MESSAGE, MAX_RESULT_BYTES, MAX_SUBMIT_RESULTS_BYTES
from toolmesh.core.rpcstatus import error_code, error_info
from toolmesh.v1 import bridge_pb2, tool_pb2
from toolmesh_testing import bridge_stubs

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stubs() -> AsyncIterator[tuple[Any, Any]]:
    server, _ = await start_bridge(heartbeat_s=0.2)
    async with bridge_stubs(server) as both:
        yield both
    await server.stop(0.1)


class Host:
    """A raw host stream (no start acknowledgements: a request it reads may be answered at once)."""

    def __init__(self, stub: Any, session: str) -> None:
        self.stub = stub
        self.session = session
        self.stream = stub.OpenHostSession(
            bridge_pb2.OpenHostSessionRequest(session_id=session, host_name="test", handler_names=["t"])
        )
        self.id = ""

    async def open(self) -> Host:
        self.id = (await asyncio.wait_for(self.stream.read(), 5)).opened.host_session_id
        return self

    async def requests(self, count: int) -> list[str]:
        """The ids of the next `count` tool requests it reads."""
        ids: list[str] = []
        while len(ids) < count:
            event = await asyncio.wait_for(self.stream.read(), 5)
            if event.WhichOneof("event") == "tool_request":
                ids.append(event.tool_request.tool_request_id)
        return ids

    async def submit(self, *results: tuple[str, tool_pb2.ToolOutcome], host_session_id: str = "") -> Any:
        return await self.stub.SubmitToolResults(
            bridge_pb2.SubmitToolResultsRequest(
                host_session_id=host_session_id or self.id,
                results=[bridge_pb2.SubmittedToolResult(tool_request_id=i, outcome=o) for i, o in results],
            )
        )


def dispatch(internal: Any, session: str, request_id: str) -> asyncio.Future[Any]:
    message = bridge_pb2.DispatchToolRequestRequest(
        request=bridge_pb2.ToolRequest(
            session_id=session,
            turn_id="turn",
            tool_request_id=request_id,
            tool_name="t",
            arguments_json="{}",
            timeout_ms=10_000,
        )
    )
    call: asyncio.Future[Any] = asyncio.ensure_future(internal.DispatchToolRequest(message))
    return call


def result(value: int) -> tool_pb2.ToolOutcome:
    return tool_pb2.ToolOutcome(result_json=f'{{"n": {value}}}')


def refusals(response: Any) -> list[tuple[str, str]]:
    """Each answer as (tool request id, refusal reason or "" when taken)."""
    return [(answer.tool_request_id, answer.refusal.reason) for answer in response.answers]


async def test_each_result_is_answered_alone_and_a_bad_one_costs_the_others_nothing(
    stubs: tuple[Any, Any],
) -> None:
    public, internal = stubs
    host = await Host(public, "s-mixed").open()
    calls = {rid: dispatch(internal, "s-mixed", rid) for rid in ("tr_mix1", "tr_mix2", "tr_mix3")}
    assert sorted(await host.requests(3)) == sorted(calls)
    response = await host.submit(
        ("tr_mix1", result(1)),
        ("tr_mix2", tool_pb2.ToolOutcome(result_json="{not json")),
        ("tr_nosuch", result(0)),
        ("tr_mix3", result(3)),
        ("tr_mix3", result(3)),  # the same outcome again, as after a lost reply
        ("tr_mix1", tool_pb2.ToolOutcome()),  # neither a result nor an error
    )
    assert refusals(response) == [
        ("tr_mix1", ""),
        ("tr_mix2", Code.RESULT_NOT_JSON.value),
        ("tr_nosuch", Code.REQUEST_UNKNOWN.value),
        ("tr_mix3", ""),
        ("tr_mix3", Code.REQUEST_ENDED.value),
        ("tr_mix1", Code.INVALID_REQUEST.value),
    ]
    again = response.answers[4].refusal
    assert again.metadata["ended"] == "answered" and again.message
    for rid, value in (("tr_mix1", 1), ("tr_mix3", 3)):
        assert (await asyncio.wait_for(calls[rid], 5)).outcome.result_json == f'{{"n": {value}}}'
    # The refused result did not end its request: its host may still answer it.
    assert not calls["tr_mix2"].done()
    assert refusals(await host.submit(("tr_mix2", result(2)))) == [("tr_mix2", "")]
    assert (await asyncio.wait_for(calls["tr_mix2"], 5)).outcome.result_json == '{"n": 2}'
    host.stream.cancel()


async def test_another_host_sessions_requests_and_an_unknown_host_session_are_refused_result_by_result(
    stubs: tuple[Any, Any],
) -> None:
    public, internal = stubs
    owner = await Host(public, "s-owner").open()
    other = await Host(public, "s-other").open()
    call = dispatch(internal, "s-owner", "tr_own1")
    assert await owner.requests(1) == ["tr_own1"]
    assert refusals(await other.submit(("tr_own1", result(9)))) == [("tr_own1", Code.REQUEST_UNKNOWN.value)]
    gone = await other.submit(("tr_own1", result(9)), ("tr_x", result(9)), host_session_id="hs_gone")
    assert refusals(gone) == [
        ("tr_own1", Code.HOST_SESSION_UNKNOWN.value),
        ("tr_x", Code.HOST_SESSION_UNKNOWN.value),
    ]
    assert not call.done()
    assert refusals(await owner.submit(("tr_own1", result(1)))) == [("tr_own1", "")]
    assert (await asyncio.wait_for(call, 5)).outcome.result_json == '{"n": 1}'
    owner.stream.cancel()
    other.stream.cancel()


@pytest.mark.parametrize(
    ("results", "limit"),
    [
        # One result too many: the request's own first result is among them.
        (lambda rid: [(rid, result(0))] * (MAX_CALLS_PER_MESSAGE + 1), "max_results_per_submit"),
        # Three results each under the one-result limit, together over the request's.
        (
            lambda rid: [(rid, tool_pb2.ToolOutcome(result_json=f'"{"x" * (MAX_RESULT_BYTES - 16)}"'))] * 3,
            "max_submit_results_bytes",
        ),
    ],
)
async def test_a_request_over_a_limit_is_refused_whole_and_takes_nothing(
    stubs: tuple[Any, Any], results: Any, limit: str
) -> None:
    public, internal = stubs
    host = await Host(public, f"s-{limit[:12]}").open()
    rid = f"tr_{limit[:12]}"
    call = dispatch(internal, host.session, rid)
    assert await host.requests(1) == [rid]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await host.submit(*results(rid))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_code(refused.value) == Code.LIMIT_EXCEEDED
    info = error_info(refused.value)
    assert info is not None and info.metadata["limit"] == limit
    expected = MAX_CALLS_PER_MESSAGE if limit == "max_results_per_submit" else MAX_SUBMIT_RESULTS_BYTES
    assert info.metadata["value"] == str(expected)
    assert not call.done()
    assert refusals(await host.submit((rid, result(1)))) == [(rid, "")]
    assert (await asyncio.wait_for(call, 5)).outcome.result_json == '{"n": 1}'
    host.stream.cancel()
