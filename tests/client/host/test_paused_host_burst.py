"""A host process frozen (SIGSTOP) while a burst of requests queues on its stream starts none of
those whose deadline passed meanwhile, when it is thawed (SIGCONT), nor, if it acknowledges
starts, those cancelled meanwhile.

Both kinds of host: one that asks the bridge before starting (the bridge answers TIMED_OUT or
CANCELLED), and one that does not (it checks the deadline on the bridge's clock itself; it starts
a request as it reads it, before the cancellation queued behind it). Their handlers
(ledger_handlers) write every start in a file.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from toolmesh.assembly.system import LocalSystem, start_local_system
from toolmesh.client import CallResult, InvocationClient, RegistryClient
from toolmesh.core.tools import ToolSpec
from toolmesh_testing import SUPPORT, HostProcess, eventually, start_host_process

pytestmark = pytest.mark.integration

SESSION = "paused-host"
OBJECT = '{"type": "object"}'
TOOLS = [
    ToolSpec("count", "Counts its runs", OBJECT, timeout_ms=20_000),
    ToolSpec("count_short", "Counts its runs, briefly", OBJECT, timeout_ms=1_000),
]
BURST = 16


def runs(marker_dir: Path, key: str) -> list[str]:
    path = marker_dir / f"runs-{key}"
    return path.read_text().split() if path.exists() else []


@pytest_asyncio.fixture
async def system() -> AsyncIterator[LocalSystem]:
    running = await start_local_system()
    async with RegistryClient(running.registry_target) as registry:
        await registry.put_tools(SESSION, TOOLS)
    yield running
    await running.stop(0.5)


async def plain_host_process(bridge_target: str, marker_dir: Path) -> HostProcess:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "plain_host.py",
        bridge_target,
        SESSION,
        cwd=SUPPORT,
        env=dict(os.environ, TOOLMESH_TEST_MARKERS=str(marker_dir)),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    host = HostProcess(process)

    async def read() -> None:
        assert process.stderr is not None
        async for line in process.stderr:
            host.stderr_lines.append(line.decode(errors="replace"))

    host._reader = asyncio.create_task(read())
    await host.wait_for_log(msg="host ready", timeout=20)
    return host


@pytest.mark.parametrize("acknowledges", [True, False], ids=["acknowledging starts", "not acknowledging"])
async def test_a_thawed_host_starts_no_queued_request_past_its_deadline_or_cancelled(
    system: LocalSystem, tmp_path: Path, acknowledges: bool
) -> None:
    if acknowledges:
        host = await start_host_process(system.bridge_target, SESSION, "ledger_handlers:HANDLERS", tmp_path)
    else:
        host = await plain_host_process(system.bridge_target, tmp_path)
    timed_out = [uuid.uuid4().hex for _ in range(BURST)]
    # Fenced only by the bridge's answer to StartToolRequests.
    cancelled = [uuid.uuid4().hex for _ in range(BURST // 4 if acknowledges else 0)]
    try:
        host.process.send_signal(signal.SIGSTOP)
        async with InvocationClient(system.invocation_target) as client:
            ids: list[str] = []
            long_calls = [
                asyncio.create_task(
                    client.invoke(SESSION, "count", {"key": key}, turn_id="t", on_started=ids.append)
                )
                for key in cancelled
            ]
            results = await asyncio.wait_for(
                asyncio.gather(
                    *(client.invoke(SESSION, "count_short", {"key": key}, turn_id="t") for key in timed_out)
                ),
                15,
            )
            await eventually(lambda: len(ids) == len(cancelled))
            for tool_request_id in ids:
                assert await client.cancel_invocation(tool_request_id)
            ended: list[CallResult] = await asyncio.wait_for(asyncio.gather(*long_calls), 15)
            host.process.send_signal(signal.SIGCONT)
            # Read after the burst on the same stream: once it ran, the burst was read before it.
            after_key = uuid.uuid4().hex
            after = await client.invoke(SESSION, "count", {"key": after_key}, turn_id="t2")
        assert all(r.outcome is not None and r.outcome.code == "TOOL_TIMEOUT" for r in results), results
        assert all(r.outcome is not None and r.outcome.code == "TOOL_CANCELLED" for r in ended), ended
        assert after.outcome is not None and after.outcome.ok, after
        assert runs(tmp_path, after_key) == [after.tool_request_id]
        assert {key: runs(tmp_path, key) for key in timed_out + cancelled if runs(tmp_path, key)} == {}
    finally:
        host.process.send_signal(signal.SIGCONT)
        await host.stop()
