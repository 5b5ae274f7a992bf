"""A small HTTP server on 127.0.0.1 standing in for what a test's code talks to (a Lighthouse, a
webhook receiver, Grafana, etcd, a rank): it records every request and answers as told.

``HttpStub(answer)``, ``answer`` one of:
- an :data:`Answer`, given to every request;
- a callable ``(Request) -> Answer``, asked for every request;
- a dict of routes, ``"METHOD /path"`` (the path without its query) or ``"METHOD"`` (any path)
  to an Answer or such a callable; a request no route takes is answered 404.

An Answer is ``(status, body)`` or ``(status, body, headers)``: bytes or str are sent as they
are, anything else as JSON (``Content-Type: application/json`` unless the headers say); the
stub sets ``Content-Length``.
Written on the standard library's server rather than werkzeug's (installed, with Flask):
werkzeug's logs each request through logging, into the ``caplog`` of the tests that read it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlsplit

Answer = tuple[int, Any] | tuple[int, Any, dict[str, str]]


class Request(NamedTuple):
    method: str
    target: str  # as sent: the path and its query
    headers: Message  # case-insensitive ``get``
    body: bytes

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(urlsplit(self.target).query)


class HttpStub:
    """Serves from construction until :meth:`close` (or the ``with`` block's end);
    ``requests``: every request so far, in the order they came."""

    def __init__(self, answer: Answer | Callable[[Request], Answer] | dict) -> None:
        self.answer = answer
        self.requests: list[Request] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = False
        # serve_forever's poll: shutdown() waits for the next one
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                        daemon=True, name="http-stub")
        self._thread.start()

    def respond(self, req: Request) -> Answer:
        answer = self.answer
        if isinstance(answer, dict):
            answer = answer.get(f"{req.method} {req.path}", answer.get(req.method, (404, b"")))
        return answer(req) if callable(answer) else answer

    def close(self) -> None:
        """Stops serving and closes the listening socket; again: nothing."""
        if not self._closed:
            self._closed = True
            self.server.shutdown()
            self.server.server_close()
            self._thread.join()

    def __enter__(self) -> HttpStub:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _handler(stub: HttpStub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _any(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            req = Request(self.command, self.path, self.headers, body)
            stub.requests.append(req)
            status, data, *more = stub.respond(req)
            headers = dict(more[0]) if more else {}
            if not isinstance(data, (bytes, str)):
                data = json.dumps(data)
                headers.setdefault("Content-Type", "application/json")
            data = data.encode() if isinstance(data, str) else data
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any  # noqa: N815 (http.server's)

        def log_message(self, *args) -> None:
            pass

    return Handler
