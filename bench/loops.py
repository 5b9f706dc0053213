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
    """`asyncio.run(main)` on uvloop, unless TOOLMESH_EVENT_LOOP=asyncio or uvloop is not installed
    (the rule of toolmesh.core.event_loop, so that the floor runs on the loop the services do)."""
    if os.environ.get(ENV, "").strip() != "asyncio":
        try:
            import uvloop  # noqa: PLC0415 - as the services, where it is installed
        except ImportError:
            pass
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(main)
    return asyncio.run(main)
