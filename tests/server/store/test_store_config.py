"""Choosing the store: --store and TOOLMESH_STORE on `toolmesh up` and each service; bad URLs refused."""

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

from redis_testing import SHARED_URL, delete_prefixed, new_prefix
from toolmesh_testing import SUPPORT, run_cli, toolmesh_command

TOOLS_JSON = {"tools": [{"name": "kept", "inputSchema": {"type": "object"}}]}

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture
async def prefix() -> AsyncIterator[str]:
    chosen = new_prefix()
    yield chosen
    await delete_prefixed(SHARED_URL, chosen)


async def up_once(env: dict[str, str], *commands: tuple[str, ...]) -> tuple[str, list[str]]:
    """Start `toolmesh up` on free ports, run CLI commands against it, stop it: its banner and outputs."""
    process = await asyncio.create_subprocess_exec(
        *toolmesh_command(),
        "up",
        *("--registry-port", "0", "--invocation-port", "0", "--bridge-port", "0"),
        stdout=asyncio.subprocess.PIPE,
        cwd=SUPPORT,
        env=env,
    )
    assert process.stdout is not None
    lines = [(await asyncio.wait_for(process.stdout.readline(), 20)).decode() for _ in range(5)]
    addresses = dict(line.split() for line in lines[1:4])
    cli_env = dict(env, TOOLMESH_REGISTRY_ADDR=addresses["registry"])
    outputs = []
    for command in commands:
        code, out, err = await run_cli(*command, env=cli_env)
        assert code == 0, err
        outputs.append(out)
    process.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(process.wait(), 15) == 0
    return lines[0], outputs


async def test_up_on_redis_from_the_environment_keeps_tools_across_restarts(
    prefix: str, tmp_path: Path
) -> None:
    env = dict(os.environ, TOOLMESH_STORE=SHARED_URL, TOOLMESH_STORE_PREFIX=prefix)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS_JSON))
    banner, _ = await up_once(env, ("tools", "put", "--thread-id", "kept", "--file", str(tools)))
    assert "Redis at redis://127.0.0.1:6379/0" in banner
    _, (listed,) = await up_once(env, ("tools", "list", "--thread-id", "kept"))
    assert [tool["name"] for tool in json.loads(listed)["tools"]] == ["kept"]
    # The same without the variables: the embedded memory, which starts empty.
    plain = {key: value for key, value in env.items() if not key.startswith("TOOLMESH_STORE")}
    banner, (listed,) = await up_once(plain, ("tools", "list", "--thread-id", "kept"))
    assert "embedded in-memory store" in banner and json.loads(listed)["tools"] == []


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "redis://127.0.0.1:notaport/0"])
async def test_a_bad_store_url_is_a_usage_error(url: str) -> None:
    for command in (
        [sys.executable, "-m", "toolmesh.registry", "--store", url],
        [*toolmesh_command(), "up", "--store", url],
    ):
        process = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=SUPPORT
        )
        _, err = await asyncio.wait_for(process.communicate(), 20)
        assert process.returncode == 2, command
        assert b"Redis URL" in err or b"scheme" in err or b"Port" in err
