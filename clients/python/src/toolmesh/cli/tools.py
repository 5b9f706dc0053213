"""`toolmesh tools put|list`.

Every problem with a tools.json file, found here or by the registry, is one
line on stderr: `toolmesh tools put: FILE: WHERE: PROBLEM`, and exit 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import grpc

from toolmesh.cli import access
from toolmesh.cli.arguments import NotJson, add_address, add_session, parse_json
from toolmesh.cli.output import print_rpc_error, usage_error
from toolmesh.client.config import address
from toolmesh.client.registry import RegistryClient
from toolmesh.core.errors import ERROR_TABLE, ToolmeshError
from toolmesh.core.rpcstatus import error_code
from toolmesh.core.tools import ToolSpec

FILE_KEYS = ("tools",)


def add_parser(commands: Any) -> None:
    """Add `tools put` and `tools list` to the subcommands of `toolmesh`."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "tools", help="read or replace a session's tools", description="Read or replace a session's tools."
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    put = verbs.add_parser(
        "put",
        help="replace the session's tools with those of a tools.json file",
        description="Replace the session's tools with those of a tools.json file (README: tools.json). "
        "Exit 0: stored; 2: the file or a tool in it is refused; 75: the registry could not be reached.",
    )
    add_session(put)
    put.add_argument("--file", required=True, type=Path, metavar="PATH", help='a JSON file: {"tools": [...]}')
    add_address(put, "registry")
    access.add_arguments(put)
    put.set_defaults(run=run_put)
    listing = verbs.add_parser(
        "list",
        help="print the session's tools and revision as JSON",
        description="Print the session's tools and revision as JSON, in the form of tools.json.",
    )
    add_session(listing)
    add_address(listing, "registry")
    access.add_arguments(listing)
    listing.set_defaults(run=run_list)


class ToolsFileError(ValueError):
    """A tools.json file that cannot be used: the message says where and what, without the file's name."""


def read_tools_file(path: Path) -> list[ToolSpec]:
    """Parse a tools.json file; raise ToolsFileError saying where (line and column, or which tool)."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ToolsFileError(error.strerror or str(error)) from None
    try:
        document = parse_json(text)
    except NotJson as problem:
        raise ToolsFileError(str(problem)) from None
    if not isinstance(document, dict) or not isinstance(document.get("tools"), list):
        raise ToolsFileError('the file must hold {"tools": [...]}')
    unknown = [key for key in document if key not in FILE_KEYS]
    if unknown:
        raise ToolsFileError(
            f'unknown key {", ".join(map(json.dumps, unknown))}; the file holds only "tools"'
        )
    specs = []
    for index, raw in enumerate(document["tools"]):
        try:
            specs.append(ToolSpec.from_json_dict(raw))
        except ToolmeshError as error:
            raise ToolsFileError(f"tools[{index}]: {error.detail}") from None
    return specs


def _client(args: argparse.Namespace, target: str) -> RegistryClient:
    """Raises ValueError or OSError when the TLS files are incomplete or cannot be read."""
    return RegistryClient(target, credentials=access.credentials(args), token=access.token(args))


async def run_put(args: argparse.Namespace) -> int:
    """Replace the session's tools with the file's; prints the new revision and names as JSON.

    Returns 0, 2 for a file that cannot be read or holds a malformed tool (as
    the registry judges it too), or the exit code of another failure.
    """
    try:
        specs = read_tools_file(args.file)
    except ToolsFileError as problem:
        return usage_error("tools put", f"{args.file}: {problem}")
    target = address("registry", args.registry)
    try:
        client = _client(args, target)
    except (OSError, ValueError) as exc:
        return usage_error("tools put", str(exc))
    async with client:
        try:
            revision = await client.put_tools(args.session_id, specs)
        except grpc.aio.AioRpcError as error:
            code = error_code(error)
            if code is not None and ERROR_TABLE[code].caller_fault:
                # The registry refused a tool of the file: said as the file's own problems are.
                return usage_error("tools put", f"{args.file}: {code.value}: {error.details()}")
            return print_rpc_error(error, "registry", target)
    print(json.dumps({"sessionId": args.session_id, "revision": revision, "tools": [t.name for t in specs]}))
    return 0


async def run_list(args: argparse.Namespace) -> int:
    """Print the session's revision and tools as JSON; returns 0 or the exit code of a refused call."""
    target = address("registry", args.registry)
    try:
        client = _client(args, target)
    except (OSError, ValueError) as exc:
        return usage_error("tools list", str(exc))
    async with client:
        try:
            tool_set = await client.list_tools(args.session_id)
        except grpc.aio.AioRpcError as error:
            return print_rpc_error(error, "registry", target)
    print(
        json.dumps(
            {
                "sessionId": args.session_id,
                "revision": tool_set.revision,
                "tools": [tool.to_json_dict() for tool in tool_set.tools],
            },
            indent=2,
        )
    )
    return 0
