"""The `toolmesh` command as a user runs it: real processes, real services, exit codes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from toolmesh_testing import TESTS, HostProcess, run_cli, toolmesh_command

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

TOOLS_JSON = {
    "tools": [
        {
            "name": "echo",
            "description": "Echo the arguments",
            "inputSchema": {"type": "object", "properties": {"n": {"type": "integer"}}},
            "timeoutMs": 5000,
            "annotations": {"readOnly": True},
        },
        {"name": "domain_fail", "description": "A domain error", "inputSchema": {"type": "object"}},
        {"name": "slow_async", "inputSchema": {"type": "object"}, "timeoutMs": 3000},
    ]
}


@pytest.fixture
def tools_file(tmp_path: Path) -> Path:
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS_JSON))
    return path


async def put_tools(env: dict[str, str], tools_file: Path) -> None:
    code, out, err = await run_cli("tools", "put", "--thread-id", "e2e", "--file", str(tools_file), env=env)
    assert code == 0, err
    assert json.loads(out)["tools"] == ["echo", "domain_fail", "slow_async"]


async def test_tools_put_and_list(cli_env: dict[str, str], tools_file: Path) -> None:
    await put_tools(cli_env, tools_file)
    code, out, _ = await run_cli("tools", "list", "--thread-id", "e2e", env=cli_env)
    assert code == 0
    listed = json.loads(out)
    assert listed["revision"] >= 1
    echo = listed["tools"][0]
    assert echo["name"] == "echo" and echo["timeoutMs"] == 5000 and echo["annotations"]["readOnly"] is True


async def test_tools_put_refuses_a_bad_schema(cli_env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"tools": [{"name": "x", "inputSchema": {"type": "object", "required": 3}}]}))
    code, _, err = await run_cli("tools", "put", "--thread-id", "e2e-bad", "--file", str(path), env=cli_env)
    assert code == 2
    assert "INVALID_SCHEMA" in err
    path.write_text("[]")
    code, _, err = await run_cli("tools", "put", "--thread-id", "e2e-bad", "--file", str(path), env=cli_env)
    assert code == 2 and "cannot read" in err


async def test_tool_call_success_prints_one_json_object(
    cli_env: dict[str, str], tools_file: Path, e2e_host: HostProcess
) -> None:
    await put_tools(cli_env, tools_file)
    code, out, _ = await run_cli(
        "tool-call",
        "--thread-id",
        "e2e",
        "--tool",
        "echo",
        "--args",
        '{"n": 5}',
        "--turn-id",
        "turn-9",
        env=cli_env,
    )
    assert code == 0
    response = json.loads(out)
    assert response["ok"] is True
    assert response["result"]["echo"] == {"n": 5}
    assert response["result"]["turnId"] == "turn-9"
    assert response["toolRequestId"] == response["result"]["toolRequestId"]


async def test_tool_call_formal_errors_exit_zero(
    cli_env: dict[str, str], tools_file: Path, e2e_host: HostProcess
) -> None:
    await put_tools(cli_env, tools_file)
    for tool, args, expected in [
        ("domain_fail", "{}", "NO_ACTIVE_SELECTION"),
        ("echo", '{"n": "x"}', "TOOL_ARGS_INVALID"),
        ("echo", "[1]", "TOOL_ARGS_INVALID"),
        ("missing", "{}", "TOOL_NOT_FOUND"),
    ]:
        code, out, _ = await run_cli(
            "tool-call", "--thread-id", "e2e", "--tool", tool, "--args", args, env=cli_env
        )
        response = json.loads(out)
        assert code == 0, (tool, out)
        assert response["ok"] is False and response["outcomeReceived"] is True
        assert response["error"]["code"] == expected
        assert set(response["error"]) >= {"code", "message", "retryable", "details"}


async def test_tool_call_own_deadline_exits_75(
    cli_env: dict[str, str], tools_file: Path, e2e_host: HostProcess
) -> None:
    await put_tools(cli_env, tools_file)
    code, out, _ = await run_cli(
        "tool-call",
        "--thread-id",
        "e2e",
        "--tool",
        "slow_async",
        "--args",
        '{"marker": "cli"}',
        "--timeout",
        "0.3",
        env=cli_env,
    )
    assert code == 75
    response = json.loads(out)
    assert response["outcomeReceived"] is False
    assert response["error"]["code"] == "CALLER_DEADLINE_EXCEEDED"
    assert response["error"]["retryable"] is True


async def test_tool_call_with_nothing_listening_exits_75(cli_env: dict[str, str]) -> None:
    env = dict(cli_env, TOOLMESH_INVOCATION_ADDR="127.0.0.1:1")
    code, out, _ = await run_cli(
        "tool-call", "--thread-id", "e2e", "--tool", "echo", "--timeout", "5", env=env
    )
    assert code == 75
    assert json.loads(out)["error"]["code"] == "TRANSPORT_FAILED"


@pytest.mark.parametrize(
    "args",
    [
        ["tool-call", "--tool", "echo"],  # no --thread-id
        ["tool-call", "--thread-id", "has space", "--tool", "echo"],
        ["tool-call", "--thread-id", "t", "--tool", "bad/name"],
        ["tool-call", "--thread-id", "t", "--tool", "echo", "--timeout", "soon"],
        ["no-such-command"],
    ],
)
async def test_usage_errors_exit_2(cli_env: dict[str, str], args: list[str]) -> None:
    code, _, _ = await run_cli(*args, env=cli_env)
    assert code == 2


async def test_host_with_bad_handlers_exits_2(cli_env: dict[str, str]) -> None:
    for spec in ["nomodule_xyz:H", "e2e_handlers", "e2e_handlers:MARKERS"]:
        code, _, err = await run_cli("host", "--thread-id", "t", "--handlers", spec, env=cli_env)
        assert code == 2, spec
        assert "cannot load handlers" in err


async def test_up_starts_everything_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        *toolmesh_command(),
        "up",
        "--registry-port",
        "0",
        "--invocation-port",
        "0",
        "--bridge-port",
        "0",
        "--web-port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=TESTS,
    )
    assert process.stdout is not None
    lines = [(await asyncio.wait_for(process.stdout.readline(), 20)).decode() for _ in range(5)]
    addresses = dict(line.split() for line in lines[1:4])
    assert set(addresses) == {"registry", "invocation", "bridge"}
    env = dict(
        os.environ,
        TOOLMESH_REGISTRY_ADDR=addresses["registry"],
        TOOLMESH_INVOCATION_ADDR=addresses["invocation"],
        TOOLMESH_BRIDGE_ADDR=addresses["bridge"],
    )
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS_JSON))
    code, _, err = await run_cli("tools", "put", "--thread-id", "up-test", "--file", str(tools), env=env)
    assert code == 0, err
    host = await asyncio.create_subprocess_exec(
        *toolmesh_command(),
        "host",
        "--thread-id",
        "up-test",
        "--handlers",
        "e2e_handlers:HANDLERS",
        cwd=TESTS,
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    assert host.stderr is not None
    while b"host ready" not in await asyncio.wait_for(host.stderr.readline(), 20):
        pass
    code, out, _ = await run_cli(
        "tool-call", "--thread-id", "up-test", "--tool", "echo", "--args", "{}", env=env
    )
    assert code == 0 and json.loads(out)["ok"] is True
    host.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(host.wait(), 10) == 0
    process.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(process.wait(), 15) == 0
    rest = (await process.stdout.read()).decode()
    assert "toolmesh stopped" in rest


async def test_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("toolmesh")
    assert script.exists()
