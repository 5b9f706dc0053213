"""Arguments the commands share, worded once: the session, the services' addresses, JSON text, seconds."""

from __future__ import annotations

import argparse
import json

from toolmesh.client.config import DEFAULT_HOST, DEFAULT_PORTS, ENV_VARS
from toolmesh.core import jsontext


def add_session(parser: argparse.ArgumentParser) -> None:
    """`--session-id ID` (also spelt `--thread-id`), required."""
    parser.add_argument(
        "--session-id",
        "--thread-id",
        dest="session_id",
        required=True,
        metavar="ID",
        help="the session whose tools these are, e.g. one conversation (--thread-id is the same flag)",
    )


def add_address(parser: argparse.ArgumentParser, service: str) -> None:
    """`--registry`, `--invocation` or `--bridge`: where that service listens."""
    parser.add_argument(
        f"--{service}",
        metavar="HOST:PORT",
        help=f"the {service} service's address (default: ${ENV_VARS[service]}, "
        f"else {DEFAULT_HOST}:{DEFAULT_PORTS[service]})",
    )


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds greater than 0."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds greater than 0")
    return seconds


class NotJson(ValueError):
    """JSON text that does not parse: the message says where (line and column) and what."""


def parse_json(text: str) -> jsontext.JsonValue:
    """Parse JSON text as toolmesh does (no NaN or Infinity); raise NotJson saying where it fails."""
    try:
        json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as error:
        raise NotJson(f"line {error.lineno} column {error.colno}: {error.msg}") from None
    except ValueError as error:
        raise NotJson(str(error)) from None
    except RecursionError:
        raise NotJson("nested too deeply") from None
    return jsontext.parse(text)


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")
