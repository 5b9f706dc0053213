from toolmesh.assembly.entrypoint import (
    dependency_address,
    metrics_of,
    parse_args,
    run,
    security_of,
    stores_of,
)
from toolmesh.assembly.system import start_invocation

args = parse_args("invocation", ("registry", "bridge"))
security = security_of(args)
run(
    "invocation",
    lambda: start_invocation(
        dependency_address(args, "registry"),
        dependency_address(args, "bridge"),
        args.listen,
        security=security,
        stores=stores_of(args),
        limits=args.limits,
    ),
    metrics_of(args, security),
)
