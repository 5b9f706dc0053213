import argparse

from toolmesh.bridge.web import DEFAULT_WEB_PORT, add_web_arguments, web_origins
from toolmesh.server.entrypoint import dependency_address, parse_args, run, security_of
from toolmesh.server.runtime import RunningServer
from toolmesh.server.system import start_bridge


def _extend(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--web-listen",
        default=f"127.0.0.1:{DEFAULT_WEB_PORT}",
        help="address of the port for pages, Connect and gRPC-Web (default %(default)s; 'off' serves none)",
    )
    add_web_arguments(parser)


async def _start() -> RunningServer:
    server, _ = await start_bridge(
        args.listen,
        registry_target=dependency_address(args, "registry"),
        web_address=None if args.web_listen == "off" else args.web_listen,
        web_origins=web_origins(args.web_origins),
        security=security,
        internal_address=args.internal_listen,
    )
    return server


args = parse_args("bridge", ("registry",), _extend)
security = security_of(args)
run("bridge", _start)
