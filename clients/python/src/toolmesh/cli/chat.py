"""`toolmesh chat`: talk with an assistant that uses a session's tools, in the terminal.

The assistant is an extra of the client distribution (`toolmesh[assistant]`);
it is imported only when the command runs, so the CLI works without it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from toolmesh.cli import access
from toolmesh.cli.arguments import add_address, add_session, positive_seconds
from toolmesh.cli.output import EXIT_USAGE


def add_parser(commands: Any) -> None:
    """Add `chat` to the subcommands of `toolmesh`."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "chat",
        help="talk with an assistant that uses a session's tools",
        description="Talk with an assistant that uses a session's tools. /clear forgets the conversation, "
        "/quit or Ctrl-D leaves, Ctrl-C stops a turn (or leaves, between turns). Exit 0; 2 for a bad "
        "model setting.",
    )
    add_session(parser)
    parser.add_argument("--model-url", help="chat-completions API base URL (env TOOLMESH_MODEL_URL)")
    parser.add_argument("--model", help="model name (env TOOLMESH_MODEL)")
    parser.add_argument(
        "--model-api-key", help="API key (env TOOLMESH_MODEL_API_KEY, preferred: flags show in ps)"
    )
    parser.add_argument(
        "--model-timeout",
        type=positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="how long one model call may take (default %(default)s)",
    )
    parser.add_argument(
        "--max-rounds", type=int, default=8, help="tool rounds per turn (default %(default)s)"
    )
    parser.add_argument("--system", default="", metavar="TEXT", help="the system prompt (default: none)")
    add_address(parser, "registry")
    add_address(parser, "invocation")
    access.add_arguments(parser)
    parser.add_argument(
        "--require-tls",
        action="store_true",
        default=None,
        help="refuse a plaintext channel (env TOOLMESH_REQUIRE_TLS=1)",
    )
    parser.set_defaults(run=run)


async def run(args: argparse.Namespace) -> int:
    """Run the chat (see toolmesh.cli.chat_terminal), or say which extra it needs."""
    try:
        from toolmesh.cli import chat_terminal  # noqa: PLC0415
    except ImportError:
        print("`toolmesh chat` needs the assistant: pip install 'toolmesh[assistant]'", file=sys.stderr)
        return EXIT_USAGE
    return await chat_terminal.run(args)
