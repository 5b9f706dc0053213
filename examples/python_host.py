"""A handler host: serves the tool `greet` for the session `examples` until Ctrl-C.

    .venv/bin/python examples/python_host.py

It connects to the bridge at $TOOLMESH_BRIDGE_ADDR (default 127.0.0.1:7403) and
declares the tool itself, so no `toolmesh tools put` is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

from toolmesh.core.tools import ToolAnnotations
from toolmesh.host import ToolContext, ToolHost

BRIDGE = os.environ.get("TOOLMESH_BRIDGE_ADDR", "127.0.0.1:7403")


def greet(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """Greet someone by name; a domain error when the name is blank."""
    name = args["name"].strip()
    if not name:
        return {"error": {"code": "NO_NAME", "message": "Say whom to greet.", "retryable": False}}
    return {"greeting": f"Hello, {name}!"}


async def main() -> None:
    host = ToolHost(BRIDGE, session_id="examples")
    host.on_tool(
        "greet",
        greet,
        description="Greet someone by name.",
        input_schema={
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
        },
        annotations=ToolAnnotations(read_only=True),
    )
    async with host:  # returns once connected; serves until the block ends
        print(f"serving session examples (greet) through {BRIDGE}", flush=True)
        await asyncio.Event().wait()  # until Ctrl-C cancels it


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
