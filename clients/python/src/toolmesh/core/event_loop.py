"""Which asyncio event loop a toolmesh process runs on: the standard one, or uvloop on request.

`TOOLMESH_EVENT_LOOP=uvloop` (with the `uvloop` extra installed) runs the
services, `toolmesh host` and the bench's processes on uvloop; unset or
`asyncio`, on the standard loop. Opt-in: `python -m bench --only latency --ab
REF --uvloop` measures what it pays on this machine (bench/README.md).
grpc.aio runs on either: its poller thread wakes the loop through a socket
the loop reads, which uvloop serves as any other.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

ENV = "TOOLMESH_EVENT_LOOP"
CHOICES = ("asyncio", "uvloop")

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of the loop TOOLMESH_EVENT_LOOP names (None: asyncio's own).

    Raises ValueError for an unknown name, and for uvloop when it is not installed.
    """
    choice = os.environ.get(ENV, "").strip() or "asyncio"
    if choice not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "asyncio":
        return None
    try:
        import uvloop  # noqa: PLC0415 - an optional dependency, imported only when asked for
    except ImportError:
        raise ValueError(f"{ENV}=uvloop needs the uvloop package (pip install 'toolmesh[uvloop]')") from None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T], factory: Callable[[], asyncio.AbstractEventLoop] | None) -> T:
    """`asyncio.run(main)` on the loop `factory` makes (None: asyncio's own; see loop_factory)."""
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
