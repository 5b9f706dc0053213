from toolmesh.assembly.entrypoint import (
    add_web_port_arguments,
    metrics_of,
    parse_args,
    run,
    security_of,
    stores_of,
    web_address,
)
from toolmesh.assembly.system import start_registry
from toolmesh.runtime.web import web_hosts, web_origins

# The web port (the registry's reads for pages) is off unless asked for: pages usually reach it
# through `toolmesh up`'s or a proxy's one origin.
args = parse_args("registry", extend=lambda parser: add_web_port_arguments(parser, "off"))
security = security_of(args)
run(
    "registry",
    lambda: start_registry(
        args.listen,
        stores_of(args),
        security=security,
        internal_address=args.internal_listen,
        limits=args.limits,
        web_address=web_address(args),
        web_origins=web_origins(args.web_origins),
        web_hosts=web_hosts(args.web_hosts),
    ),
    metrics_of(args, security),
)
