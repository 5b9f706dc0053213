"""The `toolmesh` command line."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from toolmesh.cli import call, chat, host, invocations, tools, up
from toolmesh.core import telemetry
from toolmesh.core.logs import configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="toolmesh", description="A runtime for AI agents calling application tools."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    up.add_parser(commands)
    tools.add_parser(commands)
    host.add_parser(commands)
    call.add_parser(commands)
    chat.add_parser(commands)
    invocations.add_parser(commands)
    return parser


# The service name each command reports in logs and traces.
_SERVICE_NAMES = {"up": "toolmesh", "host": "toolmesh-host"}


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    service = _SERVICE_NAMES.get(args.command, "toolmesh-cli")
    configure_logging(service, None if args.command in _SERVICE_NAMES else "WARNING")
    telemetry.configure(service)
    try:
        code = asyncio.run(args.run(args))
    except KeyboardInterrupt:
        code = 130
    finally:
        telemetry.shutdown()
    sys.exit(code)


if __name__ == "__main__":
    main()
