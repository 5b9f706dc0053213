"""Handlers served by the assistant tests' host process (`assistant_handlers:HANDLERS`)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from toolmesh.host import ToolContext

MARKERS = Path(os.environ.get("TOOLMESH_TEST_MARKERS", "."))


def echo(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return {"echo": args, "turnId": ctx.turn_id}


def boom(args: dict[str, Any], ctx: ToolContext) -> None:
    raise RuntimeError("the vault code is 0451")


def locked(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return {"error": {"code": "NOTE_LOCKED", "message": "The note is locked.", "details": {"id": "n1"}}}


async def slow(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    await asyncio.sleep(30)
    return {}


def big(args: dict[str, Any], ctx: ToolContext) -> Any:
    size = int(args["size"])
    return "y" * size if args.get("as_text") else {"blob": "z" * size}


def delete_note(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    (MARKERS / f"deleted-{args['id']}").write_text(ctx.turn_id)
    return {"deleted": args["id"]}


HANDLERS = {
    "echo": echo,
    "boom": boom,
    "locked": locked,
    "slow": slow,
    "big": big,
    "delete_note": delete_note,
}
