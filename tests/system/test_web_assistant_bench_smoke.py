"""The page assistant's bench and screenshot script on tiny sizes, so that they cannot rot."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.web_assistant import run
from toolmesh_testing import run_to_end

pytestmark = pytest.mark.integration

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(240)
async def test_the_bench_reports_memory_for_both_bounds() -> None:
    figures = await run(10, 200)
    assert figures["withinTarget"]
    bounded, unbounded = figures["memoryDefaultBound"], figures["memoryUnboundedBaseline"]
    # Four messages a turn: the default bound keeps 200 of them, the baseline every one.
    assert bounded["widgetItemsAfter200"] == 200 and unbounded["widgetItemsAfter200"] == 800
    assert bounded["domNodesAfter200"] < unbounded["domNodesAfter200"]
    assert all(value > 0 for key, value in bounded.items() if key.startswith("heapAfter"))


@pytest.mark.timeout(240)
def test_the_screenshot_script_takes_each_state(tmp_path: Path) -> None:
    run_to_end("scripts/assistant_screenshots.py", str(tmp_path))
    shots = {path.stem: path.read_bytes() for path in tmp_path.glob("*.png")}
    assert set(shots) == {"idle", "running-tool", "confirmation", "error", "done"}
    assert all(shot.startswith(PNG) for shot in shots.values())
