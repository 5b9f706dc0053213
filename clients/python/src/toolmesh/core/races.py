"""Awaiting several things at once for the first that says yes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable


async def any_true(awaitables: Iterable[Awaitable[bool]]) -> bool:
    """Whether any of `awaitables`, run at once, comes to True: True as soon as one does (the others
    are cancelled then), False once all came to False."""
    running = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        for done in asyncio.as_completed(running):
            if await done:
                return True
        return False
    finally:
        for task in running:
            task.cancel()
