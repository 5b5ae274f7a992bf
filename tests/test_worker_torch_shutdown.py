"""Stopping torch's debug server (worker_server/torch_server.py ``_shutdown``) on a host where
``::`` binds but ``::1`` is not configured: the first request goes to 127.0.0.1, and the wait
for no Lightkeeper handler to be running keeps its own budget. In-process: a plain HTTP server
stands in for torch's, and a handler is held running through a response that blocks."""

from __future__ import annotations

import http.client
import threading
import time

from lightkeeper.processes import wait_until
from tests.support.http_stub import HttpStub
from worker_server import torch_server


class _BlockingResponse:
    """A torch response whose ``set_content`` holds the handler until ``release`` is set."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def set_content(self, body, content_type):
        self.entered.set()
        self.release.wait(10)

    def set_status(self, status):
        pass


class _Server:
    """torch's ``_WorkerServer`` as ``_shutdown`` uses it."""

    def __init__(self) -> None:
        self.shut_at: float | None = None

    def shutdown(self) -> None:
        self.shut_at = time.monotonic()


def test_a_wildcard_bind_is_stopped_over_ipv4_when_ipv6_loopback_is_missing(monkeypatch):
    connect = http.client.HTTPConnection.connect

    def no_ipv6_loopback(self):
        if self.host == "::1":
            raise OSError(99, "Cannot assign requested address")
        return connect(self)

    monkeypatch.setattr(http.client.HTTPConnection, "connect", no_ipv6_loopback)
    web = HttpStub({"GET": (200, b"")})
    resp = _BlockingResponse()
    handler = torch_server._handler("lightkeeper_state", lambda server, args: (200, b"", "x"))
    busy = threading.Thread(target=handler, args=(None, resp), daemon=True)
    server = _Server()
    stopping = threading.Thread(
        target=torch_server._shutdown, args=(server, "::", web.port), daemon=True)
    try:
        busy.start()
        assert resp.entered.wait(5)  # a Lightkeeper handler is answering
        started = time.monotonic()
        stopping.start()
        wait_until(lambda: len(web.requests) >= 1, 2, interval=0.01,
                   what="the request on 127.0.0.1")
        assert server.shut_at is None  # still waiting for the handler to end
        released = time.monotonic()
        resp.release.set()
        stopping.join(5)
        assert not stopping.is_alive() and server.shut_at is not None
        # it waited for quiet: the handler's end, then QUIET_S (less its 5 ms poll)
        assert server.shut_at - released >= torch_server.QUIET_S - 0.01
        assert server.shut_at - started < 2  # not the 5 s of dialling ::1
    finally:
        resp.release.set()
        web.close()
