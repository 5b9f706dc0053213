"""The `toolmesh` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, entry_points, version

from toolmesh.cli import call, chat, host, invocations, mcp, tools
from toolmesh.cli.output import EXIT_INTERRUPTED
from toolmesh.core import event_loop, otel
from toolmesh.core.logs import configure_logging


def build_parser() -> argparse.ArgumentParser:
    """The `toolmesh` parser: the built-in commands and those plugged in through `toolmesh.commands`."""
    parser = argparse.ArgumentParser(
        prog="toolmesh",
        description="A runtime for AI agents calling application tools.",
        epilog="Exit codes: 0 done; 1 not found; 2 a malformed command or a request refused for good; "
        "75 try the same command again (no outcome, or a service could not be reached); 130 Ctrl-C.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Commands of other distributions (the servers' `up`) plug in here, so this
    # package never imports them and installs without them.
    for plugin in entry_points(group=PLUGIN_GROUP):
        plugin.load()(commands)
    tools.add_parser(commands)
    host.add_parser(commands)
    call.add_parser(commands)
    chat.add_parser(commands)
    invocations.add_parser(commands)
    mcp.add_parser(commands)
    return parser


def _version() -> str:
    try:
        return version("toolmesh")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


PLUGIN_GROUP = "toolmesh.commands"
# What the servers' commands need when the servers are not installed.
_MISSING = {
    "up": "`toolmesh up` runs the services: install them with `pip install toolmesh-server`.",
    "token": "`toolmesh token` mints tokens with the services' secret: `pip install toolmesh-server`.",
}

# The service name each command reports in logs and traces.
_SERVICE_NAMES = {"up": "toolmesh", "host": "toolmesh-host", "mcp": "toolmesh-mcp"}


def main(argv: Sequence[str] | None = None) -> None:
    """Run the `toolmesh` command line (exits with the command's code)."""
    given = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    plugged = {plugin.name for plugin in entry_points(group=PLUGIN_GROUP)}
    if given and given[0] in _MISSING and given[0] not in plugged:
        print(_MISSING[given[0]], file=sys.stderr)
        sys.exit(2)
    args = parser.parse_args(given)
    try:
        factory = event_loop.loop_factory()
    except ValueError as error:
        parser.error(str(error))
    service = _SERVICE_NAMES.get(args.command, "toolmesh-cli")
    configure_logging(service, None if args.command in _SERVICE_NAMES else "WARNING")
    # A command that serves metrics (`up`, `mcp`) says so with a `metrics_endpoint` default: its
    # reader must be in the meter provider from the start. It starts listening in the command.
    endpoint_of = getattr(args, "metrics_endpoint", None)
    try:
        args.metrics = None if endpoint_of is None else endpoint_of(args)
    except (OSError, ValueError) as refusal:
        print(f"toolmesh {args.command}: {refusal}", file=sys.stderr)
        sys.exit(2)
    otel.configure(service, metric_readers=() if args.metrics is None else (args.metrics.reader,))
    try:
        code = event_loop.run(args.run(args), factory)
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    finally:
        if args.metrics is not None:
            args.metrics.stop()
        otel.shutdown()
    sys.exit(code)


if __name__ == "__main__":
    main()
