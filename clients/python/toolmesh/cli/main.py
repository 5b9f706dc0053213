"""The `toolmesh` command line."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from toolmesh.cli import call, chat, host, invocations, tools, up


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


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = asyncio.run(args.run(args))
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
