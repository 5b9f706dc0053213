"""The host SDK's start acknowledgements with real host processes, SIGKILLed and SIGSTOPped.

The handlers (ledger_handlers) write every execution's tool request id in a file: a run is
counted where it happened, whatever the caller was told.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from scripted_bridge import ScriptedBridge, scripted

from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.client import CallResult, InvocationClient, RegistryClient
from toolmesh.core.tools import ToolSpec
from toolmesh.host import ToolContext, ToolHost
from toolmesh.host.engine import Registered
from toolmesh.v1 import bridge_pb2
from toolmesh_testing import HostProcess, eventually, logged, start_host_process

pytestmark = pytest.mark.integration

SESSION = "acks"
OBJECT = '{"type": "object"}'
TOOLS = [
    ToolSpec("count", "Counts its runs", OBJECT, timeout_ms=20_000),
    ToolSpec("count_short", "Counts its runs, briefly", OBJECT, timeout_ms=1_000),
]


def runs(marker_dir: Path, key: str) -> list[str]:
    """The tool request ids of every execution of `key` (ledger_handlers writes them)."""
    path = marker_dir / f"runs-{key}"
    return path.read_text().split() if path.exists() else []


@pytest_asyncio.fixture
async def system() -> AsyncIterator[LocalSystem]:
    running = await start_local_system()
    async with RegistryClient(running.registry_target) as registry:
        await registry.put_tools(SESSION, TOOLS)
    yield running
    await running.stop(0.5)


async def host_process(system: LocalSystem, marker_dir: Path) -> tuple[HostProcess, str]:
    """A `toolmesh host` process serving the session, and its host session id."""
    host = await start_host_process(system.bridge_target, SESSION, "ledger_handlers:HANDLERS", marker_dir)
    ready = await host.wait_for_log(msg="host ready")
    return host, str(ready["host_session_id"])


async def test_requests_a_killed_host_never_started_run_once_on_another(
    system: LocalSystem, tmp_path: Path
) -> None:
    first, first_id = await host_process(system, tmp_path)
    second: HostProcess | None = None
    held = uuid.uuid4().hex
    keys = [uuid.uuid4().hex for _ in range(4)]
    try:
        async with InvocationClient(system.invocation_target) as client:
            started = asyncio.create_task(
                client.invoke(SESSION, "count", {"key": held, "hold": True}, turn_id="t")
            )
            await eventually(lambda: runs(tmp_path, held))  # it runs on the first host
            first.process.send_signal(signal.SIGSTOP)
            calls = [
                asyncio.create_task(client.invoke(SESSION, "count", {"key": key}, turn_id="t"))
                for key in keys
            ]
            # Sent to the first host, which cannot read them: delivered, never started.
            await eventually(lambda: len(system.router.host(first_id).in_flight) == 1 + len(keys))
            second, _ = await host_process(system, tmp_path)
            first.kill()
            results: list[CallResult] = await asyncio.wait_for(asyncio.gather(*calls), 20)
            lost = await asyncio.wait_for(started, 20)
        for key, result in zip(keys, results, strict=True):
            assert result.outcome is not None and result.outcome.failure is None, result
            assert json.loads(result.outcome.result_json or "")["servedBy"] == second.process.pid
            assert runs(tmp_path, key) == [result.tool_request_id]
        # The one it had started keeps today's outcome: it may have run (it did).
        assert lost.outcome is not None and lost.outcome.code == "TOOL_HOST_DISCONNECTED", lost
        assert len(runs(tmp_path, held)) == 1
    finally:
        if first.process.returncode is None:
            first.kill()
        await first.stop()
        if second is not None:
            await second.stop()


async def test_a_host_paused_past_the_deadline_never_starts_the_handler(
    system: LocalSystem, tmp_path: Path
) -> None:
    host, _ = await host_process(system, tmp_path)
    key = uuid.uuid4().hex
    try:
        host.process.send_signal(signal.SIGSTOP)
        async with InvocationClient(system.invocation_target) as client:
            result = await asyncio.wait_for(
                client.invoke(SESSION, "count_short", {"key": key}, turn_id="t"), 10
            )
        assert result.outcome is not None and result.outcome.code == "TOOL_TIMEOUT", result
        assert result.tool_request_id is not None
        host.process.send_signal(signal.SIGCONT)
        # It reads the request only now, with its deadline behind it, and says so.
        record = await host.wait_for_log(
            msg="tool request not started", tool_request_id=result.tool_request_id
        )
        assert record["cause"] in {"DEADLINE_PASSED", "TIMED_OUT", "CANCELLED"}
        assert key not in json.dumps(record)  # ids, never arguments
        # Still serving, and the late request never ran.
        async with InvocationClient(system.invocation_target) as client:
            after = await client.invoke(SESSION, "count", {"key": key}, turn_id="t2")
        assert after.outcome is not None and after.outcome.failure is None, after
        assert runs(tmp_path, key) == [after.tool_request_id]
    finally:
        host.process.send_signal(signal.SIGCONT)
        await host.stop()


class AckingBridge(ScriptedBridge):
    """Sends `count` tool requests at once on a stream that acknowledges starts; answers
    StartToolRequests with START for each, or fails it (`fail`)."""

    def __init__(
        self,
        count: int,
        *,
        fail: bool = False,
        redeliverable: bool = False,
        timeout_ms: int = 5000,
        start_delay_s: float = 0.0,
    ) -> None:
        """`start_delay_s`: how long each START answer takes (as if read late by a paused host)."""
        self.count = count
        self.fail = fail
        self.redeliverable = redeliverable
        self.timeout_ms = timeout_ms
        self.start_delay_s = start_delay_s
        self.asked: list[list[str]] = []
        self.answered = 0
        self.submitted: list[str] = []

    async def OpenHostSession(self, request: Any, context: Any) -> AsyncIterator[Any]:
        assert request.acknowledges_starts
        now_ms = int(time.time() * 1000)
        opened = bridge_pb2.HostSessionOpened(
            host_session_id="hs_1",
            heartbeat_interval_ms=1000,
            server_time_unix_ms=now_ms,
            starts_acknowledged=True,
        )
        yield bridge_pb2.OpenHostSessionResponse(opened=opened)
        for index in range(self.count):
            yield bridge_pb2.OpenHostSessionResponse(
                tool_request=bridge_pb2.ToolRequest(
                    session_id="acking",
                    turn_id="t",
                    tool_request_id=f"tr_{index}",
                    tool_name="echo",
                    arguments_json="{}",
                    timeout_ms=self.timeout_ms,
                    deadline_unix_ms=now_ms + self.timeout_ms,
                    redeliverable=self.redeliverable,
                )
            )
        await asyncio.sleep(60)

    async def StartToolRequests(self, request: Any, context: Any) -> Any:
        self.asked.append(list(request.tool_request_ids))
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
        await asyncio.sleep(self.start_delay_s)
        self.answered += 1
        return bridge_pb2.StartToolRequestsResponse(
            starts=[
                bridge_pb2.ToolStart(tool_request_id=i, verdict=bridge_pb2.TOOL_START_VERDICT_START)
                for i in request.tool_request_ids
            ]
        )

    async def SubmitToolResult(self, request: Any, context: Any) -> Any:
        self.submitted.append(request.tool_request_id)
        return bridge_pb2.SubmitToolResultResponse()


def record(runs: list[str], tool_request_id: str) -> dict[str, bool]:
    runs.append(tool_request_id)
    return {"ran": True}


async def served(bridge: AckingBridge, *until: Callable[[], object]) -> list[str]:
    """The tool request ids a host ran, serving `bridge` until each of `until` holds in turn
    (by default: until it has submitted `bridge.count` results)."""
    runs: list[str] = []
    async with scripted(bridge) as target:
        host = ToolHost(target, "acking")
        host.on_tool("echo", lambda args, ctx: record(runs, ctx.tool_request_id))
        await host.start(timeout=5)
        try:
            for condition in until or (lambda: len(bridge.submitted) == bridge.count,):
                await eventually(condition)
        finally:
            await host.stop()
    return runs


async def test_requests_read_together_are_asked_to_start_in_one_call() -> None:
    bridge = AckingBridge(20)
    runs = await served(bridge)
    assert sorted(runs) == sorted(f"tr_{i}" for i in range(20))
    assert sorted(i for ids in bridge.asked for i in ids) == sorted(runs)  # each asked once
    assert len(bridge.asked) < 20  # batched: fewer calls than requests


async def test_read_only_or_idempotent_requests_run_without_asking() -> None:
    # Sent again elsewhere if the host leaves, started or not: a START would tell the bridge nothing.
    bridge = AckingBridge(5, redeliverable=True)
    runs = await served(bridge)
    assert sorted(runs) == sorted(f"tr_{i}" for i in range(5))
    assert bridge.asked == []


async def test_a_host_whose_start_call_fails_runs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    bridge = AckingBridge(3, fail=True)
    with caplog.at_level(logging.WARNING, logger="toolmesh.host"):
        runs = await served(
            bridge,
            lambda: sum(len(ids) for ids in bridge.asked) == 3,
            lambda: logged(caplog.records, "tool requests not started: the bridge did not answer"),
        )
    assert runs == [] and bridge.submitted == []


async def test_a_start_read_after_the_deadline_runs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    # The bridge said START in time; the host read it after the deadline (it was paused, say):
    # the caller has TOOL_TIMEOUT, so the handler must not begin now.
    bridge = AckingBridge(1, timeout_ms=300, start_delay_s=0.6)
    with caplog.at_level(logging.INFO, logger="toolmesh.host"):
        runs = await served(
            bridge,
            lambda: bridge.answered == 1,
            lambda: logged(caplog.records, "tool request not started"),
        )
    (record_,) = [r for r in caplog.records if r.getMessage() == "tool request not started"]
    assert getattr(record_, "cause", None) == "DEADLINE_PASSED"
    assert runs == [] and bridge.submitted == []


async def test_a_handler_begun_after_the_deadline_does_not_run(caplog: pytest.LogCaptureFixture) -> None:
    # Told START in time, its task made, then the process paused before the task began (bench.chaos
    # seed 47: a handler began 8.3 s after its caller's TOOL_TIMEOUT): the deadline is checked
    # again as the handler is about to run.
    ran: list[str] = []
    handler = Registered.of(lambda args, ctx: ran.append(ctx.tool_request_id))
    engine = ToolHost("127.0.0.1:1", "acking")._engine
    late = ToolContext("acking", "t", "tr_late", "echo", deadline=time.monotonic() - 0.001)
    with caplog.at_level(logging.INFO, logger="toolmesh.host"):
        assert await engine._execute(handler, "{}", late) is None
    (said,) = [r for r in caplog.records if r.getMessage() == "tool request not started"]
    assert getattr(said, "cause", None) == "DEADLINE_PASSED"
    in_time = ToolContext("acking", "t", "tr_in_time", "echo", deadline=time.monotonic() + 5)
    assert await engine._execute(handler, "{}", in_time) is not None
    assert ran == ["tr_in_time"]
