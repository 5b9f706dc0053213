"""@toolmesh/assistant in one run: `python -m bench.web_assistant`.

- Bundle size, minified and gzipped by esbuild in the same run: @toolmesh/host
  alone (`size`), @toolmesh/host with @toolmesh/assistant and its widget
  (`assistant-size`; the difference is what the assistant adds on top of the
  host, target under 30 KB gzipped), and the assistant with its widget alone.
- A turn's overhead in Debian's Chromium: per call, `executeTool` of a no-op
  WebMCP tool called directly, against an `Assistant.send()` turn that makes
  that one call (an in-page model that answers at once, so no network: the
  difference is the assistant's own work: planning, offering, checking the
  arguments and the revision, recording the state).
- Page memory over 1,000 turns with the widget mounted (each turn one tool
  call and an answer, an in-page model): the JS heap in use after a full GC
  (CDP HeapProfiler.collectGarbage, Runtime.getHeapUsage), the DOM nodes and JS
  event listeners (Memory.getDOMCounters) after 100, 500 and 1,000 turns, for
  the default conversation bound (maxMessages 200) against an unbounded
  conversation (maxMessages Infinity) as the baseline, each in a tab of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from browser_driver import TYPESCRIPT, BrowserDriver, build_test_page

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_GZIPPED = 30 * 1024


def bundle_size(which: str) -> dict[str, int]:
    out = subprocess.run(
        ["node", "scripts/bundle.mjs", which], cwd=TYPESCRIPT, check=True, capture_output=True, text=True
    ).stdout
    size: dict[str, int] = json.loads(out)
    return size


async def memory(driver: BrowserDriver, tab: str, max_messages: str, turns: int) -> dict[str, int]:
    """After 100 turns, half of `turns` and all of them, in one new tab: the JS heap in use, the
    DOM nodes and JS event listeners (each after a full GC), and the widget's items."""
    await driver.open(tab, {}, path="/assistant")
    figures: dict[str, int] = {}
    done = 0
    for mark in (100, turns // 2, turns):
        items = await driver.eval(tab, f"window.toolmesh.memoryTurns({mark - done}, {max_messages})")
        counters = await driver.heap(tab)
        done = mark
        figures |= {
            f"heapAfter{mark}Bytes": counters["heapBytes"],
            f"domNodesAfter{mark}": counters["nodes"],
            f"listenersAfter{mark}": counters["listeners"],
            f"widgetItemsAfter{mark}": items,
        }
    await driver.command("close", tab=tab)
    return figures | {
        "growth100ToEndBytes": figures[f"heapAfter{turns}Bytes"] - figures["heapAfter100Bytes"],
        "growthSecondHalfBytes": figures[f"heapAfter{turns}Bytes"] - figures[f"heapAfter{turns // 2}Bytes"],
    }


async def run(calls: int, turns: int = 1000) -> dict[str, Any]:
    if turns < 200:
        raise ValueError("the memory figures need at least 200 turns (after 100, half of them, all)")
    host, both, alone = (bundle_size(w) for w in ("size", "assistant-size", "assistant-alone-size"))
    await asyncio.to_thread(build_test_page, "assistant-test")
    driver = await BrowserDriver.start()
    try:
        await driver.open("bench", {}, path="/assistant")
        await driver.eval("bench", "window.toolmesh.bench(50)")  # warm-up
        turn = await driver.eval("bench", f"window.toolmesh.bench({calls})")
        bounded = await memory(driver, "memory-bounded", "null", turns)
        unbounded = await memory(driver, "memory-unbounded", "Infinity", turns)
    finally:
        await driver.stop()
    on_top = both["gzippedBytes"] - host["gzippedBytes"]
    return {
        "host": host,
        "hostWithAssistant": both,
        "assistantAlone": alone,
        "assistantOnTopOfHostGzippedBytes": on_top,
        "targetGzippedBytes": TARGET_GZIPPED,
        "withinTarget": on_top < TARGET_GZIPPED,
        "calls": calls,
        "directExecuteToolMs": turn["directMs"],
        "assistantTurnMs": turn["turnMs"],
        "overheadPerTurnMs": turn["turnMs"] - turn["directMs"],
        "turns": turns,
        "memoryDefaultBound": bounded,
        "memoryUnboundedBaseline": unbounded,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--turns", type=int, default=1000, help="turns of the memory figures (200 or more)")
    args = parser.parse_args()
    figures = asyncio.run(run(args.calls, args.turns))
    for name, value in figures.items():
        print(f"{name:36} {value}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"web_assistant-{int(time.time())}.json").write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
