#!/bin/sh
# The same call from a shell: `greet` in the session `examples` (examples/python_host.py
# serves it), then the invocation looked up again in the ledger by its id.
#   PATH=.venv/bin:$PATH sh examples/cli_call.sh [NAME]
# The addresses come from $TOOLMESH_INVOCATION_ADDR and friends, else the defaults.
set -eu
name=${1:-Ada}
out=$(toolmesh tool-call --session-id examples --tool greet --args "{\"name\": \"$name\"}")
echo "$out"
id=$(printf '%s' "$out" | python3 -c 'import json, sys; print(json.load(sys.stdin)["toolRequestId"])')
toolmesh invocations show "$id"
