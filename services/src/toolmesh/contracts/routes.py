"""Which bridge replica holds hosts of which session: routes in the shared store, with expiry.

Each bridge replica writes `bridge:route:<session>` = its advertise address
(the internal listener the invocation service can reach) for every session it
holds a host of (toolmesh.bridge.routes), and lets it expire after
ROUTE_TTL_S, so a replica that died stops being named. The invocation service
reads the route to pick the replica to dispatch to (`route_of`).
"""

from __future__ import annotations

from toolmesh.store.base import Store

ROUTE_PREFIX = "bridge:route:"
ROUTE_TTL_S = 10.0
REFRESH_S = 3.0


def route_key(session_id: str) -> str:
    return f"{ROUTE_PREFIX}{session_id}"


async def route_of(store: Store, session_id: str) -> str | None:
    """The address of the bridge replica holding a host of the session, or None."""
    found = await store.get(route_key(session_id))
    return None if found is None else found.value.decode()
