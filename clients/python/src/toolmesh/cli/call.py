"""`toolmesh tool-call`: one tool call, one JSON object on stdout.

Exit 0: a formal outcome arrived (success or error). Exit 75: none arrived
(this command's own deadline passed, or the connection failed); the same
command may be retried as it is until the `retrySafeUntil` it printed (the
ledger's replay window, 10 minutes by default: null when no invocation was
named), and `toolmesh invocations show` reconciles the `toolRequestId` it
printed, when it printed one. A retry after that time, while the ledger still
knows the invocation, is refused with RETRY_WINDOW_PASSED (exit 2, nothing ran). Exit 2: the command was
malformed (a flag, arguments that are not JSON, a bad name). Exit 130: Ctrl-C
(as 75: no outcome arrived).

While the tool runs, its handler's progress reports are printed on stderr, one
line each (`progress 2/5: <the handler's message>`); `--no-progress` turns
them off and makes the plain InvokeTool call. Only the handler's own numbers
and message are shown: never arguments or results.
"""

from __future__ import annotations

import argparse
import json
import sys
import unicodedata
import uuid
from typing import Any

import grpc

from toolmesh.cli import access
from toolmesh.cli.arguments import NotJson, add_address, add_session, parse_json, positive_seconds
from toolmesh.cli.output import EXIT_NO_OUTCOME, print_rpc_error, unreachable, usage_error
from toolmesh.client.config import address
from toolmesh.client.invocation import InvocationClient
from toolmesh.core.errors import Code
from toolmesh.core.progress import ToolProgress


def add_parser(commands: Any) -> None:
    """Add `tool-call` to the subcommands of `toolmesh`."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "tool-call",
        help="call one tool and print the outcome as JSON",
        description="Call one tool and print one JSON object. Exit 0: an outcome arrived (a result or "
        "an error); 75: none arrived, the same command may be run again until the retrySafeUntil it "
        "printed; 2: a malformed command, or a retry after that (RETRY_WINDOW_PASSED).",
    )
    add_session(parser)
    parser.add_argument("--tool", required=True, metavar="NAME", help="the tool to call")
    parser.add_argument(
        "--args", default="{}", metavar="JSON", help="the arguments, a JSON object (default {})"
    )
    parser.add_argument(
        "--turn-id",
        metavar="ID",
        help="the turn this call belongs to, for logs and traces (default: a new id)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        metavar="SECONDS",
        help="how long this command waits for an outcome; not the tool's own timeoutMs (default: no limit)",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="print the tool's progress reports on stderr while it runs (default: on)",
    )
    add_address(parser, "invocation")
    access.add_arguments(parser)
    parser.set_defaults(run=run)


def progress_line(progress: ToolProgress) -> str:
    """One line for a progress report: `progress 2/5: message`, control characters as spaces."""
    shown = (
        f"{progress.progress:g}" if progress.total is None else f"{progress.progress:g}/{progress.total:g}"
    )
    if progress.message:
        text = "".join(" " if unicodedata.category(c)[0] == "C" else c for c in progress.message)
        shown += f": {text}"
    return f"progress {shown}"


def print_progress(progress: ToolProgress) -> None:
    """Print one progress report on stderr, at once (stdout keeps the one JSON object)."""
    print(progress_line(progress), file=sys.stderr, flush=True)


async def run(args: argparse.Namespace) -> int:
    """Make the call and print its CallResult as JSON; returns the exit code (0, 75 or 2, see above).

    A malformed request prints the refusal as JSON on stderr instead.
    """
    try:
        parse_json(args.args)
    except NotJson as problem:
        return usage_error("tool-call", f"--args is not JSON: {problem}")
    turn_id = args.turn_id or f"turn_{uuid.uuid4().hex[:16]}"
    try:
        credentials = access.credentials(args)
    except (OSError, ValueError) as exc:
        return usage_error("tool-call", str(exc))
    target = address("invocation", args.invocation)
    async with InvocationClient(target, credentials=credentials, token=access.token(args)) as client:
        try:
            result = await client.invoke(
                args.session_id,
                args.tool,
                turn_id=turn_id,
                arguments_json=args.args,
                timeout=args.timeout,
                on_progress=print_progress if args.progress else None,
            )
        except grpc.aio.AioRpcError as error:
            return print_rpc_error(error, "invocation", target)
    shown = result.to_json()
    if result.code is Code.TRANSPORT_FAILED and result.tool_request_id is None:
        # Nothing answered at all: say where we looked, and how to start the services.
        shown["error"]["message"] = unreachable("invocation", target)
        shown["error"]["details"] = {"address": target, "cause": result.detail}
    print(json.dumps(shown, ensure_ascii=False))
    sys.stdout.flush()
    return 0 if result.outcome_received else EXIT_NO_OUTCOME
