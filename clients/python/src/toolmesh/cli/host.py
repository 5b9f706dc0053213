"""`toolmesh host`: serve a session's tools from a Python module's handlers.

In the foreground it logs JSON lines on stderr and prints one line on stdout
once it is connected (`toolmesh host: ready, ...`). With `--detach` it serves
from a process of its own and returns only once that process is connected
(exit 0), or has failed (its exit code, or 75 when the bridge could not be
reached in time), so the next command can rely on it; the process logs to a
file and writes its id to a pid file (`kill "$(cat FILE)"` stops it).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import select
import signal
import subprocess
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from toolmesh.cli import access
from toolmesh.cli.arguments import add_address, add_session, positive_seconds
from toolmesh.cli.output import EXIT_NO_OUTCOME, EXIT_USAGE, unreachable, usage_error
from toolmesh.client.config import address
from toolmesh.core.bearer import ENV_TOKEN
from toolmesh.core.errors import ToolmeshError
from toolmesh.core.exceptions import exception_fields
from toolmesh.host import HostError, ToolHost

GENERIC_KEY = "*"
log = logging.getLogger("toolmesh.cli.host")


def add_parser(commands: Any) -> None:
    """Add `host` to the subcommands of `toolmesh`."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "host",
        help="serve a session's tools from a Python module's handlers",
        description="Serve a session's tools from a Python module's handlers until SIGTERM or Ctrl-C. "
        "Prints one line on stdout once connected; logs JSON lines on stderr. Exit 0: stopped; "
        "2: the handlers cannot be loaded; 75 (--detach): the bridge could not be reached in time.",
    )
    add_session(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--handlers",
        metavar="MODULE:ATTR",
        help="a mapping of tool name to callable(args, ctx) in a module (the working directory is on the "
        'path); the key "*" is the generic handler',
    )
    source.add_argument(
        "--mcp",
        metavar='"COMMAND ARGS"',
        help="serve the tools of this MCP server, started as a command speaking MCP on stdio (the mcp extra)",
    )
    source.add_argument(
        "--mcp-url",
        metavar="URL",
        help="serve the tools of the MCP server at this streamable HTTP URL (the mcp extra)",
    )
    add_address(parser, "bridge")
    parser.add_argument("--name", help="this host's name in the bridge's logs (default: HOSTNAME:python)")
    parser.add_argument(
        "--detach",
        action="store_true",
        help="serve from a background process; return once it is connected (for scripts)",
    )
    parser.add_argument(
        "--log-file",
        type=Path,
        metavar="PATH",
        help="write the logs here instead of stderr (default with --detach: toolmesh-host-SESSION.log)",
    )
    parser.add_argument(
        "--pid-file",
        type=Path,
        metavar="PATH",
        help="with --detach: where to write the process id (default: toolmesh-host-SESSION.pid)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=positive_seconds,
        default=10.0,
        metavar="SECONDS",
        help="with --detach: how long to wait for the first connection (default %(default)s)",
    )
    # The detached process tells its parent on this descriptor that it is connected.
    parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    access.add_arguments(parser)
    parser.set_defaults(run=run)


class HandlersNotLoaded(Exception):
    """The handlers could not be loaded; the message is one line saying why."""


def load_handlers(spec: str) -> Mapping[str, Any]:
    """Import `MODULE:ATTR`, a mapping of tool name to handler (the working directory is on the path).

    Raises HandlersNotLoaded with a one-line reason: `spec` is not MODULE:ATTR,
    the module cannot be found or fails to import (a syntax error, an
    exception at import), ATTR is missing, or it is not a mapping of callables.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise HandlersNotLoaded("--handlers takes MODULE:ATTR")
    # Like `python -m`, let modules in the working directory be found.
    sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise HandlersNotLoaded(f"no module named {exc.name}") from None
    except SyntaxError as exc:
        raise HandlersNotLoaded(f"{exc.filename} line {exc.lineno}: {exc.msg}") from None
    except Exception as exc:
        raise HandlersNotLoaded(f"importing {module_name} raised {_where(exc)}") from None
    try:
        handlers = getattr(module, attr)
    except AttributeError:
        raise HandlersNotLoaded(f"{module_name} has no {attr}") from None
    if not isinstance(handlers, Mapping) or not all(callable(h) for h in handlers.values()):
        raise HandlersNotLoaded(f"{spec} must be a mapping of tool name to callable")
    return handlers


def _where(exc: Exception) -> str:
    """`Type: message (file line N)`, at the deepest frame of the user's code."""
    frames = traceback.extract_tb(exc.__traceback__)
    place = f" ({frames[-1].filename} line {frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{place}"


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


def _ready_line(args: argparse.Namespace, target: str, tools: list[str]) -> str:
    names = ", ".join(tools)
    return f"toolmesh host: ready, serving session {args.session_id} ({names}) through the bridge at {target}"


async def run(args: argparse.Namespace) -> int:
    """Serve the handlers until SIGTERM or SIGINT, or start a detached host (see the module).

    Returns the exit code: 0, 2 when the handlers cannot be loaded, 75 when a
    detached host could not connect in time.
    """
    if args.log_file is not None and not args.detach:
        try:
            _log_to(args.log_file)
        except OSError as exc:
            return usage_error("host", f"cannot write {args.log_file}: {exc.strerror}")
    handlers: Mapping[str, Any] = {}
    if args.handlers is not None:
        try:
            handlers = load_handlers(args.handlers)
        except HandlersNotLoaded as exc:
            return usage_error("host", f"cannot load handlers: {exc}")
    try:
        credentials = access.credentials(args)
    except (OSError, ValueError) as exc:
        return usage_error("host", str(exc))
    target = address("bridge", args.bridge)
    if args.detach:
        return _detach(args, target, handlers)
    host = ToolHost(
        target, args.session_id, host_name=args.name, credentials=credentials, token=access.token(args)
    )
    host.on_error(_log_error)
    if args.handlers is None:
        return await _serve_mcp_server(args, target, host)
    for name, handler in handlers.items():
        if name == GENERIC_KEY:
            host.on_any(handler)
        else:
            host.on_tool(name, handler)
    return await _serve(args, target, host, sorted(handlers))


