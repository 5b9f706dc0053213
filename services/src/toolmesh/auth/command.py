"""`toolmesh token`: mint a signed, expiring token from the shared secret (development, embedded default).

Plugged into the CLI by this distribution (entry point group `toolmesh.commands`):
minting needs the secret the services verify with, which only an operator has.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from toolmesh.auth.grants import Role
from toolmesh.auth.tokens import (
    DEFAULT_AUDIENCE,
    DEFAULT_ISSUER,
    ENV_AUDIENCE,
    ENV_ISSUER,
    ENV_SECRET,
    ENV_SECRET_FILE,
    mint,
    new_subject,
    read_secret,
)

EXIT_USAGE = 2
TTL = re.compile(r"(\d+)([smhd]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_ttl(text: str) -> int:
    """`90`, `90s`, `15m`, `1h`, `7d` as seconds; ValueError otherwise."""
    found = TTL.fullmatch(text.strip())
    if found is None or int(found.group(1)) == 0:
        raise ValueError(f"not a duration: {text!r} (e.g. 90s, 15m, 1h, 7d)")
    return int(found.group(1)) * _UNIT_S[found.group(2)]


def add_parser(commands: Any) -> None:
    """Add `token` to the CLI's subcommands."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "token", help="mint a token for callers, hosts or admins (from the shared secret)"
    )
    parser.add_argument(
        "--role", action="append", required=True, choices=[r.value for r in Role], help="repeatable"
    )
    parser.add_argument(
        "--session",
        action="append",
        required=True,
        help="a session id, or a prefix ending in * ('*' for every session); repeatable",
    )
    parser.add_argument("--ttl", default="1h", help="lifetime, e.g. 15m, 1h, 7d (default %(default)s)")
    parser.add_argument(
        "--subject",
        default="",
        help="who the token is for (its sub claim: quotas are counted per subject; default: a new "
        "random one, printed on stderr)",
    )
    parser.add_argument("--auth-secret", help=f"the shared secret (env {ENV_SECRET}, preferred)")
    parser.add_argument("--auth-secret-file", help=f"file holding the shared secret (env {ENV_SECRET_FILE})")
    parser.add_argument("--auth-issuer", help=f"issuer (env {ENV_ISSUER}; default {DEFAULT_ISSUER})")
    parser.add_argument("--auth-audience", help=f"audience (env {ENV_AUDIENCE}; default {DEFAULT_AUDIENCE})")
    parser.set_defaults(run=run)


async def run(args: argparse.Namespace) -> int:
    try:
        secret = read_secret(
            args.auth_secret or os.environ.get(ENV_SECRET),
            args.auth_secret_file or os.environ.get(ENV_SECRET_FILE),
        )
        if secret is None:
            raise ValueError(f"no shared secret: set {ENV_SECRET} (or pass --auth-secret-file)")
        subject = args.subject.strip() or new_subject()
        token = mint(
            secret,
            roles=[Role(role) for role in args.role],
            sessions=args.session,
            ttl_s=parse_ttl(args.ttl),
            subject=subject,
            issuer=args.auth_issuer or os.environ.get(ENV_ISSUER) or DEFAULT_ISSUER,
            audience=args.auth_audience or os.environ.get(ENV_AUDIENCE) or DEFAULT_AUDIENCE,
        )
    except (OSError, ValueError) as error:
        print(f"toolmesh token: {error}", file=sys.stderr)
        return EXIT_USAGE
    if not args.subject.strip():
        # Stdout is the token alone (`$(toolmesh token ...)`); what it is counted as goes to stderr.
        print(f"toolmesh token: subject {subject}", file=sys.stderr)
    print(token)
    return 0
