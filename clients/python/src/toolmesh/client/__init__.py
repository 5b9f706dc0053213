"""Client libraries for callers of toolmesh: invocation and registry."""

from toolmesh.client.invocation import CallResult, InvocationClient
from toolmesh.client.registry import RegistryClient
from toolmesh.client.views import Invocation, InvocationState
from toolmesh.core.progress import ToolProgress

__all__ = [
    "CallResult",
    "Invocation",
    "InvocationClient",
    "InvocationState",
    "RegistryClient",
    "ToolProgress",
]
