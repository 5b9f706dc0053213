"""The store errors operators watch: RPCs that failed because the shared store could not be reached.

Counted where an RPC's failure becomes its status, on the gRPC port and the web port
alike, by `rpc.method` (the method's name: a bounded label, the RPCs of the protos).
"""

from __future__ import annotations

from toolmesh.core import telemetry
from toolmesh.core.errors import Code, ToolmeshError

STORE_ERRORS = telemetry.METER.create_counter(
    "toolmesh.store.errors",
    unit="{call}",
    description="RPCs that failed with STORE_UNAVAILABLE (the shared store could not be reached)",
)


def count(method: str, error: ToolmeshError) -> None:
    """Count `error` when it is the store's (`method`: package.Service/Method, or its name alone)."""
    if error.code is Code.STORE_UNAVAILABLE:
        STORE_ERRORS.add(1, {"rpc.method": method.rpartition("/")[2]})
