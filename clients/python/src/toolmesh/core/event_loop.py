"""Which asyncio event loop a toolmesh process runs on: the standard one, or uvloop on request.

`TOOLMESH_EVENT_LOOP=uvloop` (with the `uvloop` extra installed) runs the
services, `toolmesh host` and the bench's processes on uvloop; unset or
`asyncio`, on the standard loop. Opt-in: `python -m bench --only latency --ab
REF --uvloop` measures what it pays on this machine (bench/README.md).
grpc.aio runs on either: its poller thread wakes the loop through a socket
the loop reads, which uvloop serves as any other. On uvloop a subprocess is
started by `subprocess.Popen`, as on the standard loop, not by libuv's fork()
(toolmesh.core.spawn: a fork runs grpcio's at-fork handlers in the child).
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
    from toolmesh.core import spawn  # noqa: PLC0415 - only with uvloop

    if not spawn.available():
        # No pidfds (not Linux): uvloop spawns as it does (on macOS libuv uses posix_spawn).
        plain: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
        return plain

    class Loop(uvloop.Loop):
        """uvloop's loop, its subprocesses started by subprocess.Popen (toolmesh.core.spawn)."""

        async def subprocess_exec(  # type: ignore[override]
            self, protocol_factory: Callable[[], asyncio.SubprocessProtocol], *args: Any, **kwargs: Any
        ) -> tuple[asyncio.SubprocessTransport, asyncio.SubprocessProtocol]:
            return await spawn.subprocess_exec(self, protocol_factory, *args, **kwargs)

        async def subprocess_shell(  # type: ignore[override]
            self, protocol_factory: Callable[[], asyncio.SubprocessProtocol], cmd: str | bytes, **kwargs: Any
        ) -> tuple[asyncio.SubprocessTransport, asyncio.SubprocessProtocol]:
            return await spawn.subprocess_shell(self, protocol_factory, cmd, **kwargs)

    return Loop


def run(main: Coroutine[Any, Any, T], factory: Callable[[], asyncio.AbstractEventLoop] | None) -> T:
    """`asyncio.run(main)` on the loop `factory` makes (None: asyncio's own; see loop_factory)."""
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
