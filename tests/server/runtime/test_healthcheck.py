"""`python -m toolmesh.runtime.healthcheck`, the containers' health check, against real servers."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from toolmesh.assembly.system import start_registry
from toolmesh.runtime.healthcheck import SERVICE_UNKNOWN, SERVING, UNREACHABLE, check
from toolmesh.runtime.server import RunningServer

pytestmark = pytest.mark.integration

REGISTRY = "toolmesh.v1.RegistryService"


@pytest_asyncio.fixture
async def registry() -> AsyncIterator[RunningServer]:
    server = await start_registry()
    yield server
    await server.stop(0)


async def run_healthcheck(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "toolmesh.runtime.healthcheck",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, stdout.decode().strip(), stderr.decode()


async def test_command_exits_zero_for_a_serving_service(registry: RunningServer) -> None:
    code, out, _ = await run_healthcheck(f"127.0.0.1:{registry.port}", REGISTRY)
    assert (code, out) == (0, SERVING)


async def test_command_exits_one_while_the_server_drains(registry: RunningServer) -> None:
    # What a stopping server says first (RunningServer.stop): the check must fail from then on.
    await registry.health.enter_graceful_shutdown()
    code, out, _ = await run_healthcheck(f"127.0.0.1:{registry.port}", REGISTRY)
    assert (code, out) == (1, "NOT_SERVING")


async def test_whole_server_and_unknown_service(registry: RunningServer) -> None:
    address = f"127.0.0.1:{registry.port}"
    assert await asyncio.to_thread(check, address) == SERVING
    assert await asyncio.to_thread(check, address, "toolmesh.v1.NoSuchService") == SERVICE_UNKNOWN


async def test_nothing_listening_is_unreachable() -> None:
    # A port held but not listening refuses connections, and no other test can take it meanwhile.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{held.getsockname()[1]}"
        await assert_unreachable(address)


async def assert_unreachable(address: str) -> None:
    assert await asyncio.to_thread(check, address, REGISTRY, 1.0) == UNREACHABLE
    code, out, _ = await run_healthcheck(address, REGISTRY, "--timeout", "1")
    assert (code, out) == (1, UNREACHABLE)


@pytest.mark.parametrize(
    ("args", "message"),
    [((), "address"), (("",), "address is empty"), (("127.0.0.1:1", "--timeout", "0"), "must be positive")],
)
async def test_bad_usage_is_refused(args: tuple[str, ...], message: str) -> None:
    code, out, err = await run_healthcheck(*args)
    assert code == 2 and out == ""
    assert message in err
