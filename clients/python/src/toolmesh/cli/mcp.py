"""`toolmesh mcp`: serve sessions' tools to MCP clients (the `mcp` extra).

Over stdio (`--session-id T`): one MCP client, the process that started this
command, calls session T's tools. Over streamable HTTP (`--http`): every
session at /sessions/{id}/mcp, each caller with its own bearer token (the
Authorization header, passed to the services as it is), bound to loopback
unless --listen says otherwise. Logs go to stderr; over HTTP one line on
stdout says where it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

from toolmesh.cli import access
from toolmesh.cli.arguments import add_address
from toolmesh.cli.output import EXIT_USAGE, usage_error
from toolmesh.client.config import address
from toolmesh.client.invocation import InvocationClient
from toolmesh.client.registry import RegistryClient
from toolmesh.core import scrape
from toolmesh.core.scrape import MetricsEndpoint

DEFAULT_LISTEN = "127.0.0.1:7480"
MISSING_EXTRA = "`toolmesh mcp` needs the MCP SDK: pip install 'toolmesh[mcp]'"


def add_parser(commands: Any) -> None:
    """Add `mcp` to the subcommands of `toolmesh`."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "mcp",
        help="serve a session's tools to MCP clients (stdio or streamable HTTP)",
        description="Serve tools to MCP clients: one session over stdio (--session-id), or every "
        "session over streamable HTTP at /sessions/{id}/mcp (--http). Exit 0: stopped; 2: a malformed "
        "command or the MCP SDK is missing.",
    )
    parser.add_argument(
        "--session-id",
        "--thread-id",
        dest="session_id",
        metavar="ID",
        help="serve this session over stdio (--thread-id is the same flag)",
    )
    parser.add_argument(
        "--http", action="store_true", help="serve every session over streamable HTTP instead of stdio"
    )
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help="with --http: where to listen (default %(default)s; port 0 picks a free one)",
    )
    parser.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="with --http: a browser origin allowed besides loopback ones (repeatable)",
    )
    scrape.add_arguments(parser)
    add_address(parser, "registry")
    add_address(parser, "invocation")
    access.add_arguments(parser)
    parser.set_defaults(run=run, metrics_endpoint=metrics_endpoint)


def metrics_endpoint(args: argparse.Namespace) -> MetricsEndpoint | None:
    """The endpoint --metrics-listen asks for, where the operator says, as --listen (HTTP only).

    Over stdio, stdout is the MCP client's: no line could say where it listens.
    """
    address = scrape.address_of(args.metrics_listen)
    if address is None:
        return None
    if not args.http:
        raise ValueError("--metrics-listen goes with --http")
    return MetricsEndpoint.create(address)


async def run(args: argparse.Namespace) -> int:
    """Serve until the MCP client leaves (stdio) or SIGTERM / Ctrl-C (HTTP); returns the exit code."""
    if (args.session_id is None) == (not args.http):
        return usage_error("mcp", "give --session-id (stdio) or --http, not both")
    try:
        from toolmesh.mcp.gateway import Gateway, current_token  # noqa: PLC0415
        from toolmesh.mcp.serve import serve_http, serve_stdio, session_of_path, token_of_header  # noqa: PLC0415
    except ImportError:
        print(MISSING_EXTRA, file=sys.stderr)
        return EXIT_USAGE
    host, _, port_text = args.listen.rpartition(":")
    if args.http and (not host or not port_text.isdigit()):
        return usage_error("mcp", f"--listen takes HOST:PORT, not {args.listen!r}")
    try:
        credentials = access.credentials(args)
    except (OSError, ValueError) as exc:
        return usage_error("mcp", str(exc))
    metrics: MetricsEndpoint | None = args.metrics
    if metrics is not None:
        try:
            port = metrics.start()
        except OSError as error:
            print(f"toolmesh mcp: cannot serve metrics: {error.strerror}", file=sys.stderr)
            return 1
        shown = metrics.address.rpartition(":")[0]
        print(f"toolmesh mcp: metrics on http://{shown}:{port}/metrics", flush=True)
    # Over HTTP each request's own token goes on; over stdio, this command's.
    token = current_token if args.http else access.token(args)
    registry = RegistryClient(address("registry", args.registry), credentials=credentials, token=token)
    invocation = InvocationClient(
        address("invocation", args.invocation), credentials=credentials, token=token
    )
    if args.http:
        gateway = Gateway(registry, invocation, session_of_path, token_of_header)
    else:
        session_id: str = args.session_id
        gateway = Gateway(registry, invocation, lambda _ctx: session_id)
    try:
        if args.http:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, stop.set)
            host = host.strip("[]")

            def listening(port: int) -> None:
                shown = f"[{host}]" if ":" in host else host
                print(f"toolmesh mcp: serving http://{shown}:{port}/sessions/{{id}}/mcp", flush=True)

            await serve_http(
                gateway,
                host,
                int(port_text),
                allowed_origins=args.allow_origin,
                on_listening=listening,
                stop=stop,
            )
        else:
            await serve_stdio(gateway)
    finally:
        await gateway.close()
        await invocation.close()
        await registry.close()
    return 0
