"""Handlers served by the test host process (`toolmesh host --handlers e2e_handlers:HANDLERS`)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from toolmesh.core.limits import MAX_RESULT_BYTES
from toolmesh.host import ToolContext

MARKERS = Path(os.environ.get("TOOLMESH_TEST_MARKERS", "."))


def echo(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return {"echo": args, "turnId": ctx.turn_id, "toolRequestId": ctx.tool_request_id}


async def domain_fail(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return {
        "error": {
            "code": "NO_ACTIVE_SELECTION",
            "message": "Select text before using replace_selection.",
            "details": {"documentId": "doc-7"},
            "retryable": True,
        }
    }


def boom(args: dict[str, Any], ctx: ToolContext) -> None:
    raise RuntimeError("database password is hunter2")


async def slow_async(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    (MARKERS / f"started-{args['marker']}").touch()
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        (MARKERS / f"cancelled-{args['marker']}").write_text(ctx.cancellation.reason or "")
        raise
    return {"finished": True}


def slow_sync(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    time.sleep(float(args["seconds"]))
    (MARKERS / f"sync-finished-{args['marker']}").write_text(str(ctx.cancelled))
    return {"late": True}


class Opaque:
    pass


def not_json(args: dict[str, Any], ctx: ToolContext) -> Any:
    cycle: list[Any] = []
    cycle.append(cycle)
    values = {
        "bytes": b"raw",
        "set": {1, 2},
        "nan": float("nan"),
        "cycle": cycle,
        "object": Opaque(),
        "function": lambda: 1,
    }
    return {"value": values[args["kind"]]}


def too_large(args: dict[str, Any], ctx: ToolContext) -> str:
    return "x" * (MAX_RESULT_BYTES + 1)


HANDLERS = {
    "echo": echo,
    # The same handler, behind a tool with an outputSchema.
    "checked": echo,
    "domain_fail": domain_fail,
    "boom": boom,
    "slow_async": slow_async,
    "slow_sync": slow_sync,
    "not_json": not_json,
    "too_large": too_large,
}
