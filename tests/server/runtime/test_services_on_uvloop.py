"""TOOLMESH_EVENT_LOOP: the services, the CLI and `toolmesh host` on uvloop by default and when asked,
on the standard loop when told, refused when unknown.

Real processes: registry, bridge and invocation as `python -m toolmesh.<service>`,
a `toolmesh host` process, and a call through them; each process's memory map
shows whether it loaded uvloop's extension (it is imported only to run on it).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from toolmesh.client import InvocationClient, RegistryClient
from toolmesh.core import event_loop
from toolmesh.core.tools import ToolSpec
from toolmesh_testing import refused_start, run_cli, start_host_process, start_service_process

pytestmark = pytest.mark.integration

SESSION = "on-uvloop"
ECHO = ToolSpec("echo", "Echoes", '{"type": "object"}')


def loaded_uvloop(pid: int) -> bool:
    # The extension's file (uvloop/loop.cpython-*.so), not any path that says uvloop (a work tree's).
    return "/uvloop/loop." in Path(f"/proc/{pid}/maps").read_text()


async def test_a_call_through_services_and_host_on_uvloop(tmp_path: Path) -> None:
    env = dict(os.environ, TOOLMESH_EVENT_LOOP="uvloop")
    registry, bridge = await asyncio.gather(
        start_service_process("registry", env=env), start_service_process("bridge", env=env)
    )
    dependencies = ("--registry", registry.internal_target, "--bridge", bridge.internal_target)
    invocation = await start_service_process("invocation", *dependencies, env=env)
    services = [registry, bridge, invocation]
    host = None
    try:
        async with RegistryClient(registry.target) as client:
            await client.put_tools(SESSION, [ECHO])
        host = await start_host_process(bridge.target, SESSION, "e2e_handlers:HANDLERS", tmp_path, env=env)
        async with InvocationClient(invocation.target) as caller:
            result = await caller.invoke(SESSION, "echo", {"said": "hi"}, turn_id="t")
        assert result.outcome is not None and result.outcome.ok
        assert all(loaded_uvloop(service.process.pid) for service in services)
        assert loaded_uvloop(host.process.pid)
        # The CLI too: it lists the tools through the registry.
        code, out, err = await run_cli(
            "tools", "list", "--thread-id", SESSION, env=dict(env, TOOLMESH_REGISTRY_ADDR=registry.target)
        )
        assert code == 0, err
        assert '"echo"' in out
    finally:
        if host is not None:
            host.kill()
            await host.process.wait()
        for service in services:
            await service.stop()


async def test_uvloop_by_default_and_the_standard_loop_when_told() -> None:
    unset = {key: value for key, value in os.environ.items() if key != event_loop.ENV}
    default, told = await asyncio.gather(
        start_service_process("registry", env=unset),
        start_service_process("registry", env=dict(unset, TOOLMESH_EVENT_LOOP="asyncio")),
    )
    try:
        assert loaded_uvloop(default.process.pid)
        assert not loaded_uvloop(told.process.pid)
    finally:
        await asyncio.gather(default.stop(), told.stop())


async def test_an_unknown_loop_is_a_usage_error() -> None:
    env = dict(os.environ, TOOLMESH_EVENT_LOOP="trio")
    code, err = await refused_start("registry", env=env)
    assert code == 2
    assert "TOOLMESH_EVENT_LOOP must be one of asyncio, uvloop" in err
    code, _, err = await run_cli("tools", "list", "--thread-id", SESSION, env=env)
    assert code == 2
    assert "TOOLMESH_EVENT_LOOP must be one of asyncio, uvloop" in err
