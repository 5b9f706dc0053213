"""What the bridge tells operators: the RouterObserver over OpenTelemetry metrics."""

from __future__ import annotations

from toolmesh.bridge.router import HostSession
from toolmesh.core import telemetry

CONNECTED_HOSTS = telemetry.METER.create_up_down_counter(
    "toolmesh.bridge.hosts", unit="{host}", description="Handler hosts connected to this bridge"
)


class RouterTelemetry:
    """The router's observer in every process that serves the bridge."""

    __slots__ = ()

    def host_opened(self, host: HostSession) -> None:
        CONNECTED_HOSTS.add(1)

    def host_closed(self, host: HostSession) -> None:
        CONNECTED_HOSTS.add(-1)
