"""A host process that runs requests as it reads them (acknowledge_starts=False), as hosts did
before start acknowledgements; ledger_handlers' handlers. `python plain_host.py BRIDGE SESSION`:
logs "host ready" (JSON, on stderr) once connected, serves until SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import sys

from ledger_handlers import HANDLERS

from toolmesh.host import ToolHost


async def main(bridge_target: str, session_id: str) -> None:
    host = ToolHost(bridge_target, session_id, acknowledge_starts=False)
    for name, handler in HANDLERS.items():
        host.on_tool(name, handler)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await host.start()
    ready = {"msg": "host ready", "host_session_id": host.host_session_id}
    print(json.dumps(ready), file=sys.stderr, flush=True)
    await stop.wait()
    await host.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
