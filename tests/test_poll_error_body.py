"""A rank URL that answers an HTTP error: the monitor keeps its status, never its body. Anyone
who may register names the URL polled, and /v1/ranks (no token) shows the error: the body would
read back any local service's answer. Real HTTP on 127.0.0.1, the Poller on its thread."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from monitor.api.views import ranks_json
from monitor.evidence.view import ViewBuilder
from monitor.poll.discovery import Target
from monitor.poll.poller import Poller

ANSWERS = {
    "404": b"HTTP/1.1 404 Not Found\r\nContent-Length: 6\r\n\r\nsecret",
    "500": b"HTTP/1.1 500 Oops secret\r\nContent-Length: 12\r\n\r\nsecret token",
    "799": b"HTTP/1.1 799 secret\r\nContent-Length: 6\r\n\r\nsecret",
}


@pytest.fixture(scope="module")
def server():
    """A server answering ``/<name>/v1/state`` with ``ANSWERS[name]``: port."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def serve(reader, writer) -> None:
        try:
            while line := await reader.readline():
                while (await reader.readline()) not in (b"\r\n", b""):
                    pass
                writer.write(ANSWERS[line.split()[1].decode().split("/")[1]])
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    srv = asyncio.run_coroutine_threadsafe(asyncio.start_server(serve, "127.0.0.1", 0),
                                           loop).result(10)
    yield srv.sockets[0].getsockname()[1]

    async def stop() -> None:
        srv.close()
        await srv.wait_closed()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_an_http_error_is_kept_as_its_status_without_the_body(server):
    urls = {name: f"http://127.0.0.1:{server}/{name}" for name in ANSWERS}
    poller = Poller(timeout_s=2.0)
    try:
        polls = poller.sweep(urls.values())
    finally:
        poller.close()
    errors = {name: polls[u].error for name, u in urls.items()}
    assert errors == {"404": "HTTP 404 Not Found", "500": "HTTP 500 Internal Server Error",
                      "799": "HTTP 799"}
    assert {polls[u].status for u in urls.values()} == {404, 500, 799}
    assert {polls[u].reason for u in urls.values()} == {"http_status"}

    now = time.time()  # what /v1/ranks serves of them
    targets = [Target(u, "registered") for u in urls.values()]
    view = ViewBuilder().update(targets, polls, now=now, polled=set(urls.values()))
    rows = ranks_json(view, now)
    assert len(rows) == 3 and not any(r["reachable"] for r in rows)
    assert "secret" not in repr(rows)
