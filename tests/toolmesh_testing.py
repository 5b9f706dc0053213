"""Helpers for tests that run real `toolmesh host` processes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent


@dataclass
class HostProcess:
    process: asyncio.subprocess.Process
    stderr_lines: list[str] = field(default_factory=list)
    _reader: asyncio.Task[None] | None = None

    async def wait_for_line(self, needle: str, timeout: float = 10.0) -> str:
        async def scan() -> str:
            seen = 0
            while True:
                for line in self.stderr_lines[seen:]:
                    if needle in line:
                        return line
                seen = len(self.stderr_lines)
                if self.process.returncode is not None and self._reader is not None and self._reader.done():
                    raise AssertionError(f"host exited before printing {needle!r}: {self.stderr_lines}")
                await asyncio.sleep(0.02)

        return await asyncio.wait_for(scan(), timeout)

    async def stop(self) -> int:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        if self._reader is not None:
            await self._reader
        assert self.process.returncode is not None
        return self.process.returncode

    def kill(self) -> None:
        self.process.kill()


async def start_host_process(
    bridge_target: str, thread_id: str, handlers: str, marker_dir: Path
) -> HostProcess:
    env = dict(os.environ, TOOLMESH_TEST_MARKERS=str(marker_dir))
    process = await asyncio.create_subprocess_exec(
        *toolmesh_command(),
        "host",
        "--thread-id",
        thread_id,
        "--handlers",
        handlers,
        "--bridge",
        bridge_target,
        cwd=TESTS,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    host = HostProcess(process)

    async def read() -> None:
        assert process.stderr is not None
        async for line in process.stderr:
            host.stderr_lines.append(line.decode(errors="replace"))

    host._reader = asyncio.create_task(read())
    await host.wait_for_line("toolmesh host: connected", timeout=20)
    return host


def toolmesh_command() -> list[str]:
    return [sys.executable, "-m", "toolmesh.cli.main"]


async def run_cli(*args: str, env: dict[str, str], timeout: float = 30.0) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *toolmesh_command(),
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=TESTS,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()
