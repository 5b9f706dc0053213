"""Durable claims: the ledger's claim and finish wait for a replica before the call goes on.

A Redis primary acknowledges a write before its replicas have it. If the
primary fails over in between, the promoted replica never saw the claim, and
the exact retry that follows claims again: the tool runs twice. With durable
claims the claim and finish scripts are followed, on the same connection and in
the same write, by `WAIT 1 <ms>`: the call goes on only once one replica has
the claim (or, for a finish, its outcome).

Chosen in the store URL: `?durable=on|off|auto` and `durable_wait_ms=<ms>`
(how long WAIT waits; default 500). `auto`, the default, is on for a Redis
Cluster's primary that has a replica not failed (as it says, asked again every
few seconds), off on one Redis (a single primary with replicas says
`durable=on`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

DURABLE = "durable"
DURABLE_WAIT_MS = "durable_wait_ms"
DEFAULT_WAIT_MS = 500
# WAIT must answer well before the reply timeout (toolmesh.store.redis.REPLY_TIMEOUT_S, 2 s), or
# that would fail it as an unreachable store.
MAX_WAIT_MS = 1000


class Mode(enum.Enum):
    ON = "on"
    OFF = "off"
    AUTO = "auto"


@dataclass(frozen=True)
class Durability:
    mode: Mode = Mode.AUTO
    wait_ms: int = DEFAULT_WAIT_MS

    def wait_command(self) -> tuple[str, int, int]:
        """The command after a claim or finish: return once one replica has this connection's writes."""
        return ("WAIT", 1, self.wait_ms)


class NotReplicated(Exception):
    """The script ran on the primary, but no replica confirmed it within the wait: a failover now
    could lose it. `reply` is the script's reply."""

    def __init__(self, reply: Any) -> None:
        super().__init__("no replica confirmed the write in time")
        self.reply = reply


def split_durability(url: str) -> tuple[str, Durability]:
    """The URL without the durability parameters, and the durability they ask for.

    ValueError for a mode other than on, off or auto, or a wait outside 1..MAX_WAIT_MS.
    """
    parts = urlsplit(url)
    if not parts.query:
        return url, Durability()
    kept: list[tuple[str, str]] = []
    mode, wait_ms = Mode.AUTO, DEFAULT_WAIT_MS
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name == DURABLE:
            try:
                mode = Mode(value)
            except ValueError:
                raise ValueError(f"{DURABLE} is on, off or auto") from None
        elif name == DURABLE_WAIT_MS:
            if not value.isdigit() or not 1 <= int(value) <= MAX_WAIT_MS:
                raise ValueError(f"{DURABLE_WAIT_MS} is a whole number of ms from 1 to {MAX_WAIT_MS}")
            wait_ms = int(value)
        else:
            kept.append((name, value))
    return urlunsplit(parts._replace(query=urlencode(kept))), Durability(mode, wait_ms)
