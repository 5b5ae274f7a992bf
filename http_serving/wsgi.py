"""A WSGI app served by waitress from a daemon thread, with a clean stop.

Shared by the WorkerServer and the monitor. waitress has no stop API for a server running in
another thread: closing its sockets under its select() loop makes the loop fail with EBADF. Here
that failure, once a stop was asked for, is the expected way out of the loop; any other error
still surfaces.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import weakref

from waitress.server import create_server

from .urls import http_url

# Both servers take only small JSON bodies (a fault spec, a registration): anything larger is
# refused by waitress with 413 before it is buffered (waitress' own default is 1 GiB).
MAX_REQUEST_BODY = 64 * 1024
# "Task queue depth is N" under a burst of polls is waitress' own matter, not the job's log
logging.getLogger("waitress.queue").setLevel(logging.ERROR)
_BOUND: weakref.WeakSet = weakref.WeakSet()  # this process's servers


def _forked() -> None:
    """A fork's child (a DataLoader worker) serves none of its parent's servers: it closes its
    copies of their sockets, else the port stays bound, answering nothing, while it lives."""
    for server in list(_BOUND):
        for dispatcher in list(server._server._map.values()):
            if isinstance(dispatcher.socket, socket.socket):
                dispatcher.socket.close()
    _BOUND.clear()


os.register_at_fork(after_in_child=_forked)


class BackgroundWSGIServer:
    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 0, threads: int = 4,
                 name: str = "lightkeeper-http",
                 max_request_body_size: int = MAX_REQUEST_BODY) -> None:
        """Bind now (raises ``OSError`` when the address is taken, ``ValueError`` when it is no
        address; both naming it); serve after :meth:`start`."""
        try:
            self._server = create_server(app, host=host, port=port, threads=threads, ident=name,
                                         clear_untrusted_proxy_headers=True,
                                         # select() fails on a descriptor past 1023 and ends
                                         # the server: a rank's job or a monitor's pool has more
                                         asyncore_use_poll=True,
                                         max_request_body_size=max_request_body_size)
        except OSError as e:
            raise OSError(e.errno, f"cannot bind {http_url(host, port)}: {e.strerror or e}") \
                from None
        except ValueError as e:  # waitress: "Invalid host/port specified."
            raise ValueError(f"cannot bind {host!r} port {port}: {e}") from None
        self.host = host
        self.port = int(self._server.effective_port)
        # every address: the name others reach it by; an IPv6 literal is bracketed
        shown = host if host not in ("0.0.0.0", "::", "") else socket.gethostname()
        self.url = http_url(shown, self.port)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        _BOUND.add(self)

    def _run(self) -> None:
        try:
            self._server.run()
        except (OSError, ValueError):
            if not self._stopping.is_set():
                raise
        finally:
            self._server.task_dispatcher.shutdown()

    def start(self) -> BackgroundWSGIServer:
        if not self._thread.is_alive() and not self._stopping.is_set():
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            # Closed from the loop's own thread (woken through waitress' trigger), the loop finds
            # its map empty and returns at once; closed from here, under its select(), it sat out
            # the select's timeout (1 s) first.
            try:
                self._server.trigger.pull_trigger(self._close_sockets)
            except OSError:  # the trigger is gone: close from here, as below
                pass
            self._thread.join(timeout=timeout)
        self._close_sockets()  # never started, or the loop did not get to it: close from here

    def _close_sockets(self) -> None:
        self._server.close()
        for channel in list(self._server._map.values()):  # open client connections
            try:
                channel.close()
            except OSError:
                pass
