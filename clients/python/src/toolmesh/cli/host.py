"""`toolmesh host`: serve a thread's tools from a Python module's handlers."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from toolmesh.cli import access
from toolmesh.cli.output import EXIT_USAGE
from toolmesh.client.config import address
from toolmesh.core.errors import ToolmeshError
from toolmesh.host import HostError, ToolHost

GENERIC_KEY = "*"
log = logging.getLogger("toolmesh.cli.host")


def add_parser(commands: Any) -> None:
    """Add `host` to the subcommands of `toolmesh`."""
    parser: argparse.ArgumentParser = commands.add_parser("host", help="run a handler host for a thread")
    parser.add_argument("--thread-id", required=True)
    parser.add_argument(
        "--handlers",
        required=True,
        help='MODULE:ATTR, a mapping of tool name to callable(args, ctx); the key "*" is the generic handler',
    )
    parser.add_argument("--bridge", help="bridge address (env TOOLMESH_BRIDGE_ADDR)")
    parser.add_argument("--name", help="host name shown in the bridge's logs")
    access.add_arguments(parser)
    parser.set_defaults(run=run)


def load_handlers(spec: str) -> Mapping[str, Any]:
    """Import `MODULE:ATTR`, a mapping of tool name to handler (the working directory is on the path).

    Raises ValueError when `spec` is not MODULE:ATTR or ATTR is not a mapping
    of callables, and ImportError or AttributeError when it cannot be found.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError("--handlers takes MODULE:ATTR")
    # Like `python -m`, let modules in the working directory be found.
    sys.path.insert(0, str(Path.cwd()))
    handlers = getattr(importlib.import_module(module_name), attr)
    if not isinstance(handlers, Mapping) or not all(callable(h) for h in handlers.values()):
        raise ValueError(f"{spec} must be a mapping of tool name to callable")
    return handlers


def _log_error(error: HostError) -> None:
    log.error(
        "host error",
        extra={
            "code": error.code.value,
            "cause": error.cause,
            "tool_name": error.tool_name,
            "tool_request_id": error.tool_request_id,
            "turn_id": error.turn_id,
            "detail": error.message,
        },
    )


async def run(args: argparse.Namespace) -> int:
    """Serve the handlers until SIGTERM or SIGINT; returns the exit code (2 when they cannot be loaded).

    Logs "host ready" once connected, and every HostError as "host error".
    """
    try:
        handlers = load_handlers(args.handlers)
    except (ImportError, AttributeError, ValueError) as exc:
        print(f"toolmesh host: cannot load handlers: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        credentials = access.credentials(args)
    except (OSError, ValueError) as exc:
        print(f"toolmesh host: {exc}", file=sys.stderr)
        return EXIT_USAGE
    host = ToolHost(
        address("bridge", args.bridge),
        args.thread_id,
        host_name=args.name,
        credentials=credentials,
        token=access.token(args),
    )
    for name, handler in handlers.items():
        if name == GENERIC_KEY:
            host.on_any(handler)
        else:
            host.on_tool(name, handler)
    host.on_error(_log_error)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    runner = asyncio.create_task(host.run())
    waiter = asyncio.create_task(host.wait_connected())
    await asyncio.wait({waiter, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    refusal = waiter.exception() if waiter.done() else None
    if isinstance(refusal, ToolmeshError):
        print(f"toolmesh host: refused: {refusal.code.value}: {refusal}", file=sys.stderr)
        await host.stop()
        runner.cancel()
        return EXIT_USAGE
    if host.connected:
        log.info(
            "host ready",
            extra={
                "thread_id": args.thread_id,
                "host_session_id": host.host_session_id,
                "tools": ",".join(sorted(handlers)),
            },
        )
    await stop.wait()
    await host.stop()
    runner.cancel()
    waiter.cancel()
    return 0
