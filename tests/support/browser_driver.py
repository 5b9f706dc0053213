"""A real Chromium driven by playwright-core (clients/typescript/test/browser/driver.mjs).

The driver serves the browser tests' page (built from the TypeScript package by
esbuild) on two origins and answers commands: open a tab, evaluate, wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TYPESCRIPT = Path(__file__).resolve().parents[2] / "clients" / "typescript"


def build_test_page(which: str = "test") -> None:
    """Bundle a test page from the package's sources (fails if `npm ci` was not run):
    `test` (@toolmesh/host's) or `assistant-test` (@toolmesh/assistant's)."""
    subprocess.run(["node", "scripts/bundle.mjs", which], cwd=TYPESCRIPT, check=True)


@dataclass
class BrowserDriver:
    process: asyncio.subprocess.Process
    # The page's origins: the first one is allowed by the bridge under test, the second is not.
    origins: list[str]
    _replies: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _reader: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls) -> BrowserDriver:
        process = await asyncio.create_subprocess_exec(
            "node",
            "test/browser/driver.mjs",
            cwd=TYPESCRIPT,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert process.stdout is not None
        first = await asyncio.wait_for(process.stdout.readline(), 30)
        if not first:
            raise AssertionError("the browser driver exited before serving its page")
        driver = cls(process, json.loads(first)["origins"])
        driver._reader = asyncio.create_task(driver._read())
        return driver

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            reply = json.loads(line)
            future = self._replies.pop(reply["id"], None)
            if future is None or future.done():
                continue
            if reply["ok"]:
                future.set_result(reply["value"])
            else:
                future.set_exception(AssertionError(f"browser: {reply['error']}"))
        for future in self._replies.values():
            if not future.done():
                future.set_exception(AssertionError("the browser driver exited"))

    async def command(self, op: str, **fields: Any) -> Any:
        assert self.process.stdin is not None
        command_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[command_id] = future
        self.process.stdin.write(json.dumps({"id": command_id, "op": op, **fields}).encode() + b"\n")
        await self.process.stdin.drain()
        return await future

    async def open(
        self, tab: str, query: dict[str, str], *, origin: int = 0, webmcp: bool = False, path: str = "/"
    ) -> dict[str, Any]:
        """Load a test page in a new tab: `/` starts a ToolHost from `query` (session, baseUrl, ...),
        `/assistant` an Assistant and its widget (clients/typescript/assistant/test/page.ts)."""
        opened: dict[str, Any] = await self.command(
            "open", tab=tab, origin=origin, webmcp=webmcp, query=query, path=path
        )
        return opened

    async def press(self, tab: str, key: str) -> None:
        """A real key press (playwright's keyboard) on whatever has the focus."""
        await self.command("press", tab=tab, key=key)

    async def axe(self, tab: str) -> list[dict[str, Any]]:
        """axe-core's violations on the tab's page, as it is now."""
        found: list[dict[str, Any]] = await self.command("axe", tab=tab)
        return found

    async def screenshot(self, tab: str, path: str, selector: str | None = None) -> None:
        """A PNG of the tab's page, or of the element `selector` finds (cropped to it)."""
        await self.command("screenshot", tab=tab, path=path, selector=selector)

    async def heap(self, tab: str) -> dict[str, int]:
        """After a full garbage collection (CDP): the tab's JS heap in use (`heapBytes`), its DOM
        nodes (`nodes`) and JS event listeners (`listeners`)."""
        counters: dict[str, int] = await self.command("heap", tab=tab)
        return counters

    async def eval(self, tab: str, expression: str) -> Any:
        return await self.command("eval", tab=tab, expression=expression)

    async def wait(self, tab: str, expression: str, timeout_ms: int = 10_000) -> None:
        await self.command("wait", tab=tab, expression=expression, timeoutMs=timeout_ms)

    async def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 20)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await self._reader
