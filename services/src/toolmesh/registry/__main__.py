from toolmesh.server.entrypoint import parse_args, run, security_of
from toolmesh.server.system import start_registry

args = parse_args("registry")
security = security_of(args)
run("registry", lambda: start_registry(args.listen, security=security, internal_address=args.internal_listen))
