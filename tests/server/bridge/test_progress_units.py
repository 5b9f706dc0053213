"""Progress and cancellation without servers: the bridge's gate and verdicts, the invoker's rules."""

from __future__ import annotations

import asyncio
import math

import pytest

from toolmesh.bridge.progress import ProgressGate
from toolmesh.bridge.router import Router
from toolmesh.cli.call import progress_line
from toolmesh.contracts.cancels import CancelBoard
from toolmesh.contracts.ledger import CancelVerdict, InvocationState, Ledger
from toolmesh.core.calls import ToolCall, ToolRequest
from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.core.limits import PROGRESS_MESSAGE_MAX_CHARS
from toolmesh.core.outcome import Outcome
from toolmesh.core.progress import ProgressVerdict, ToolProgress, capped_message, valid_numbers
from toolmesh.core.tools import ToolSpec
from toolmesh.invocation.invoker import Invoker
from toolmesh.invocation.ports import ProgressSink
from toolmesh.store.base import Versioned
from toolmesh.store.memory import InMemoryStore, MemoryLedgerStore
from toolmesh_testing import eventually

pytestmark = pytest.mark.unit


def report(progress: float, total: float | None = None, message: str | None = None) -> ToolProgress:
    return ToolProgress("tr_1", progress, total, message)


def test_numbers_must_be_finite_and_a_total_above_zero() -> None:
    assert valid_numbers(0, None) and valid_numbers(-1.5, None) and valid_numbers(3, 10)
    for progress, total in [
        (math.nan, None),
        (math.inf, None),
        (1, 0),
        (1, -2),
        (1, math.nan),
        (1, math.inf),
    ]:
        assert not valid_numbers(progress, total), (progress, total)


def test_a_message_is_cut_to_its_cap() -> None:
    assert capped_message(None) == ("", False)
    assert capped_message("half way") == ("half way", False)
    cut, truncated = capped_message("é" * (PROGRESS_MESSAGE_MAX_CHARS + 1))
    assert truncated and cut == "é" * PROGRESS_MESSAGE_MAX_CHARS


def test_the_cli_shows_one_line_per_report() -> None:
    assert progress_line(report(2, 5, "copying")) == "progress 2/5: copying"
    assert progress_line(report(0.5)) == "progress 0.5"
    assert progress_line(report(1, None, "two\nlines\x1b[31m")) == "progress 1: two lines [31m"


async def test_the_gate_passes_the_first_at_once_then_the_latest_per_interval() -> None:
    passed: list[float] = []
    gate = ProgressGate(lambda progress: passed.append(progress.progress), interval_s=0.05)
    gate.offer(report(1))
    assert passed == [1]
    for n in range(2, 50):
        gate.offer(report(n))
    assert passed == [1]  # the others wait for the interval: only the latest is kept
    await eventually(lambda: passed == [1, 49])
    gate.offer(report(50))
    gate.close()  # the request ended: what waits is dropped
    gate.offer(report(51))  # a closed gate's timer is gone: a late offer is no harm either
    assert passed[:2] == [1, 49] and 50 not in passed


async def test_the_router_answers_each_report_with_a_verdict() -> None:
    router = Router(heartbeat_s=60)
    host = router.open_host("s", "h", ["tool"], False)
    other = router.open_host("s", "other", [], False)
    heard: list[ToolProgress] = []
    outcomes: list[Outcome] = []
    router.start(ToolRequest("s", "t", "tr_1", "tool", "{}", 10_000), outcomes.append, heard.append)
    hid = host.host_session_id
    assert router.report_progress(hid, report(1, 4, "x" * 600)) == (ProgressVerdict.ACCEPTED, True)
    assert heard == [ToolProgress("tr_1", 1, 4, "x" * PROGRESS_MESSAGE_MAX_CHARS)]
    assert router.report_progress(hid, report(math.nan)) == (ProgressVerdict.INVALID, False)
    assert router.report_progress(other.host_session_id, report(2)) == (
        ProgressVerdict.REQUEST_UNKNOWN,
        False,
    )
    unknown = ToolProgress("tr_unknown", 1, None, None)
    assert router.report_progress(hid, unknown) == (ProgressVerdict.REQUEST_UNKNOWN, False)
    router.submit(hid, "tr_1", Outcome.success("1"))
    assert router.report_progress(hid, report(3)) == (ProgressVerdict.REQUEST_ENDED, False)
    assert router.report_progress(other.host_session_id, report(3)) == (
        ProgressVerdict.REQUEST_UNKNOWN,
        False,
    )
    with pytest.raises(ToolmeshError) as gone:
        router.report_progress("hs_gone", report(3))
    assert gone.value.code is Code.HOST_SESSION_UNKNOWN
    with pytest.raises(ToolmeshError) as malformed:
        router.report_progress(hid, ToolProgress("bad id!", 1, None, None))
    assert malformed.value.code is Code.INVALID_REQUEST
    assert len(heard) == 1 and outcomes == [Outcome.success("1")]
    router.shutdown()


