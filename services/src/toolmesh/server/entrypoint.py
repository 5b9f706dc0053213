"""Running one service as its own process: `python -m toolmesh.<service>`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable

from toolmesh.client.config import DEFAULT_PORTS, address
from toolmesh.core import otel
from toolmesh.core.logs import configure_logging
from toolmesh.server.runtime import CannotListen, RunningServer, serve_until_signalled


def parse_args(
    service: str,
    dependencies: tuple[str, ...] = (),
    extend: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m toolmesh.{service}")
    parser.add_argument(
        "--listen",
        default=f"127.0.0.1:{DEFAULT_PORTS[service]}",
        help="address to listen on (default %(default)s; port 0 picks a free one)",
    )
    for dependency in dependencies:
        parser.add_argument(
            f"--{dependency}", help=f"{dependency} address (env TOOLMESH_{dependency.upper()}_ADDR)"
        )
    if extend is not None:
        extend(parser)
    return parser.parse_args()


def run(service: str, start: Callable[[], Awaitable[RunningServer]]) -> None:
    """Start the service, print its port (so a parent process can read it), serve until signalled."""
    configure_logging(f"toolmesh-{service}")
    otel.configure(f"toolmesh-{service}")

    async def main() -> None:
        try:
            server = await start()
        except CannotListen as exc:
            print(f"toolmesh {service}: {exc.strerror}", file=sys.stderr)
            sys.exit(1)
        print(f"toolmesh {service} listening on port {server.port}", flush=True)
        if server.web_port is not None:
            print(
                f"toolmesh {service} serves pages (Connect, gRPC-Web) on port {server.web_port}", flush=True
            )
        await serve_until_signalled([server])

    try:
        asyncio.run(main())
    finally:
        otel.shutdown()


def dependency_address(args: argparse.Namespace, service: str) -> str:
    flag: str | None = getattr(args, service)
    return address(service, flag)
