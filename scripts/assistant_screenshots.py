"""PNGs of each state of the page assistant's widget, taken in Chromium, cropped to the widget.

    .venv/bin/python scripts/assistant_screenshots.py [DIR]   (default docs/assets/assistant)

The assistant's browser-test page (clients/typescript/assistant/test/page.ts: a notes page,
its tools through the stand-in WebMCP) with a scripted model (tests/support/scripted_model.py):
idle, running a tool, the confirmation dialog, an error code shown, done. Running a tool is
shown through the toolmesh() channel (the services in this process and a Python host whose
handler reports progress), so that the progress bar shows. Needs `./scripts/npm-ci` (the
bundler and playwright-core) and /usr/bin/chromium.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))

from browser_driver import BrowserDriver, build_test_page  # noqa: E402
from scripted_model import ScriptedModel, Step, answer, failure, running_model, tool_calls  # noqa: E402
from toolmesh.assembly.system import start_local_system  # noqa: E402
from toolmesh.host import ToolContext, ToolHost  # noqa: E402

PAGE = "window.toolmesh"
WIDGET = "toolmesh-assistant"


async def state(
    driver: BrowserDriver,
    model: ScriptedModel,
    name: str,
    steps: list[Step],
    *,
    text: str,
    until: str,
    query: dict[str, str] | None = None,
) -> str:
    """A new tab whose person types `text`, once `until` holds in it (nothing typed for "")."""
    model.script(*steps)
    await driver.open(name, {"model": model.url, **(query or {})}, path="/assistant")
    if text:
        await driver.eval(name, f"{PAGE}.type({json.dumps(text)})")
    if until:
        await driver.wait(name, until)
    return name


SORTED = asyncio.Event()


async def sort_notes(args: dict[str, object], ctx: ToolContext) -> dict[str, object]:
    await ctx.report_progress(2, 5, "sorting by date")
    await SORTED.wait()
    return {"sorted": True}


async def running_tool(driver: BrowserDriver, model: ScriptedModel) -> str:
    """A tab whose assistant runs a Python host's tool that has reported progress (it stays
    running until the services stop)."""
    system = await start_local_system(web_origins=[driver.origins[0]])
    host = ToolHost(system.bridge_target, "notes")
    host.on_tool("sort_notes", sort_notes, description="Sort the notes.")
    await host.start()
    tab = await state(
        driver,
        model,
        "running",
        [tool_calls(("sort_notes", {}))],
        text="Sort my notes by date",
        until=f"{PAGE}.progress()[1] === 2",
        query={"baseUrl": system.web_url, "session": "notes"},
    )
    # The page's streams first (its WatchTools stays open), then what serves them.
    STOPS.extend([lambda: driver.command("close", tab=tab), host.stop, system.stop])
    return tab


# What running_tool started, stopped at the end.
STOPS: list[Callable[[], Awaitable[object]]] = []


async def take(out: Path) -> list[Path]:
    await asyncio.to_thread(build_test_page, "assistant-test")
    driver = await BrowserDriver.start()
    taken: list[Path] = []
    try:
        async with running_model(cors=True) as model:

            async def shot(tab: str, file: str, selector: str = WIDGET) -> None:
                path = out / f"{file}.png"
                await driver.screenshot(tab, str(path), selector)
                taken.append(path)

            await shot(await state(driver, model, "idle", [], text="", until=""), "idle")
            running = await running_tool(driver, model)
            await shot(running, "running-tool")
            await driver.eval(running, f"{PAGE}.stop()")
            confirming = await state(
                driver,
                model,
                "confirming",
                [tool_calls(("clear_notes", {})), answer("I left your notes as they are.")],
                text="Clear all my notes",
                until=f"{PAGE}.dialogOpen()",
            )
            await shot(confirming, "confirmation", f"{WIDGET} dialog")
            await driver.press(confirming, "Escape")
            await shot(
                await state(
                    driver,
                    model,
                    "error",
                    [failure(500)],
                    text="What is on my list?",
                    until=f"{PAGE}.error() === 'MODEL_ERROR'",
                ),
                "error",
            )
            await shot(
                await state(
                    driver,
                    model,
                    "done",
                    [
                        tool_calls(("add_note", {"text": "buy milk"})),
                        answer("I added “buy milk” to your notes."),
                    ],
                    text="Add a note: buy milk",
                    until=f"{PAGE}.status() === 'idle' && {PAGE}.assistant.state.messages.length === 4",
                ),
                "done",
            )
    finally:
        SORTED.set()
        for stop in STOPS:
            await stop()
        await driver.stop()
    return taken


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs" / "assets" / "assistant"
    out.mkdir(parents=True, exist_ok=True)
    for path in asyncio.run(take(out)):
        print(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}  {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
