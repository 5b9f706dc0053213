"""Serve the example page and run toolmesh next to it: `./scripts/example-page` (see README).

The services listen on their usual local ports (registry 7401, invocation 7402,
bridge 7403, pages 7404), so `toolmesh tool-call` works with no flags; the
bridge allows exactly the page's origin.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from toolmesh.assembly.system import start_local_system
from toolmesh.runtime.server import serve_until_signalled

HERE = Path(__file__).resolve().parent
BUILT = HERE.parent / "build" / "example"


class Files(SimpleHTTPRequestHandler):
    """index.html from this folder, app.js (and its map) from the bundle."""

    def translate_path(self, path: str) -> str:
        name = path.split("?", 1)[0].lstrip("/") or "index.html"
        folder = HERE if name == "index.html" else BUILT
        return str(folder / Path(name).name)

    def log_message(self, format: str, *args: object) -> None:
        pass


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8080, help="the page's port (default %(default)s)")
    args = parser.parse_args()
    origin = f"http://127.0.0.1:{args.port}"
    pages = ThreadingHTTPServer(("127.0.0.1", args.port), functools.partial(Files))
    threading.Thread(target=pages.serve_forever, daemon=True).start()
    system = await start_local_system(
        registry_port=7401, invocation_port=7402, bridge_port=7403, web_port=7404, web_origins=[origin]
    )
    print(f"Open {origin}/ and call its tools, e.g.:")
    print('  toolmesh tool-call --thread-id demo --tool add_note --args \'{"text": "buy milk"}\'')
    print("Press Ctrl-C to stop.", flush=True)
    try:
        await serve_until_signalled(system.servers, grace=1.0)
    finally:
        pages.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
