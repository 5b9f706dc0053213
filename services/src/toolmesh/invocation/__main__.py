from toolmesh.server.entrypoint import dependency_address, parse_args, run
from toolmesh.server.system import start_invocation

args = parse_args("invocation", ("registry", "bridge"))
run(
    "invocation",
    lambda: start_invocation(
        dependency_address(args, "registry"), dependency_address(args, "bridge"), args.listen
    ),
)
