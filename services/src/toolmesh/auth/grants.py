"""What a verified token allows: roles, on the sessions it names.

Plain Python that knows nothing about gRPC or JWT: the policy and the
services ask a Grant (or the session scope it gives) and nothing else.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass

# An exact session id, or a prefix followed by `*` ("*" alone: every session).
SESSION_PATTERN = re.compile(r"[A-Za-z0-9_.:\-]{1,128}|[A-Za-z0-9_.:\-]{0,127}\*")


class Role(enum.StrEnum):
    # Invoke tools, list and watch them, read and confirm the session's invocations.
    CALL = "call"
    # Serve the session's tools (receive its requests, submit results), list and declare them.
    HOST = "host"
    # Put, list and watch the tools of the sessions it names.
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Sessions:
    """A set of session ids: exact ids and prefixes (from patterns ending in `*`)."""

    exact: frozenset[str]
    prefixes: tuple[str, ...]

    @classmethod
    def parse(cls, patterns: Iterable[str]) -> Sessions:
        """Raise ValueError for a pattern that is neither an id nor a prefix ending in `*`."""
        exact: set[str] = set()
        prefixes: list[str] = []
        for pattern in patterns:
            if not isinstance(pattern, str) or not SESSION_PATTERN.fullmatch(pattern):
                raise ValueError("a session is an id or a prefix ending in *")
            if pattern.endswith("*"):
                prefixes.append(pattern[:-1])
            else:
                exact.add(pattern)
        return cls(frozenset(exact), tuple(prefixes))

    def __contains__(self, session_id: object) -> bool:
        if not isinstance(session_id, str):
            return False
        return session_id in self.exact or any(session_id.startswith(p) for p in self.prefixes)


NO_SESSIONS = Sessions(frozenset(), ())


@dataclass(frozen=True, slots=True)
class Grant:
    """The verified claims of one token."""

    subject: str
    roles: frozenset[Role]
    sessions: Sessions
    # Seconds since the epoch, leeway included: the grant is not used after this.
    expires_at: float

    def scope(self, role: Role) -> Sessions:
        """The sessions this grant may act on in `role` (none without the role)."""
        return self.sessions if role in self.roles else NO_SESSIONS
