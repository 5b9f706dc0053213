from toolmesh.server.entrypoint import dependency_address, parse_args, run, stores_of
from toolmesh.server.system import start_invocation

args = parse_args("invocation", ("registry", "bridge"))
run(
    "invocation",
    lambda: start_invocation(
        dependency_address(args, "registry"),
        dependency_address(args, "bridge"),
        args.listen,
        stores=stores_of(args),
    ),
)
