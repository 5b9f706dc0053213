"""The assistant's browser-test page (clients/typescript/assistant/test/page.ts) as the tests drive it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from browser_driver import BrowserDriver

# What the page puts on `window`.
PAGE = "window.toolmesh"
# Set to a folder to keep PNGs of the widget's states.
SHOTS = os.environ.get("TOOLMESH_ASSISTANT_SCREENSHOTS", "")


class Page:
    def __init__(self, driver: BrowserDriver, tab: str) -> None:
        self.driver, self.tab = driver, tab

    async def eval(self, expression: str) -> Any:
        return await self.driver.eval(self.tab, expression)

    async def wait(self, expression: str, timeout_ms: int = 10_000) -> None:
        await self.driver.wait(self.tab, expression, timeout_ms)

    async def send(self, text: str) -> int:
        index: int = await self.eval(f"{PAGE}.send({json.dumps(text)})")
        return index

    async def outcome(self, index: int) -> dict[str, str]:
        done = f"{PAGE}.sent[{index}].answer !== undefined || {PAGE}.sent[{index}].code !== undefined"
        await self.wait(done)
        result: dict[str, str] = await self.eval(f"{PAGE}.sent[{index}]")
        return result

    async def tool_results(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = await self.eval(f"{PAGE}.toolResults()")
        return found

    async def shot(self, name: str) -> None:
        if SHOTS:
            await self.driver.screenshot(self.tab, str(Path(SHOTS) / f"{name}.png"))
