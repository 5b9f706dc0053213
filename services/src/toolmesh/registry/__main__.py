from toolmesh.server.entrypoint import parse_args, run, stores_of
from toolmesh.server.system import start_registry

args = parse_args("registry")
run("registry", lambda: start_registry(args.listen, stores_of(args)))
