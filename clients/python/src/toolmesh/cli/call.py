"""`toolmesh tool-call`: one tool call, one JSON object on stdout.

Exit 0: a formal outcome arrived (success or error). Exit 75: none arrived
(this command's own deadline passed, or the connection failed); the same
command may be retried as it is. Exit 2: the command was malformed.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from typing import Any

import grpc

from toolmesh.cli import access
from toolmesh.cli.output import EXIT_NO_OUTCOME, EXIT_USAGE, print_rpc_error
from toolmesh.client.config import address
from toolmesh.client.invocation import InvocationClient


def add_parser(commands: Any) -> None:
    """Add `tool-call` to the subcommands of `toolmesh`."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "tool-call", help="call one tool and print the outcome"
    )
    parser.add_argument("--thread-id", required=True)
    parser.add_argument("--tool", required=True)
    parser.add_argument("--args", default="{}", help="the arguments as JSON text (default {})")
    parser.add_argument("--turn-id", help="default: a new id")
    parser.add_argument(
        "--timeout", type=float, help="seconds this command waits for an outcome (not the tool's timeoutMs)"
    )
    parser.add_argument("--invocation", help="invocation address (env TOOLMESH_INVOCATION_ADDR)")
    access.add_arguments(parser)
    parser.set_defaults(run=run)


async def run(args: argparse.Namespace) -> int:
    """Make the call and print its CallResult as JSON; returns the exit code (0, 75 or 2, see above).

    A malformed request prints the refusal as JSON on stderr instead.
    """
    turn_id = args.turn_id or f"turn_{uuid.uuid4().hex[:16]}"
    try:
        credentials = access.credentials(args)
    except (OSError, ValueError) as exc:
        print(f"toolmesh tool-call: {exc}", file=sys.stderr)
        return EXIT_USAGE
    target = address("invocation", args.invocation)
    async with InvocationClient(target, credentials=credentials, token=access.token(args)) as client:
        try:
            result = await client.invoke(
                args.thread_id, args.tool, turn_id=turn_id, arguments_json=args.args, timeout=args.timeout
            )
        except grpc.aio.AioRpcError as error:
            return print_rpc_error(error)
    print(json.dumps(result.to_json(), ensure_ascii=False))
    sys.stdout.flush()
    return 0 if result.outcome_received else EXIT_NO_OUTCOME
