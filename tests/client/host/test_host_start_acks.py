"""The host SDK's start acknowledgements with real host processes, SIGKILLed and SIGSTOPped.

The handlers (ledger_handlers) write every execution's tool request id in a file: a run is
counted where it happened, whatever the caller was told.
"""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.client import CallResult, InvocationClient, RegistryClient
from toolmesh.core.tools import ToolSpec
from toolmesh_testing import HostProcess, eventually, start_host_process

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
