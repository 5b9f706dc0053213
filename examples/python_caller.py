"""A caller: calls `greet` in the session `examples` and prints what happened.

    .venv/bin/python examples/python_caller.py [NAME]

It calls the invocation service at $TOOLMESH_INVOCATION_ADDR (default
127.0.0.1:7402); examples/python_host.py serves the tool. Exit 0 with the result,
1 with the tool's or toolmesh's error, 75 when no outcome arrived (the same call
may then be sent again: it joins or replays the one that ran).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from toolmesh.client import InvocationClient

INVOCATION = os.environ.get("TOOLMESH_INVOCATION_ADDR", "127.0.0.1:7402")


async def main(name: str) -> int:
    async with InvocationClient(INVOCATION) as client:
        result = await client.invoke("examples", "greet", {"name": name}, turn_id="example-1", timeout=10)
    if result.outcome is None:
        print(f"no outcome ({result.code}): an exact retry is safe", file=sys.stderr)
        return 75
    printed = result.to_json()
    if result.outcome.ok:
        print(json.dumps(printed["result"]))
        return 0
    print(json.dumps(printed["error"]), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "Ada")))
