"""`toolmesh mcp` and `toolmesh host --mcp`: the command lines' refusals, each with its exit code."""

from __future__ import annotations

import pytest

from mcp_testing import services_env
from toolmesh.assembly.system import LocalSystem
from toolmesh_testing import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["mcp"], "give --session-id (stdio) or --http"),
        (["mcp", "--session-id", "s", "--http"], "give --session-id (stdio) or --http"),
        (["mcp", "--http", "--listen", "nowhere"], "--listen takes HOST:PORT"),
        (["host", "--session-id", "s", "--mcp", ""], "--mcp needs a command"),
        (["host", "--session-id", "s", "--mcp", "x", "--handlers", "m:H"], "not allowed with argument"),
    ],
)
async def test_malformed_commands_exit_2(system: LocalSystem, args: list[str], said: str) -> None:
    code, _, err = await run_cli(*args, env=services_env(system))
    assert code == 2
    assert said in err


async def test_an_mcp_server_that_cannot_start_exits_75(system: LocalSystem) -> None:
    code, _, err = await run_cli(
        "host", "--session-id", "s", "--mcp", "/nonexistent/mcp-server --flag", env=services_env(system)
    )
    assert code == 75
    assert "toolmesh host: the MCP server failed (" in err
