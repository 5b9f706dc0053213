from toolmesh.server.entrypoint import parse_args, run, security_of
from toolmesh.server.runtime import RunningServer
from toolmesh.server.system import start_bridge


async def _start() -> RunningServer:
    server, _ = await start_bridge(args.listen, security=security, internal_address=args.internal_listen)
    return server


args = parse_args("bridge")
security = security_of(args)
run("bridge", _start)
