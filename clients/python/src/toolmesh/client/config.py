"""Where the services are: flags override environment variables, which override local defaults."""

from __future__ import annotations

import os

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORTS = {"registry": 7401, "invocation": 7402, "bridge": 7403}
ENV_VARS = {
    "registry": "TOOLMESH_REGISTRY_ADDR",
    "invocation": "TOOLMESH_INVOCATION_ADDR",
    "bridge": "TOOLMESH_BRIDGE_ADDR",
}


def address(service: str, flag: str | None = None) -> str:
    """The address of `service` ("registry", "invocation" or "bridge"): `flag`, else its variable, else local.

    Raises KeyError for another service name.
    """
    if flag:
        return flag
    return os.environ.get(ENV_VARS[service]) or f"{DEFAULT_HOST}:{DEFAULT_PORTS[service]}"
