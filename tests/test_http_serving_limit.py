"""waitress stops accepting at its connection limit (100): clients that open connections and
never finish a request (a header line every few seconds keeps its idle timeout away) locked
every new client out of a rank or the monitor for as long as they liked. At the limit the
connection longest without a request served is closed instead (real waitress, real sockets)."""

from __future__ import annotations

import socket

from http_serving import BackgroundWSGIServer, wsgi
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


def big(environ, start_response):
    start_response("200 OK", [("Content-Type", "application/octet-stream")])
    if environ["PATH_INFO"] == "/big":
        return (bytes(1 << 20) for _ in range(24))  # past waitress' 16 MiB high watermark
    return [b"hello"]


def test_a_client_that_asks_a_large_answer_and_never_reads_does_not_hold_a_thread(monkeypatch):
    """An answer its client does not read fills waitress' buffers past its high watermark,
    where the task's thread waited for the client for ever: a few such connections held every
    thread and the server answered no one (one thread here: the next client waits on it)."""
    monkeypatch.setattr(wsgi, "WRITE_STALL_S", 1.0)
    server = BackgroundWSGIServer(big, threads=1).start()
    stalled = socket.socket()
    try:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect((server.host, server.port))
        stalled.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        stalled.settimeout(10)
        assert stalled.recv(1, socket.MSG_PEEK)  # its answer began: the one thread is on it
        wait_until(lambda: ask(server.host, server.port).startswith(b"HTTP/1.1 200"), 15,
                   what="a new client served beside a connection that stopped reading")
        got = 0
        while chunk := stalled.recv(1 << 20):  # what its buffers held, then the close
            got += len(chunk)
        assert got < 24 << 20
    finally:
        stalled.close()
        server.stop()


def test_sent_says_whether_every_answer_went_out_to_its_socket():
    """``sent()`` (a rank's clean end waits on it before the process exits): False while an
    answer its client does not read is still in waitress' buffers, True once it was read."""
    server = BackgroundWSGIServer(big).start()
    reader = socket.socket()
    try:
        assert server.sent(0.0)  # nothing asked
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect((server.host, server.port))
        reader.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reader.settimeout(10)
        assert reader.recv(1, socket.MSG_PEEK)  # its answer began, most of it buffered
        assert not server.sent(0.3)
        got = 0
        while chunk := reader.recv(1 << 20):
            got += len(chunk)
        assert got > 24 << 20  # the whole answer, headers included
        assert server.sent(5.0)
    finally:
        reader.close()
        server.stop()
