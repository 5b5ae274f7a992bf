"""waitress stops accepting at its connection limit (100): clients that open connections and
never finish a request (a header line every few seconds keeps its idle timeout away) locked
every new client out of a rank or the monitor for as long as they liked. At the limit the
connection longest without a request served is closed instead (real waitress, real sockets)."""

from __future__ import annotations

import socket

from http_serving import BackgroundWSGIServer
from lightkeeper.processes import wait_until


def hello(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"hello"]


def ask(host: str, port: int) -> bytes:
    """One request on a new connection; b"" when it was not answered within a second."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as c:
            c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return c.recv(64)
    except OSError:
        return b""


def test_clients_that_never_finish_a_request_do_not_lock_others_out():
    server = BackgroundWSGIServer(hello).start()
    held: list[socket.socket] = []
    try:
        for i in range(120):  # past the limit, where waitress stopped accepting
            s = socket.create_connection((server.host, server.port), timeout=5)
            if i % 2:
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            held.append(s)
        wait_until(lambda: ask(server.host, server.port).startswith(b"HTTP/1.1 200"), 15,
                   what="a new client served beside 120 connections asking nothing")
        for _ in range(5):  # and every one after it, at once
            assert ask(server.host, server.port).startswith(b"HTTP/1.1 200")
    finally:
        for s in held:
            s.close()
        server.stop()