async def _serve_mcp_server(args: argparse.Namespace, target: str, host: ToolHost) -> int:
    """`--mcp` / `--mcp-url`: connect to the MCP server, declare its tools, serve them."""
    try:
        from toolmesh.mcp.upstream import Upstream, stdio_server  # noqa: PLC0415
    except ImportError:
        return usage_error("host", "--mcp needs the MCP SDK: pip install 'toolmesh[mcp]'")
    try:
        server = stdio_server(args.mcp) if args.mcp is not None else args.mcp_url
    except ValueError as exc:
        return usage_error("host", str(exc))
    upstream = Upstream(host)
    try:
        async with upstream.connected(server):
            return await _serve(args, target, host, upstream.tool_names)
    except Exception as exc:
        # The MCP server could not be started or reached, or broke the protocol: say which, not its text.
        log.error("MCP server failed", extra=exception_fields(exc))
        print(f"toolmesh host: the MCP server failed ({type(exc).__name__}); see the log", file=sys.stderr)
        return EXIT_NO_OUTCOME


async def _serve(args: argparse.Namespace, target: str, host: ToolHost, tools: list[str]) -> int:
    """Connect the host and serve until SIGTERM or SIGINT; returns the exit code (0, or 2 when refused)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    runner = asyncio.create_task(host.run())
    waiter = asyncio.create_task(host.wait_connected())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopping}, return_when=asyncio.FIRST_COMPLETED)
    refusal = waiter.exception() if waiter.done() else None
    if isinstance(refusal, ToolmeshError):
        print(f"toolmesh host: refused: {refusal.code.value}: {refusal}", file=sys.stderr)
        await host.stop()
        runner.cancel()
        stopping.cancel()
        return EXIT_USAGE
    if host.connected:
        log.info(
            "host ready",
            extra={
                "session_id": args.session_id,
                "host_session_id": host.host_session_id,
                "tools": ",".join(tools),
            },
        )
        print(_ready_line(args, target, tools), flush=True)
        if args.ready_fd is not None:
            os.write(args.ready_fd, b"ready\n")
            os.close(args.ready_fd)
    await stopping
    await host.stop()
    runner.cancel()
    waiter.cancel()
    return 0


def _log_to(path: Path) -> None:
    """Send everything this process writes on stderr (its logs) to `path`, appended."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(descriptor, sys.stderr.fileno())
    os.close(descriptor)


def _access_flags(args: argparse.Namespace) -> list[str]:
    """The TLS flags of this command, for the detached process (its token goes in its environment)."""
    flags = ["--tls"] if args.tls else []
    files = {"--tls-ca": args.tls_ca, "--tls-cert": args.tls_cert, "--tls-key": args.tls_key}
    for flag, path in files.items():
        if path is not None:
            flags += [flag, path]
    return flags


def _detach(args: argparse.Namespace, target: str, handlers: Mapping[str, Any]) -> int:
    """Start this host in a process of its own; return once it is connected, or has failed.

    Blocking is fine here: this process does nothing else meanwhile.
    """
    log_file: Path = args.log_file or Path(f"toolmesh-host-{args.session_id}.log")
    pid_file: Path = args.pid_file or Path(f"toolmesh-host-{args.session_id}.pid")
    source = (
        ["--handlers", args.handlers]
        if args.handlers is not None
        else (["--mcp", args.mcp] if args.mcp is not None else ["--mcp-url", args.mcp_url])
    )
    command = [
        sys.executable, "-m", "toolmesh.cli.main", "host",
        "--session-id", args.session_id, *source, "--bridge", target,
    ]  # fmt: skip
    if args.name:
        command += ["--name", args.name]
    command += _access_flags(args)
    environment = dict(os.environ)
    if args.token is not None:
        # Through the environment, not the command line: a flag shows in ps.
        environment[ENV_TOKEN] = args.token
    read_end, write_end = os.pipe()
    try:
        with open(log_file, "ab") as log_output:
            process = subprocess.Popen(
                [*command, "--ready-fd", str(write_end)],
                stdin=subprocess.DEVNULL,
                stdout=log_output,
                stderr=log_output,
                pass_fds=(write_end,),
                env=environment,
                # Its own session: Ctrl-C in this terminal does not reach it.
                start_new_session=True,
            )
    except OSError as exc:
        os.close(read_end)
        os.close(write_end)
        return usage_error("host", f"cannot start the host process ({log_file}): {exc.strerror}")
    os.close(write_end)
    try:
        # "ready" once connected; nothing (the end of the pipe) when the process ended first.
        readable, _, _ = select.select([read_end], [], [], args.connect_timeout)
        said = os.read(read_end, 64) if readable else None
    finally:
        os.close(read_end)
    if said is None:
        process.terminate()
        process.wait()
        print(f"toolmesh host: {unreachable('bridge', target)} (log: {log_file})", file=sys.stderr)
        return EXIT_NO_OUTCOME
    if said != b"ready\n":
        code = process.wait()
        print(f"toolmesh host: the host process exited ({code}); see {log_file}", file=sys.stderr)
        return code or EXIT_USAGE
    pid_file.write_text(f"{process.pid}\n")
    print(
        f"{_ready_line(args, target, sorted(handlers))}; process {process.pid} (log: {log_file}); "
        f'stop it with: kill "$(cat {pid_file})"',
        flush=True,
    )
    return 0
