from toolmesh.server.entrypoint import parse_args, run
from toolmesh.server.runtime import RunningServer
from toolmesh.server.system import start_bridge


async def _start() -> RunningServer:
    server, _ = await start_bridge(args.listen)
    return server


args = parse_args("bridge")
run("bridge", _start)
