"""The README and the docs as a user meets them: the rendered error tables agree with the code, the
README's walkthrough and the Python host guide's program run as they are against `toolmesh up`."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import pytest
import pytest_asyncio

from toolmesh_testing import eventually, run_cli, toolmesh_command

pytestmark = pytest.mark.integration
in_module_loop = pytest.mark.asyncio(loop_scope="module")

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PYTHON_HOST_GUIDE = (ROOT / "docs" / "guides" / "python-host.md").read_text()
# The addresses the README shows (the defaults); the tests' system listens elsewhere.
DEFAULT_BRIDGE = "127.0.0.1:7403"


def test_docs_error_tables_are_rendered_from_the_tables() -> None:
    script = ROOT / "scripts" / "render_error_table.py"
    result = subprocess.run(
        [sys.executable, str(script), "--check"], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def block_after(heading: str, language: str, document: str = README) -> str:
    """The first ```language block of the document (the README unless told) after `heading`."""
    document = f"\n{document}"
    section = document[document.index(f"\n{heading}\n") :]
    start = section.index(f"```{language}\n") + len(language) + 4
    return section[start : section.index("\n```", start) + 1]


def expected_output(block: str) -> list[re.Pattern[str]]:
    """What the block says its commands print: its `# ` lines, `…` standing for anything."""
    lines = [line[2:] for line in block.splitlines() if line.startswith("# ")]
    return [re.compile(".*".join(map(re.escape, line.split("…")))) for line in lines]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def up() -> AsyncIterator[dict[str, str]]:
    """`toolmesh up` on free ports, as ./scripts/up runs it: the addresses it printed."""
    process = await asyncio.create_subprocess_exec(
        *toolmesh_command(), "up", "--registry-port", "0", "--invocation-port", "0", "--bridge-port", "0",
        "--web-port", "0", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert process.stdout is not None
    lines = [(await asyncio.wait_for(process.stdout.readline(), 20)).decode() for _ in range(4)]
    addresses = dict(line.split() for line in lines[1:4])
    yield {f"TOOLMESH_{service.upper()}_ADDR": target for service, target in addresses.items()}
    process.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(process.wait(), 15) == 0


async def paste(block: str, folder: Path, env: dict[str, str]) -> list[str]:
    """Run the block in `folder` (a fresh clone's top: it has the .venv), as pasted; its stdout lines."""
    (folder / ".venv").symlink_to(ROOT / ".venv")
    process = await asyncio.create_subprocess_exec(
        "bash", "-e", "-c", block, cwd=folder, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    # Only the commands' own output: the host's logs went to its log file.
    assert err == b"", err.decode()
    return out.decode().splitlines()


# Three pastes, each starting about eight CLI processes: on a loaded 2-core machine
# their start-up alone can pass the default 60 s.
@pytest.mark.timeout(240)
@in_module_loop
async def test_the_first_tool_call_works_pasted_whole_every_time(up: dict[str, str], tmp_path: Path) -> None:
    block = block_after("## A first tool call", "sh")
    bridge = up["TOOLMESH_BRIDGE_ADDR"]
    expected = expected_output(block.replace(DEFAULT_BRIDGE, bridge))
    env = dict(os.environ, **up)
    for attempt in range(3):
        folder = tmp_path / f"clone-{attempt}"
        folder.mkdir()
        printed = await paste(block, folder, env)
        assert len(printed) == len(expected), printed
        for line, pattern in zip(printed, expected, strict=True):
            # On later pastes the session's list has moved on.
            seen = re.sub(r'"revision": \d+', '"revision": 1', line) if attempt else line
            assert pattern.fullmatch(seen), (line, pattern.pattern)
        # `kill` stopped the host it started: the next paste starts its own.
        pid = int((folder / "toolmesh-host-demo.pid").read_text())
        await eventually(partial(_gone, pid), message=f"host {pid} still runs")


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status


@in_module_loop
async def test_the_python_host_program_serves_until_ctrl_c(up: dict[str, str], tmp_path: Path) -> None:
    program = block_after("# Serving tools from Python", "python", PYTHON_HOST_GUIDE)
    bridge = up["TOOLMESH_BRIDGE_ADDR"]
    (tmp_path / "notes_host.py").write_text(program.replace(DEFAULT_BRIDGE, bridge))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "notes_host.py", cwd=tmp_path, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None
    try:
        line = await asyncio.wait_for(process.stdout.readline(), 20)
        assert line.decode().startswith("serving session demo")
        env = dict(os.environ, **up)

        async def added() -> dict[str, object] | None:
            # Its tools are declared once it is connected.
            code, out, _ = await run_cli(
                "tool-call",
                "--session-id",
                "demo",
                "--tool",
                "add_note",
                "--args",
                '{"text": "milk"}',
                env=env,
            )
            result: dict[str, object] = json.loads(out)
            return result if code == 0 and result["ok"] else None

        assert (await eventually(added, timeout=20))["result"] == {"id": 1}
        code, out, _ = await run_cli("tool-call", "--session-id", "demo", "--tool", "list_notes", env=env)
        assert code == 0 and json.loads(out)["result"] == {"notes": ["milk"]}
        # Still serving: the program did not end after connecting.
        assert process.returncode is None
    finally:
        process.send_signal(signal.SIGINT)
        await asyncio.wait_for(process.wait(), 10)
