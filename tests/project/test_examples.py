"""The examples the Quickstart points to run as they are against a real local system."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from toolmesh.assembly.system import LocalSystem
from toolmesh_testing import eventually

pytestmark = pytest.mark.integration
in_module_loop = pytest.mark.asyncio(loop_scope="module")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _env(system: LocalSystem) -> dict[str, str]:
    return dict(
        os.environ,
        TOOLMESH_REGISTRY_ADDR=system.registry_target,
        TOOLMESH_INVOCATION_ADDR=system.invocation_target,
        TOOLMESH_BRIDGE_ADDR=system.bridge_target,
        # The `toolmesh` and `python3` of this environment first, as `PATH=.venv/bin:$PATH` gives.
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )


async def _run(*command: str, env: dict[str, str]) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *command, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def host(system: LocalSystem) -> AsyncIterator[None]:
    """examples/python_host.py serving, until SIGINT (Ctrl-C) stops it."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(EXAMPLES / "python_host.py"), env=_env(system),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 20)
    assert line.decode().startswith("serving session examples (greet)")
    yield
    process.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(process.wait(), 10) == 0


@in_module_loop
async def test_the_python_caller_gets_the_hosts_result(system: LocalSystem, host: None) -> None:
    async def greeted() -> str | None:
        # The host declares its tool as it connects: the first call may come before the list has it.
        code, out, _ = await _run(sys.executable, str(EXAMPLES / "python_caller.py"), env=_env(system))
        return out if code == 0 else None

    assert json.loads(await eventually(greeted, timeout=20)) == {"greeting": "Hello, Ada!"}


@in_module_loop
async def test_the_python_caller_tells_the_tools_own_error(system: LocalSystem, host: None) -> None:
    code, out, err = await _run(sys.executable, str(EXAMPLES / "python_caller.py"), " ", env=_env(system))
    assert (code, out) == (1, "")
    assert json.loads(err)["code"] == "NO_NAME"


@in_module_loop
async def test_the_cli_call_and_the_ledgers_record(system: LocalSystem, host: None) -> None:
    code, out, err = await _run("sh", str(EXAMPLES / "cli_call.sh"), "Grace", env=_env(system))
    assert code == 0, err
    # tool-call prints one line; `invocations show` an indented object.
    first, _, rest = out.partition("\n")
    call, shown = json.loads(first), json.loads(rest)
    assert call["ok"] and call["result"] == {"greeting": "Hello, Grace!"}
    assert shown["toolRequestId"] == call["toolRequestId"]
    assert shown["state"] == "completed" and shown["result"] == call["result"]
