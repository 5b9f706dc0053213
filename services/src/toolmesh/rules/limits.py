"""The limits an operator may set: what each bounds, its default, and how it is read.

Every service takes `--limit name=value` (repeatable) and the environment
variable TOOLMESH_LIMITS ("name=value,name=value"); a flag wins over the
environment. An unknown name or a value that is not a positive whole number is
refused at startup, so that a typo never leaves a limit at its default unseen.
Each service applies the limits that concern it and ignores the others, so one
setting can be given to all of them.

A request over a limit fails with LIMIT_EXCEEDED (INVALID_ARGUMENT, not
retryable: the same request fails again); a quota used up for now fails with
QUOTA_EXCEEDED (RESOURCE_EXHAUSTED, retryable after the RetryInfo delay).
Either way ErrorInfo's metadata names the limit (`limit`) and its value
(`value`), never the offending request's content.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from toolmesh.core.errors import Code, ToolmeshError

ENV_LIMITS = "TOOLMESH_LIMITS"

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True, slots=True)
class Limits:
    """Every limit, with its production default. Field names are the names operators write."""

    # Registry: tools in one session's list.
    tools_per_session: int = 512
    # Registry: bytes of one tool's inputSchema or outputSchema text.
    schema_bytes: int = 256 * KIB
    # Registry: nesting of objects and arrays in one schema.
    schema_depth: int = 32
    # Registry: subschemas a validation may visit per value, counted with every
    # $ref, anyOf, oneOf and allOf expanded (nested anyOf multiply).
    schema_expansion: int = 10_000
    # Registry: bytes of one session's whole tool list as stored.
    registry_bytes_per_session: int = 2 * MIB
    # Registry: bytes of the tool lists one grant (token subject) put, per registry replica.
    registry_bytes_per_grant: int = 64 * MIB
    # Registry: bytes of the tool lists put through one registry replica (OVERLOADED past it).
    registry_bytes: int = 1024 * MIB
    # Registry: watches (WatchTools streams) one grant holds open at once, per registry replica.
    watches_per_grant: int = 1_024
    # Registry: watches open at once on one registry replica (OVERLOADED past it).
    watches: int = 16_384
    # Bridge: host sessions open at once for one session (per bridge replica).
    host_sessions_per_session: int = 64
    # Bridge: host sessions one grant holds open at once, over all its sessions (per replica).
    host_sessions_per_grant: int = 256
    # Bridge: host sessions open at once on one bridge replica (OVERLOADED past it).
    host_sessions: int = 4_096
    # Invocation: calls of one session waiting for their outcome at once (across replicas);
    # as many as one session is built to hold (10,000 held calls, bench "scale").
    calls_in_flight_per_session: int = 10_000
    # Invocation: calls of one grant waiting for their outcome at once, over all its sessions
    # (per replica): a prefix grant's sessions share one grant's places.
    calls_in_flight_per_grant: int = 10_000
    # Invocation: calls waiting for their outcome at once in one replica (OVERLOADED past it);
    # larger than one grant's share, so that one grant cannot reach it alone.
    calls_in_flight: int = 20_000
    # Invocation: calls per second of one token's subject (a token bucket, per replica).
    calls_per_second_per_caller: int = 500
    # Invocation: calls one caller may make at once above its rate (the bucket's size).
    calls_burst_per_caller: int = 1_000
    # Invocation: time one validation of arguments or a result may take, in ms.
    validation_timeout_ms: int = 1_000
    # Invocation: worker processes that validate what cannot be validated at once safely.
    validation_workers: int = 2
    # Invocation: address space of one validation worker, in bytes.
    validation_memory_bytes: int = 1024 * MIB
    # Invocation (and bridge, which records outcomes): seconds an exact retry replays an
    # unconfirmed outcome after it ended, and the same for a TOOL_TIMEOUT (no shorter: the
    # side effect may have happened). Each unconfirmed outcome is kept at least this long.
    replay_window_s: int = 600
    timeout_replay_window_s: int = 600
    # Invocation: seconds after its replay window an exact retry is still refused with
    # RETRY_WINDOW_PASSED (nothing runs) instead of running anew: the identity pointer's
    # extra life (one small key per unconfirmed invocation; its record is kept as long).
    late_retry_notice_s: int = 1_800
    # Every service: bytes of one received gRPC message.
    message_bytes: int = 4 * MIB + 64 * KIB

    def over(self, name: str, detail: str, **metadata: str) -> ToolmeshError:
        """LIMIT_EXCEEDED for the limit `name`: the request can never pass as it is."""
        return ToolmeshError(
            Code.LIMIT_EXCEEDED, detail, {"limit": name, "value": str(getattr(self, name)), **metadata}
        )

    def used_up(self, name: str, detail: str, retry_delay_s: float, **metadata: str) -> ToolmeshError:
        """QUOTA_EXCEEDED for the quota `name`: the same call may pass after `retry_delay_s`."""
        return ToolmeshError(
            Code.QUOTA_EXCEEDED,
            detail,
            {
                "limit": name,
                "value": str(getattr(self, name)),
                "retryDelayMs": str(max(1, round(retry_delay_s * 1000))),
                **metadata,
            },
            retry_delay_s=retry_delay_s,
        )


NAMES: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(Limits))
DEFAULT_LIMITS = Limits()


def parse_settings(texts: Iterable[str]) -> dict[str, int]:
    """`name=value` settings (each text may hold several, comma-separated), later ones winning.

    Raises ValueError naming the first setting that is malformed, unknown or not a positive integer.
    """
    settings: dict[str, int] = {}
    for text in texts:
        for raw in text.split(","):
            item = raw.strip()
            if not item:
                continue
            name, equals, value = item.partition("=")
            name = name.strip().replace("-", "_")
            if not equals:
                raise ValueError(f"limit setting {item!r} is not name=value")
            if name not in NAMES:
                raise ValueError(f"unknown limit {name!r}; known limits: {', '.join(NAMES)}")
            try:
                number = int(value.strip().replace("_", ""))
            except ValueError:
                raise ValueError(f"limit {name} must be a whole number, not {value.strip()!r}") from None
            if number < 1:
                raise ValueError(f"limit {name} must be at least 1, not {number}")
            settings[name] = number
    return settings


def limits_from(flags: Iterable[str] = (), environ: Mapping[str, str] | None = None) -> Limits:
    """The defaults, overridden by TOOLMESH_LIMITS, overridden by the flags. Raises ValueError."""
    environ = os.environ if environ is None else environ
    settings = parse_settings([environ.get(ENV_LIMITS, ""), *flags])
    return dataclasses.replace(DEFAULT_LIMITS, **settings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The --limit flag of every service command and of `toolmesh up`."""
    parser.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"set a limit (repeatable; env {ENV_LIMITS}=name=value,...); names: {', '.join(NAMES)}",
    )


def from_args(args: argparse.Namespace) -> Limits:
    """The limits the --limit flags and the environment set. Raises ValueError when one is unusable."""
    flags: list[str] = args.limit
    return limits_from(flags)
