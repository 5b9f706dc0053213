"""Subprocesses of an asyncio loop started by `subprocess.Popen`: vfork or posix_spawn, then exec.

uvloop starts a subprocess with libuv's `uv_spawn`, which on Linux calls
fork(). fork() runs the process's pthread_atfork handlers in the child, and
grpcio's (its wheels are built with fork support on) start gRPC's EventEngine
threads again there: in a process whose grpc.aio channels or servers are
busy, those threads run work copied halfway from the parent's threads until
the child's exec ends them, and now and then one crashes the child first
(SIGSEGV in cygrpc; its faulthandler report names the parent's frames, the
`create_subprocess_exec` it was forked from). CPython's `subprocess.Popen`
spawns with vfork or posix_spawn, which run no at-fork handler and no Python
in the child, as the standard loop does: `subprocess_exec` and
`subprocess_shell` here start a process that way on any loop, its pipes
connected to the loop (`connect_read_pipe`, `connect_write_pipe`) and its
exit heard through a pidfd the loop reads. `toolmesh.core.event_loop` gives
uvloop's loop these two, so `asyncio.create_subprocess_exec` and what is
built on them (anyio's `open_process`, the MCP SDK's stdio client) start
processes so.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from asyncio import base_subprocess
from collections.abc import Callable
from typing import Any

# What the standard loop's subprocess_exec and subprocess_shell refuse too (asyncio.base_events).
_REFUSED = {"universal_newlines": False, "bufsize": 0, "encoding": None, "errors": None, "text": None}


def available() -> bool:
    """Whether this platform has what `subprocess_exec` needs (a pidfd: Linux 5.3 or later)."""
    return hasattr(os, "pidfd_open")


class _PopenTransport(base_subprocess.BaseSubprocessTransport):
    """asyncio's own subprocess transport over a `subprocess.Popen` (as its Unix loop makes one)."""

    def _start(  # type: ignore[override]  # noqa: PLR0917 - asyncio calls it so
        self,
        args: list[Any],
        shell: bool,
        stdin: Any,
        stdout: Any,
        stderr: Any,
        bufsize: int,
        **kwargs: Any,
    ) -> None:
        self._proc = subprocess.Popen(
            args, shell=shell, stdin=stdin, stdout=stdout, stderr=stderr, bufsize=bufsize, **kwargs
        )


def _hear_exit(loop: asyncio.AbstractEventLoop, transport: _PopenTransport) -> None:
    """Tell the transport its process's exit status once the process has exited (its pidfd reads)."""
    pid = transport.get_pid()
    assert pid is not None
    pidfd = os.pidfd_open(pid)

    def exited() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        try:
            _, status = os.waitpid(pid, os.WNOHANG)
            returncode = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            # Reaped already, by Popen.poll() (the transport closing): its returncode is the status.
            popen = transport._proc
            returncode = 255 if popen is None or popen.returncode is None else popen.returncode
        transport._process_exited(returncode)

    loop.add_reader(pidfd, exited)


async def subprocess_exec(
    loop: asyncio.AbstractEventLoop,
    protocol_factory: Callable[[], asyncio.SubprocessProtocol],
    program: Any,
    *args: Any,
    **kwargs: Any,
) -> tuple[asyncio.SubprocessTransport, asyncio.SubprocessProtocol]:
    """`loop.subprocess_exec`, the process started by `subprocess.Popen` (see the module)."""
    if kwargs.pop("shell", False):
        raise ValueError("shell must be False")
    return await _start(loop, protocol_factory, [program, *args], False, **kwargs)


async def subprocess_shell(
    loop: asyncio.AbstractEventLoop,
    protocol_factory: Callable[[], asyncio.SubprocessProtocol],
    cmd: str | bytes,
    **kwargs: Any,
) -> tuple[asyncio.SubprocessTransport, asyncio.SubprocessProtocol]:
    """`loop.subprocess_shell`, the shell started by `subprocess.Popen` (see the module)."""
    if not isinstance(cmd, (bytes, str)):
        raise ValueError("cmd must be a string")
    if not kwargs.pop("shell", True):
        raise ValueError("shell must be True")
    return await _start(loop, protocol_factory, cmd, True, **kwargs)


async def _start(
    loop: asyncio.AbstractEventLoop,
    protocol_factory: Callable[[], asyncio.SubprocessProtocol],
    args: Any,
    shell: bool,
    *,
    stdin: Any = subprocess.PIPE,
    stdout: Any = subprocess.PIPE,
    stderr: Any = subprocess.PIPE,
    **kwargs: Any,
) -> tuple[asyncio.SubprocessTransport, asyncio.SubprocessProtocol]:
    for name, allowed in _REFUSED.items():
        if kwargs.pop(name, allowed) != allowed:
            raise ValueError(f"{name} must be {allowed!r}")
    protocol = protocol_factory()
    waiter = loop.create_future()
    transport = _PopenTransport(
        loop, protocol, args, shell, stdin, stdout, stderr, 0, waiter=waiter, **kwargs
    )
    _hear_exit(loop, transport)
    try:
        await waiter
    except BaseException:
        transport.close()
        await transport._wait()
        raise
    return transport, protocol
