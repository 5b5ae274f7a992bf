"""A fake torchft Lighthouse for monitor tests: records kill requests, answers like 0.2.0 (500)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeLighthouse:
    def __init__(self, status: int = 500, on_kill=None) -> None:
        self.kills: list[str] = []
        self.status = status
        self.on_kill = on_kill
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                parts = self.path.strip("/").split("/")
                if len(parts) == 3 and parts[0] == "replica" and parts[2] == "kill":
                    outer.kills.append(parts[1])
                    if outer.on_kill:
                        outer.on_kill(parts[1])
                    body = b"Something went wrong: transport error" if outer.status != 200 \
                        else b"ok"
                    self.send_response(outer.status)
                else:
                    body = b"not found"
                    self.send_response(404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                body = b"<html>Lighthouse</html>"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
