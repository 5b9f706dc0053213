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
from toolmesh.assembly.system import start_invocation
from toolmesh.runtime.web import web_hosts, web_origins

# The web port (the caller RPCs for pages) is off unless asked for: pages usually reach it
# through `toolmesh up`'s or a proxy's one origin.
args = parse_args("invocation", ("registry", "bridge"), lambda parser: add_web_port_arguments(parser, "off"))
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
        web_address=web_address(args),
        web_origins=web_origins(args.web_origins),
        web_hosts=web_hosts(args.web_hosts),
    ),
    metrics_of(args, security),
)
