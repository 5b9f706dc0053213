import argparse
import os

from toolmesh.assembly.entrypoint import (
    add_web_port_arguments,
    dependency_address,
    metrics_of,
    parse_args,
    run,
    security_of,
    stores_of,
    web_address,
)
from toolmesh.assembly.system import start_bridge
from toolmesh.bridge.web import DEFAULT_WEB_PORT, web_hosts, web_origins
from toolmesh.runtime.server import RunningServer
from toolmesh.store.backends import MEMORY, store_url

ADVERTISE_ENV = "TOOLMESH_ADVERTISE_ADDR"


def _extend(parser: argparse.ArgumentParser) -> None:
    add_web_port_arguments(parser, f"127.0.0.1:{DEFAULT_WEB_PORT}")
    parser.add_argument(
        "--advertise",
        help="this replica's internal listener address as invocation replicas reach it, written in "
        f"the routes of its sessions in a shared store (env {ADVERTISE_ENV}, default --internal-listen)",
    )


async def _start() -> RunningServer:
    server, _ = await start_bridge(
        args.listen,
        registry_target=dependency_address(args, "registry"),
        web_address=web_address(args),
        web_origins=web_origins(args.web_origins),
        web_hosts=web_hosts(args.web_hosts),
        security=security,
        internal_address=args.internal_listen,
        # Routes only matter where invocation replicas can read them: a shared store.
        stores=None if store_url(args.store) == MEMORY else stores_of(args),
        advertise=args.advertise or os.environ.get(ADVERTISE_ENV),
        limits=args.limits,
    )
    return server


args = parse_args("bridge", ("registry",), _extend)
security = security_of(args)
run("bridge", _start, metrics_of(args, security))
