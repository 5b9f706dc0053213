"""Handlers that count their side effects in files, for the ledger's tests."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from toolmesh.host import ToolContext

MARKERS = Path(os.environ.get("TOOLMESH_TEST_MARKERS", "."))


def runs(key: str) -> list[str]:
    """The tool request ids of every execution that started for `key`."""
    path = MARKERS / f"runs-{key}"
    return path.read_text().split() if path.exists() else []


async def count(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    with (MARKERS / f"runs-{args['key']}").open("a") as log:
        log.write(ctx.tool_request_id + "\n")
    if args.get("hold"):
        # Held until the test writes release-<key>: it runs in another process, a file is the signal.
        while not (MARKERS / f"release-{args['key']}").exists():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    await asyncio.sleep(float(args.get("sleep", 0)))
    return {"key": args["key"], "runs": len(runs(args["key"])), "servedBy": os.getpid()}


async def report_until_cancelled(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """Count this run, report progress every 10 ms until cancelled (or `steps` reports), and write
    the wall-clock time it saw its cancellation in cancelled-<key>."""
    with (MARKERS / f"runs-{args['key']}").open("a") as log:
        log.write(ctx.tool_request_id + "\n")
    step = 0
    try:
        while step < int(args.get("steps", 1_000_000)):
            step += 1
            await ctx.report_progress(step)
            await asyncio.sleep(0.01)
    except asyncio.CancelledError:
        (MARKERS / f"cancelled-{args['key']}").write_text(f"{time.time()} {ctx.cancellation.reason}")
        raise
    return {"key": args["key"], "steps": step}


HANDLERS = {
    "count": count,
    "count_short": count,
    "count_read_only": count,
    "report_until_cancelled": report_until_cancelled,
}
