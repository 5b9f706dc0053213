"""`toolmesh tools put|list`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import grpc

from toolmesh.cli import access
from toolmesh.cli.output import EXIT_USAGE, print_rpc_error
from toolmesh.client.config import address
from toolmesh.client.registry import RegistryClient
from toolmesh.core import jsontext
from toolmesh.core.errors import ToolmeshError
from toolmesh.core.tools import ToolSpec


def add_parser(commands: Any) -> None:
    """Add `tools put` and `tools list` to the subcommands of `toolmesh`."""
    parser: argparse.ArgumentParser = commands.add_parser("tools", help="read or replace a thread's tools")
    verbs = parser.add_subparsers(dest="verb", required=True)
    put = verbs.add_parser("put", help="replace the thread's tools with those of a tools.json file")
    put.add_argument("--thread-id", required=True)
    put.add_argument("--file", required=True, type=Path, help='JSON file: {"tools": [...]}')
    put.add_argument("--registry", help="registry address (env TOOLMESH_REGISTRY_ADDR)")
    access.add_arguments(put)
    put.set_defaults(run=run_put)
    listing = verbs.add_parser("list", help="print the thread's tools and revision as JSON")
    listing.add_argument("--thread-id", required=True)
    listing.add_argument("--registry", help="registry address (env TOOLMESH_REGISTRY_ADDR)")
    access.add_arguments(listing)
    listing.set_defaults(run=run_list)


def read_tools_file(path: Path) -> list[ToolSpec]:
    """Parse a tools.json file; raise ToolmeshError(INVALID_SCHEMA) or ValueError when malformed."""
    document = jsontext.parse(path.read_text())
    if not isinstance(document, dict) or not isinstance(document.get("tools"), list):
        raise ValueError('the file must hold {"tools": [...]}')
    return [ToolSpec.from_json_dict(raw) for raw in document["tools"]]


def _client(args: argparse.Namespace) -> RegistryClient:
    """Raises ValueError or OSError when the TLS files are incomplete or cannot be read."""
    target = address("registry", args.registry)
    return RegistryClient(target, credentials=access.credentials(args), token=access.token(args))


async def run_put(args: argparse.Namespace) -> int:
    """Replace the thread's tools with the file's; prints the new revision and names as JSON.

    Returns 0, 2 for a file that cannot be read or holds a malformed tool, or
    the exit code of the registry's refusal.
    """
    try:
        specs = read_tools_file(args.file)
    except (OSError, ValueError) as exc:
        print(f"toolmesh: cannot read {args.file}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ToolmeshError as exc:
        print(f"toolmesh: {exc.code.value}: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    try:
        client = _client(args)
    except (OSError, ValueError) as exc:
        print(f"toolmesh tools: {exc}", file=sys.stderr)
        return EXIT_USAGE
    async with client:
        try:
            revision = await client.put_tools(args.thread_id, specs)
        except grpc.aio.AioRpcError as error:
            return print_rpc_error(error)
    print(json.dumps({"threadId": args.thread_id, "revision": revision, "tools": [t.name for t in specs]}))
    return 0


async def run_list(args: argparse.Namespace) -> int:
    """Print the thread's revision and tools as JSON; returns 0 or the exit code of a refused call."""
    try:
        client = _client(args)
    except (OSError, ValueError) as exc:
        print(f"toolmesh tools: {exc}", file=sys.stderr)
        return EXIT_USAGE
    async with client:
        try:
            tool_set = await client.list_tools(args.thread_id)
        except grpc.aio.AioRpcError as error:
            return print_rpc_error(error)
    print(
        json.dumps(
            {
                "threadId": args.thread_id,
                "revision": tool_set.revision,
                "tools": [tool.to_json_dict() for tool in tool_set.tools],
            },
            indent=2,
        )
    )
    return 0
