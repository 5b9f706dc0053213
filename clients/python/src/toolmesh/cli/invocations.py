"""`toolmesh invocations show ID`: reconcile after an ambiguous failure; `invocations cancel ID`: stop one."""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from toolmesh.cli import access
from toolmesh.cli.arguments import add_address
from toolmesh.cli.output import print_rpc_error, usage_error
from toolmesh.client.config import address
from toolmesh.client.invocation import InvocationClient


def add_parser(commands: Any) -> None:
    """Add `invocations show` and `invocations cancel` to the subcommands of `toolmesh`."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "invocations", help="look up invocations", description="Look up invocations in the ledger."
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    show = verbs.add_parser(
        "show",
        help="state, outcome, delivery and times of one invocation, as JSON",
        description="Print one invocation as JSON: state, outcome, delivery and times. Exit 0: found; "
        "1: the ledger has no invocation of that id (never made, or older than it keeps); 75: the "
        "service could not be reached.",
    )
    show.add_argument("tool_request_id", metavar="TOOL_REQUEST_ID", help="the toolRequestId a call printed")
    add_address(show, "invocation")
    access.add_arguments(show)
    show.set_defaults(run=run_show)
    cancel = verbs.add_parser(
        "cancel",
        help="stop a running invocation (it ends with TOOL_CANCELLED)",
        description='Cancel a running invocation and print {"toolRequestId", "cancelled"} as JSON: '
        "cancelled is false when it had already ended or another call has joined it. Exit 0: "
        "answered; 1: the ledger has no invocation of that id; 75: the service could not be reached.",
    )
    cancel.add_argument("tool_request_id", metavar="TOOL_REQUEST_ID", help="the toolRequestId a call printed")
    add_address(cancel, "invocation")
    access.add_arguments(cancel)
    cancel.set_defaults(run=run_cancel)


async def run_show(args: argparse.Namespace) -> int:
    """Print one invocation as JSON; returns 0, 1 when the ledger has no such invocation, or 75/2."""

    async def show(client: InvocationClient) -> str:
        invocation = await client.get_invocation(args.tool_request_id)
        return json.dumps(invocation.to_json(), indent=2, ensure_ascii=False)

    return await _ask(args, show)


async def run_cancel(args: argparse.Namespace) -> int:
    """Cancel one invocation and print whether it was; returns 0, 1 for an unknown id, or 75/2."""

    async def cancel(client: InvocationClient) -> str:
        cancelled = await client.cancel_invocation(args.tool_request_id)
        return json.dumps({"toolRequestId": args.tool_request_id, "cancelled": cancelled})

    return await _ask(args, cancel)


async def _ask(args: argparse.Namespace, ask: Callable[[InvocationClient], Awaitable[str]]) -> int:
    """Ask the invocation service with `ask` and print its answer; a refusal is printed as the RPC error."""
    try:
        credentials = access.credentials(args)
    except (OSError, ValueError) as exc:
        return usage_error("invocations", str(exc))
    target = address("invocation", args.invocation)
    async with InvocationClient(target, credentials=credentials, token=access.token(args)) as client:
        try:
            answer = await ask(client)
        except grpc.aio.AioRpcError as error:
            return print_rpc_error(error, "invocation", target)
    print(answer)
    return 0