class OneTool:
    async def get_tool(self, session_id: str, name: str) -> ToolSpec | None:
        return ToolSpec(name, "", '{"type": "object"}', timeout_ms=5000)


class HeldHost:
    """Stands in for the bridge: reports progress, then holds each request until it is cancelled."""

    def __init__(self) -> None:
        self.dispatched = asyncio.Event()
        self.cancelled: list[str] = []

    async def dispatch(self, request: ToolRequest, on_progress: ProgressSink | None = None) -> Outcome:
        if on_progress is not None:
            on_progress(ToolProgress(request.tool_request_id, 1, 2, "half"))
        self.dispatched.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(request.tool_request_id)
            raise
        return Outcome.success("1")


CALL = ToolCall("s", "t", "tool", '{"n": 1}')


@pytest.mark.parametrize("leaves_early", [True, False])
async def test_a_cancelled_invocation_stops_its_dispatch_and_ends_cancelled(leaves_early: bool) -> None:
    host = HeldHost()
    invoker = Invoker(OneTool(), host, Ledger(MemoryLedgerStore()))
    heard: list[ToolProgress] = []
    started: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def announce(tool_request_id: str, attachment_id: str, safe_until: float) -> None:
        started.set_result(tool_request_id)

    call = asyncio.ensure_future(
        invoker.invoke(CALL, leaves_early=leaves_early, on_invocation=announce, on_progress=heard.append)
    )
    tool_request_id = await started
    await host.dispatched.wait()
    assert heard == [ToolProgress(tool_request_id, 1, 2, "half")]
    with pytest.raises(ToolmeshError) as foreign:
        await invoker.cancel_invocation(tool_request_id, sessions={"another"})
    assert foreign.value.code is Code.INVOCATION_NOT_FOUND
    assert await invoker.cancel_invocation(tool_request_id) is CancelVerdict.CANCELLED
    result = await call
    assert result.outcome.code == Code.TOOL_CANCELLED and host.cancelled == [tool_request_id]
    record = await invoker.get_invocation(tool_request_id)
    assert record.state is InvocationState.CANCELLED
    assert await invoker.cancel_invocation(tool_request_id) is CancelVerdict.ENDED


async def test_a_cancellation_posted_by_another_replica_stops_the_local_dispatch() -> None:
    host = HeldHost()
    store, ledger = InMemoryStore(), Ledger(MemoryLedgerStore())
    owner = Invoker(OneTool(), host, ledger, cancels=CancelBoard(store))
    other = Invoker(OneTool(), HeldHost(), ledger, cancels=CancelBoard(store))
    ready = asyncio.Event()
    following = asyncio.create_task(owner.follow_cancellations(ready))
    await ready.wait()
    started: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def announce(tool_request_id: str, attachment_id: str, safe_until: float) -> None:
        started.set_result(tool_request_id)

    call = asyncio.ensure_future(owner.invoke(CALL, on_invocation=announce))
    tool_request_id = await started
    await host.dispatched.wait()
    # The other replica does not run it: it records the cancellation and posts it for the owner.
    assert await other.cancel_invocation(tool_request_id) is CancelVerdict.CANCELLED
    result = await asyncio.wait_for(call, 5)
    assert result.outcome.code == Code.TOOL_CANCELLED and host.cancelled == [tool_request_id]
    following.cancel()


class UnreachableStore(InMemoryStore):
    """A store that cannot be reached: every read fails."""

    async def get(self, key: str) -> Versioned | None:
        raise ToolmeshError(Code.STORE_UNAVAILABLE)


async def test_a_cancel_the_store_cannot_pass_on_is_still_recorded(caplog: pytest.LogCaptureFixture) -> None:
    ledger = Ledger(MemoryLedgerStore())
    invoker = Invoker(OneTool(), HeldHost(), ledger, cancels=CancelBoard(UnreachableStore()))
    # Running in another replica: claimed in the shared ledger, not dispatched here.
    claimed = await ledger.claim(CALL, "tr_elsewhere", 5000)
    assert await invoker.cancel_invocation("tr_elsewhere") is CancelVerdict.CANCELLED
    record = await ledger.get("tr_elsewhere")
    assert record is not None and record.state is InvocationState.CANCELLED
    assert "a cancellation was not posted to the other replicas" in caplog.messages
    # Its owner's late outcome loses to the cancel: the owner's caller gets TOOL_CANCELLED too.
    assert await ledger.finish("tr_elsewhere", Outcome.success("1"), claimed=claimed.record) is False
