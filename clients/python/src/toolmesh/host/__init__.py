"""The handler-host SDK: serve a session's tools from application code."""

from toolmesh.host.context import Cancellation, ToolContext
from toolmesh.host.host import BridgeUnreachable, HostError, ToolHost

__all__ = ["BridgeUnreachable", "Cancellation", "HostError", "ToolContext", "ToolHost"]
