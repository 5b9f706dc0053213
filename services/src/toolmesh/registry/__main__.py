from toolmesh.assembly.entrypoint import metrics_of, parse_args, run, security_of, stores_of
from toolmesh.assembly.system import start_registry

args = parse_args("registry")
security = security_of(args)
run(
    "registry",
    lambda: start_registry(
        args.listen,
        stores_of(args),
        security=security,
        internal_address=args.internal_listen,
        limits=args.limits,
    ),
    metrics_of(args, security),
)
