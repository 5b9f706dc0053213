"""The benchmark's handler host: `python -m bench.host --bridge ADDR --session S`.

A ToolHost serving bench.handlers, as `toolmesh host --handlers bench.handlers:HANDLERS`
does, with a readiness line of its own on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

from bench import loops
from bench.handlers import HANDLERS
from toolmesh.core import otel
from toolmesh.core.bearer import token_from_env
from toolmesh.core.tls import client_credentials
from toolmesh.host import HostError, ToolHost

READY = "bench host: connected"
# "0": the host runs each request as it reads it, without asking StartToolRequests (for the A/B of
# what start acknowledgements cost: `--ab HEAD --baseline-env BENCH_ACKNOWLEDGE_STARTS=0`).
ACKNOWLEDGE_STARTS = "BENCH_ACKNOWLEDGE_STARTS"
ERROR = "bench host: error"


def _report(error: HostError) -> None:
    print(f"{ERROR} {error.code.value} {error.cause}".rstrip(), file=sys.stderr, flush=True)


async def serve(bridge: str, session: str) -> None:
    # TLS and a token when the environment gives them (TOOLMESH_TLS_CA, TOOLMESH_TOKEN).
    credentials, token = client_credentials(), token_from_env()
    # Named only when asked: a baseline tree older than start acknowledgements has no such argument.
    unacknowledged: dict[str, Any] = (
        {"acknowledge_starts": False} if os.environ.get(ACKNOWLEDGE_STARTS) == "0" else {}
    )
    host = ToolHost(
        bridge, session, host_name="bench", credentials=credentials, token=token, **unacknowledged
    )
    for name, handler in HANDLERS.items():
        host.on_tool(name, handler)
    host.on_error(_report)
    await host.start(timeout=30)
    print(f"{READY} host_session={host.host_session_id}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await host.stop()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.host")
    parser.add_argument("--bridge", required=True)
    parser.add_argument("--session", required=True)
    args = parser.parse_args()
    # As a real host would: its own log at INFO (the SDK logs nothing per successful call).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    otel.configure("toolmesh-host")  # exports only when OTEL_* says where
    try:
        loops.run(serve(args.bridge, args.session))
    finally:
        otel.shutdown()


if __name__ == "__main__":
    main()
