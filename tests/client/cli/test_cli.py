"""The `toolmesh` command as a user runs it: real processes, real services, exit codes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from toolmesh.assembly.system import LocalSystem
from toolmesh.client import RegistryClient
from toolmesh_testing import SUPPORT, HostProcess, eventually, run_cli, toolmesh_command

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


async def put_tools(env: dict[str, str], tools_file: Path, session: str = "e2e") -> None:
    code, out, err = await run_cli("tools", "put", "--thread-id", session, "--file", str(tools_file), env=env)
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


@pytest.mark.parametrize(
    ("text", "said"),
    [
        # The registry's refusal, in the same one-line form as the file's own problems.
        (
            json.dumps({"tools": [{"name": "x", "inputSchema": {"type": "object", "required": 3}}]}),
            "INVALID_SCHEMA",
        ),
        ("[]", 'the file must hold {"tools": [...]}'),
        ('{"tools": [\n  {"name": "x",}\n]}', "line 2 column 16: Expecting property name"),
        (
            json.dumps(
                {"tools": [{"name": "x", "inputSchema": {}, "annotations": {"requiresConfirmaton": True}}]}
            ),
            'tools[0]: x: unknown key "requiresConfirmaton" in annotations',
        ),
        (json.dumps({"tools": [], "tool": []}), 'unknown key "tool"'),
    ],
)
async def test_tools_put_refuses_a_bad_file_in_one_line(
    cli_env: dict[str, str], tmp_path: Path, text: str, said: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    code, out, err = await run_cli(
        "tools", "put", "--session-id", "e2e-bad", "--file", str(path), env=cli_env
    )
    assert code == 2 and out == ""
    assert err.startswith(f"toolmesh tools put: {path}: ") and said in err and err.count("\n") == 1, err


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
    # The same shape as every other output, with the id to reconcile.
    assert set(response) == {
        "ok",
        "outcomeReceived",
        "toolRequestId",
        "joined",
        "replayed",
        "retrySafeUntil",
        "error",
    }
    assert response["retrySafeUntil"].endswith("Z")  # until when the same command is safe
    assert response["error"]["kind"] == "runtime"
    code, shown, _ = await run_cli("invocations", "show", response["toolRequestId"], env=cli_env)
    assert code == 0
    invocation = json.loads(shown)
    assert invocation["toolRequestId"] == response["toolRequestId"]
    # The tool sleeps past its own 3 s timeoutMs: still running, or already ended by that timeout
    # when starting this second command took long (a loaded machine); never anything else.
    assert invocation["toolName"] == "slow_async" and invocation["state"] in {"running", "timed_out"}


async def test_invocations_show_prints_what_tool_call_printed(
    cli_env: dict[str, str], tools_file: Path, e2e_host: HostProcess
) -> None:
    await put_tools(cli_env, tools_file)
    for tool, args in [("echo", '{"n": 7}'), ("domain_fail", "{}")]:
        code, out, _ = await run_cli(
            "tool-call", "--session-id", "e2e", "--tool", tool, "--args", args, env=cli_env
        )
        called = json.loads(out)
        code, shown, _ = await run_cli("invocations", "show", called["toolRequestId"], env=cli_env)
        assert code == 0
        invocation = json.loads(shown)
        assert invocation["state"] == "completed" and invocation["delivered"] is True
        for key in ("toolRequestId", "ok", "result", "error"):
            assert invocation.get(key) == called.get(key), key


async def test_a_call_refused_before_it_ran_has_no_id_to_look_up(
    cli_env: dict[str, str], tools_file: Path, e2e_host: HostProcess
) -> None:
    await put_tools(cli_env, tools_file)
    for tool, args in [("missing", "{}"), ("echo", '{"n": "x"}')]:
        code, out, _ = await run_cli(
            "tool-call", "--session-id", "e2e", "--tool", tool, "--args", args, env=cli_env
        )
        assert code == 0 and json.loads(out)["toolRequestId"] is None


async def test_invocations_show_of_an_unknown_id_exits_1(cli_env: dict[str, str]) -> None:
    code, out, err = await run_cli("invocations", "show", "tr_nobody", env=cli_env)
    assert code == 1 and out == ""
    assert json.loads(err)["error"]["code"] == "INVOCATION_NOT_FOUND"


async def test_tool_call_with_nothing_listening_exits_75(cli_env: dict[str, str]) -> None:
    env = dict(cli_env, TOOLMESH_INVOCATION_ADDR="127.0.0.1:1")
    code, out, _ = await run_cli(
        "tool-call", "--thread-id", "e2e", "--tool", "echo", "--timeout", "5", env=env
    )
    assert code == 75
    error = json.loads(out)["error"]
    assert error["code"] == "TRANSPORT_FAILED"
    # Where it looked, and how to start the services.
    assert "127.0.0.1:1" in error["message"] and "toolmesh up" in error["message"]
    assert error["details"]["address"] == "127.0.0.1:1"


@pytest.mark.parametrize(
    ("args", "service"),
    [(["tools", "list", "--session-id", "x"], "registry"), (["invocations", "show", "tr_x"], "invocation")],
)
async def test_other_commands_name_the_service_that_is_down(
    cli_env: dict[str, str], args: list[str], service: str
) -> None:
    env = dict(cli_env, TOOLMESH_REGISTRY_ADDR="127.0.0.1:1", TOOLMESH_INVOCATION_ADDR="127.0.0.1:1")
    code, _, err = await run_cli(*args, env=env)
    assert code == 75
    error = json.loads(err)["error"]
    assert f"the {service} service at 127.0.0.1:1" in error["message"] and "toolmesh up" in error["message"]


@pytest.mark.parametrize(
    "args",
    [
        ["tool-call", "--tool", "echo"],  # no --thread-id
        ["tool-call", "--thread-id", "has space", "--tool", "echo"],
        ["tool-call", "--thread-id", "t", "--tool", "bad/name"],
        ["tool-call", "--thread-id", "t", "--tool", "echo", "--timeout", "soon"],
        ["tool-call", "--thread-id", "t", "--tool", "echo", "--timeout", "0"],
        ["tool-call", "--thread-id", "t", "--tool", "echo", "--timeout", "-1"],
        ["tool-call", "--thread-id", "t", "--tool", "echo", "--args", '{"a": 1,}'],
        ["tool-call", "--thread-id", "t", "--tool", "echo", "--args", '{"a": NaN}'],
        ["no-such-command"],
    ],
)
async def test_usage_errors_exit_2(cli_env: dict[str, str], args: list[str]) -> None:
    code, out, _ = await run_cli(*args, env=cli_env)
    assert code == 2 and out == ""


async def test_arguments_that_are_not_json_are_refused_where_they_break(cli_env: dict[str, str]) -> None:
    code, _, err = await run_cli(
        "tool-call", "--session-id", "t", "--tool", "echo", "--args", '{"a": 1,\n "b" 2}', env=cli_env
    )
    assert code == 2 and "--args is not JSON: line 2 column 6" in err


async def test_host_with_bad_handlers_exits_2(cli_env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "broken_syntax.py").write_text("def add(args, ctx)\n    return 1\n")
    (tmp_path / "raises_on_import.py").write_text("HANDLERS = {}\nraise RuntimeError('no database')\n")
    for spec, said in [
        ("nomodule_xyz:H", "no module named nomodule_xyz"),
        ("e2e_handlers", "MODULE:ATTR"),
        ("e2e_handlers:MARKERS", "mapping of tool name to callable"),
        ("e2e_handlers:NOTHING", "has no NOTHING"),
        ("broken_syntax:HANDLERS", "broken_syntax.py line 1: expected ':'"),
        ("raises_on_import:HANDLERS", "RuntimeError: no database ("),
    ]:
        code, _, err = await run_cli(
            "host", "--thread-id", "t", "--handlers", spec, env=dict(cli_env, PYTHONPATH=str(tmp_path))
        )
        assert code == 2, spec
        # One clean line, no traceback.
        assert err.startswith("toolmesh host: cannot load handlers: ") and said in err, err
        assert err.count("\n") == 1, err


async def test_detached_host_is_serving_when_the_command_returns(
    cli_env: dict[str, str], tools_file: Path, tmp_path: Path
) -> None:
    await put_tools(cli_env, tools_file, "e2e-detached")
    env = dict(cli_env, PYTHONPATH=str(SUPPORT))
    process = await asyncio.create_subprocess_exec(
        *toolmesh_command(), "host", "--session-id", "e2e-detached", "--handlers", "e2e_handlers:HANDLERS",
        "--detach", cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err
    pid = int((tmp_path / "toolmesh-host-e2e-detached.pid").read_text())
    try:
        assert out.decode().startswith("toolmesh host: ready, serving session e2e-detached")
        assert err == b""  # its logs went to the log file
        code, called, _ = await run_cli(
            "tool-call", "--session-id", "e2e-detached", "--tool", "echo", "--args", "{}", env=cli_env
        )
        # No race: the host was connected before `host --detach` returned.
        assert code == 0 and json.loads(called)["ok"] is True
        assert "host ready" in (tmp_path / "toolmesh-host-e2e-detached.log").read_text()
    finally:
        os.kill(pid, signal.SIGTERM)
    await eventually(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), message="host kept running")


def _zombie(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    return "State:\tZ" in status


async def test_detached_host_without_a_bridge_says_where_it_looked(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    env = dict(cli_env, PYTHONPATH=str(SUPPORT), TOOLMESH_BRIDGE_ADDR="127.0.0.1:1")
    code, out, err = await run_cli(
        "host", "--session-id", "nobody", "--handlers", "e2e_handlers:HANDLERS", "--detach",
        "--connect-timeout", "1", "--log-file", str(tmp_path / "host.log"), env=env,
    )  # fmt: skip
    assert code == 75 and out == ""
    assert "bridge service at 127.0.0.1:1" in err and "toolmesh up" in err


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
        cwd=SUPPORT,
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
        cwd=SUPPORT,
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


@pytest.mark.parametrize("taken", ["registry", "bridge", "web"])
async def test_a_second_up_on_ports_in_use_says_so_and_exits_1(system: LocalSystem, taken: str) -> None:
    ports = {"registry": 0, "invocation": 0, "bridge": 0, "web": 0}  # 0: any free port
    ports[taken] = {"registry": system.registry.port, "bridge": system.bridge.port}.get(
        taken, system.bridge.web_port or 0
    )
    flags = [arg for service, port in ports.items() for arg in (f"--{service}-port", str(port))]
    code, out, err = await run_cli("up", *flags, env=dict(os.environ), timeout=30)
    assert code == 1, (out, err)
    assert f"cannot listen on 127.0.0.1:{ports[taken]}: the port is in use" in err
    assert "toolmesh is up" not in out
    # The first system is untouched: it still answers on its ports.
    async with RegistryClient(system.registry_target) as registry:
        assert (await registry.list_tools("still-here")).revision == 0


async def test_every_id_a_call_prints_can_be_looked_up(cli_env: dict[str, str], tools_file: Path) -> None:
    # No host serves this session: TOOL_HOST_UNAVAILABLE is an outcome of an invocation that was recorded.
    await put_tools(cli_env, tools_file, "e2e-nobody")
    code, out, _ = await run_cli("tool-call", "--session-id", "e2e-nobody", "--tool", "echo", env=cli_env)
    called = json.loads(out)
    assert code == 0 and called["error"]["code"] == "TOOL_HOST_UNAVAILABLE"
    code, shown, _ = await run_cli("invocations", "show", called["toolRequestId"], env=cli_env)
    assert code == 0 and json.loads(shown)["error"]["code"] == "TOOL_HOST_UNAVAILABLE"
