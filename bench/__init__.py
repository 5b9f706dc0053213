"""Benchmarks: the cost of a toolmesh tool call against a bare gRPC floor and the MCP SDK.

Run `python -m bench` from the repository root (see bench/README.md).
"""

import sys
from pathlib import Path

# The benchmarks drive the system with the tests' own tools (the browser driver, the fuzzer):
# they live once, in tests/support.
_SUPPORT = str(Path(__file__).resolve().parent.parent / "tests" / "support")
if _SUPPORT not in sys.path:
    sys.path.append(_SUPPORT)
