"""Fair shares of a process-wide bound: what one grant may hold of it, and the bound itself.

Every bound on what a process holds at once (calls waiting in the invoker, host
sessions in the bridge, watches and stored tool lists in the registry) is also
bounded per grant, so that one tenant at its share leaves the rest to the
others. The grant key is the token's subject (`sub`, which every token must
carry when authentication is on): every session a subject's tokens name, one
by one or by a prefix (`bravo*`), counts against the same share. Without a
grant (no authentication, or a toolmesh service on the internal listener)
only the process-wide bound applies.

At its share a grant gets QUOTA_EXCEEDED (retryable, ErrorInfo naming the
per-grant limit and its value); past the process-wide bound, which is larger
than one share by default so that one grant cannot reach it alone, everyone
gets OVERLOADED (the last defence). Plain Python: each service counts what it
holds in its own memory (per replica).
"""

from __future__ import annotations

from toolmesh.core.errors import Code, ToolmeshError
from toolmesh.rules.limits import Limits


class Shares:
    """How much of one process-wide bound (`total_limit`) each grant holds (`per_grant_limit`)."""

    def __init__(
        self,
        limits: Limits,
        total_limit: str,
        per_grant_limit: str,
        *,
        what: str,
        retry_delay_s: float = 1.0,
        total: int | None = None,
    ) -> None:
        """`what`: what is counted, for messages ("calls waiting for their outcome");
        `total`: the process-wide bound when not `limits`' own (a caller's explicit setting)."""
        self._limits = limits
        self._total_limit = total_limit
        self._per_grant_limit = per_grant_limit
        self.total_bound: int = getattr(limits, total_limit) if total is None else total
        self.grant_bound: int = getattr(limits, per_grant_limit)
        self._what = what
        self._retry_delay_s = retry_delay_s
        self.held = 0
        self._by_grant: dict[str, int] = {}

    def held_by(self, grant: str | None) -> int:
        return 0 if grant is None else self._by_grant.get(grant, 0)

    def take(self, grant: str | None, amount: int = 1) -> None:
        """Count `amount` more held by `grant` (None: no grant); QUOTA_EXCEEDED past the grant's
        share, OVERLOADED past the process-wide bound. Nothing is counted when refused."""
        if grant is not None:
            holds = self._by_grant.get(grant, 0)
            if holds + amount > self.grant_bound:
                raise self._limits.used_up(
                    self._per_grant_limit,
                    f"The token's subject holds as many {self._what} as one grant may.",
                    self._retry_delay_s,
                )
        if self.held + amount > self.total_bound:
            raise ToolmeshError(
                Code.OVERLOADED,
                f"The process holds as many {self._what} as it may.",
                {"limit": self._total_limit, "value": str(self.total_bound)},
            )
        self.held += amount
        if grant is not None:
            self._by_grant[grant] = self._by_grant.get(grant, 0) + amount

    def give_back(self, grant: str | None, amount: int = 1) -> None:
        """Count `amount` less held by `grant` (what `take` counted)."""
        self.held = max(0, self.held - amount)
        if grant is not None:
            left = self._by_grant.get(grant, 0) - amount
            if left > 0:
                self._by_grant[grant] = left
            else:
                self._by_grant.pop(grant, None)
