"""`toolmesh chat` driven once through a pseudo-terminal, against real services and a scripted model."""

from __future__ import annotations

import asyncio
import os
import pty
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from scripted_model import Hold, ScriptedModel, answer, failure, running_model, tool_calls
from toolmesh.assembly.system import LocalSystem
from toolmesh.client import RegistryClient
from toolmesh.core.tools import ToolAnnotations, ToolSpec
from toolmesh_testing import SUPPORT, HostProcess, start_host_process, toolmesh_command

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

THREAD = "assistant-cli"
TOOLS = [
    ToolSpec("echo", "Echo the arguments", '{"type":"object"}'),
    ToolSpec(
        "delete_note",
        "Delete a note",
        '{"type":"object","properties":{"id":{"type":"string"}},"required":["id"]}',
        annotations=ToolAnnotations(requires_confirmation=True),
    ),
]


class Terminal:
    """The controlling side of a pseudo-terminal: what the program printed, and typing into it."""

    def __init__(self, master: int) -> None:
        self._master = master
        self.output = ""
        self._position = 0
        self._changed = asyncio.Event()
        self.closed = False
        asyncio.get_running_loop().add_reader(master, self._read)

    def _read(self) -> None:
        try:
            data = os.read(self._master, 4096)
        except OSError:  # EIO: every copy of the other side is closed
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(self._master)
            self.closed = True
        self.output += data.decode(errors="replace")
        self._changed.set()

    async def expect(self, text: str, timeout: float = 10.0) -> None:
        """Wait for `text` after what was expected before."""

        async def scan() -> None:
            while (found := self.output.find(text, self._position)) < 0:
                if self.closed:
                    raise AssertionError(f"the program ended before printing {text!r}")
                self._changed.clear()
                await self._changed.wait()
            self._position = found + len(text)

        try:
            await asyncio.wait_for(scan(), timeout)
        except TimeoutError:
            raise AssertionError(f"no {text!r} in {self.output[self._position :]!r}") from None

    def type(self, text: str) -> None:
        os.write(self._master, text.encode())

    def close(self) -> None:
        if not self.closed:
            asyncio.get_running_loop().remove_reader(self._master)
        os.close(self._master)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def model() -> AsyncIterator[ScriptedModel]:
    async with running_model() as server:
        yield server


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def host(system: LocalSystem, marker_dir: Path) -> AsyncIterator[HostProcess]:
    async with RegistryClient(system.registry_target) as registry:
        await registry.put_tools(THREAD, TOOLS)
    process = await start_host_process(
        system.bridge_target, THREAD, "assistant_handlers:HANDLERS", marker_dir
    )
    yield process
    await process.stop()


async def test_chat_in_a_terminal(
    host: HostProcess, model: ScriptedModel, cli_env: dict[str, str], marker_dir: Path
) -> None:
    master, follower = pty.openpty()
    env = dict(cli_env, TOOLMESH_MODEL_URL=model.url, TOOLMESH_MODEL="scripted")
    process = await asyncio.create_subprocess_exec(
        *toolmesh_command(),
        "chat",
        "--thread-id",
        THREAD,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env=env,
        cwd=SUPPORT,
    )
    os.close(follower)
    terminal = Terminal(master)
    try:
        await terminal.expect(f"session {THREAD}, model scripted")
        await terminal.expect("you> ")

        # Tool calls as they happen, a confirmation prompt, the answer.
        model.script(tool_calls(("echo", {"n": 5}), ("delete_note", {"id": "cli1"})), answer("Deleted cli1."))
        terminal.type("delete cli1\n")
        await terminal.expect('→ echo {"n":5}')
        await terminal.expect('→ delete_note {"id":"cli1"}')
        # The result itself, as a preview.
        await terminal.expect('← echo: ok {"echo":{"n":5}')
        await terminal.expect("Run it? [y/N] ")
        terminal.type("y\n")
        await terminal.expect("← delete_note: ok")
        await terminal.expect("assistant> Deleted cli1.")
        assert (marker_dir / "deleted-cli1").exists()

        # Ctrl-C stops a running turn; the human message of ABORTED is shown.
        hold = Hold()
        model.script(hold)
        await terminal.expect("you> ")
        terminal.type("wait for it\n")
        await asyncio.wait_for(hold.entered.wait(), 10)
        process.send_signal(signal.SIGINT)
        await terminal.expect("! The assistant stopped because it was cancelled. (ABORTED)")

        # A failing model: its human message, and the session goes on.
        model.script(failure(500))
        await terminal.expect("you> ")
        terminal.type("again\n")
        # While it waits, the terminal shows that it works.
        await terminal.expect("working… (Ctrl-C stops)")
        # What lies behind the human message: here the endpoint's HTTP status.
        await terminal.expect(
            "! The assistant's model failed or gave an answer it could not use. (MODEL_ERROR): "
            f"The model endpoint {model.url}"
        )
        await terminal.expect("answered HTTP 500.")

        await terminal.expect("you> ")
        terminal.type("\x04")  # Ctrl-D: end of input
        assert await asyncio.wait_for(process.wait(), 10) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        terminal.close()


async def test_chat_says_which_service_is_unreachable(cli_env: dict[str, str], model: ScriptedModel) -> None:
    master, follower = pty.openpty()
    env = dict(
        cli_env, TOOLMESH_MODEL_URL=model.url, TOOLMESH_MODEL="scripted", TOOLMESH_REGISTRY_ADDR="127.0.0.1:1"
    )
    process = await asyncio.create_subprocess_exec(
        *toolmesh_command(), "chat", "--session-id", THREAD,
        stdin=follower, stdout=follower, stderr=follower, env=env, cwd=SUPPORT,
    )  # fmt: skip
    os.close(follower)
    terminal = Terminal(master)
    try:
        await terminal.expect("you> ")
        terminal.type("hello\n")
        await terminal.expect("(DISCOVERY_FAILED): Nothing answered at the registry address 127.0.0.1:1")
        await terminal.expect("you> ")
        terminal.type("\x04")
        assert await asyncio.wait_for(process.wait(), 10) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        terminal.close()
