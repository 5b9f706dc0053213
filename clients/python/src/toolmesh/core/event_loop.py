"""Which asyncio event loop a toolmesh process runs on: uvloop where it is installed, else the standard one.

The services (whose distribution depends on uvloop), `toolmesh host`, the CLI
and the bench's processes run on uvloop unless `TOOLMESH_EVENT_LOOP=asyncio`
says otherwise; where uvloop is not installed (the client without its
`uvloop` extra), on the standard loop. `TOOLMESH_EVENT_LOOP=uvloop` insists on
it. What it pays, measured by `python -m bench --only latency --ab REF
--standard-loop`: bench/README.md. grpc.aio runs on either: its poller thread
wakes the loop through a socket the loop reads, which uvloop serves as any
other. On uvloop a subprocess is started by `subprocess.Popen`, as on the
standard loop, not by libuv's fork() (toolmesh.core.spawn: a fork runs
grpcio's at-fork handlers in the child).
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
    """The factory of the loop TOOLMESH_EVENT_LOOP names (None: asyncio's own); unset, uvloop's
    when it is installed.

    Raises ValueError for an unknown name, and for uvloop named when it is not installed.
    """
    choice = os.environ.get(ENV, "").strip()
    if choice and choice not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "asyncio":
        return None
    try:
        import uvloop  # noqa: PLC0415 - an optional dependency of the client
    except ImportError:
        if not choice:
            return None
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
