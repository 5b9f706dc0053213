"""`toolmesh invocations show ID`: reconcile after an ambiguous failure."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import grpc
from google.protobuf import json_format

from toolmesh.cli import access
from toolmesh.cli.output import EXIT_USAGE, print_rpc_error
from toolmesh.client.config import address
from toolmesh.client.invocation import InvocationClient


def add_parser(commands: Any) -> None:
    """Add `invocations show` to the subcommands of `toolmesh`."""
    parser: argparse.ArgumentParser = commands.add_parser("invocations", help="look up invocations")
    verbs = parser.add_subparsers(dest="verb", required=True)
    show = verbs.add_parser("show", help="state, outcome, delivery and times of one invocation, as JSON")
    show.add_argument("tool_request_id")
    show.add_argument("--invocation", help="invocation address (env TOOLMESH_INVOCATION_ADDR)")
    access.add_arguments(show)
    show.set_defaults(run=run_show)


async def run_show(args: argparse.Namespace) -> int:
    """Print one invocation as JSON; returns 0, or the exit code of a refused lookup (2 when not found)."""
    try:
        credentials = access.credentials(args)
    except (OSError, ValueError) as exc:
        print(f"toolmesh invocations: {exc}", file=sys.stderr)
        return EXIT_USAGE
    target = address("invocation", args.invocation)
    async with InvocationClient(target, credentials=credentials, token=access.token(args)) as client:
        try:
            invocation = await client.get_invocation(args.tool_request_id)
        except grpc.aio.AioRpcError as error:
            return print_rpc_error(error)
    shown = json_format.MessageToDict(invocation, always_print_fields_with_no_presence=True)
    shown["state"] = shown["state"].removeprefix("INVOCATION_STATE_").lower()
    print(json.dumps(shown, indent=2))
    return 0
