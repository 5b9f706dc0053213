"""The assistant example's server: the page, and a same-origin relay to the model endpoint.

The page posts chat-completions requests to /v1/chat/completions on its own
origin; the relay forwards them to the provider with the key added here, so
the key never reaches the page. Python's standard library only:

    OPENAI_API_KEY=... ./scripts/assistant-example-page          # https://api.openai.com/v1
    TOOLMESH_MODEL_URL=http://127.0.0.1:11434/v1 ./scripts/assistant-example-page   # e.g. a local server

Settings: TOOLMESH_MODEL_URL (the upstream base), OPENAI_API_KEY (sent as a
bearer token, when set), TOOLMESH_MODEL (the model name the page is told).
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILT = HERE.parent.parent / "build" / "assistant-example"
MAX_BODY = 4 * 1024 * 1024


class Relay(SimpleHTTPRequestHandler):
    """GET: index.html, app.js and /config.json; POST /v1/chat/completions: the relay."""

    upstream = os.environ.get("TOOLMESH_MODEL_URL", "https://api.openai.com/v1").rstrip("/")
    key = os.environ.get("OPENAI_API_KEY", "")
    model = os.environ.get("TOOLMESH_MODEL", "gpt-4o-mini")

    def translate_path(self, path: str) -> str:
        name = path.split("?", 1)[0].lstrip("/") or "index.html"
        folder = HERE if name == "index.html" else BUILT
        return str(folder / Path(name).name)

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] == "/config.json":
            self._send(200, json.dumps({"url": "/v1", "model": self.model}).encode())
            return
        super().do_GET()

    def do_POST(self) -> None:
        if self.path != "/v1/chat/completions":
            self._send(404, b'{"error": "not found"}')
            return
        length = int(self.headers.get("content-length", "0"))
        if length > MAX_BODY:
            self._send(413, b'{"error": "too large"}')
            return
        body = self.rfile.read(length)
        headers = {"content-type": "application/json"}
        if self.key:
            headers["authorization"] = f"Bearer {self.key}"
        request = urllib.request.Request(f"{self.upstream}/chat/completions", body, headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                self._send(response.status, response.read())
        except urllib.error.HTTPError as failed:
            self._send(failed.code, failed.read())
        except OSError as failed:
            self._send(502, json.dumps({"error": f"upstream unreachable: {type(failed).__name__}"}).encode())

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=8081, help="the page's port (default %(default)s)")
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Relay)
    print(f"Open http://127.0.0.1:{args.port}/ (model relay to {Relay.upstream}). Ctrl-C stops.", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()
