"""The event loop of a bench process: as the services choose theirs (toolmesh.core.event_loop).

Kept apart from toolmesh so that a baseline's tree, which may not have that
module, runs the same bench processes (bench.ab, bench.host).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

ENV = "TOOLMESH_EVENT_LOOP"

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)`, on uvloop when TOOLMESH_EVENT_LOOP=uvloop."""
    if os.environ.get(ENV, "").strip() == "uvloop":
        import uvloop  # noqa: PLC0415 - only on the sides that measure it

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)
