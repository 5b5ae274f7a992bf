"""Lightkeeper's read-only endpoints as handlers on torch's own per-rank debug server.

torch (2.10+) serves a C++ ``_WorkerServer`` per rank (``POST /handler/<name>``, ``GET
/handler/`` lists the names; ``torch.distributed.debug.start_debug_server()`` starts one) and
lets Python add handlers with ``torch._C._distributed_c10d._register_handler``. With
``WorkerServer.start(server="torch")`` (``lightkeeper run --worker-server torch``) a rank serves
one port, torch's, with torch's handlers (``ping``, ``fr_trace_json``, ``dump_traceback``, ...)
beside Lightkeeper's:

=========================  ==================================================================
handler                    answers the same bytes as
=========================  ==================================================================
``lightkeeper_state``      ``GET /v1/state`` (``?since=``, ``?recent=``, ``?packed=``)
``lightkeeper_metrics``    ``GET /metrics`` (Prometheus text)
``lightkeeper_stacks``     ``GET /v1/stacks`` (``?format=text|json``)
``lightkeeper_fr_trace``   ``GET /v1/fr_trace`` (``?onlyactive=``, ``?pg=``, ``?last=``)
=========================  ==================================================================

Query arguments go in the URL as with Flask (``POST /handler/lightkeeper_state?recent=16``);
torch cannot tell an empty argument from a missing one, so ``pg=`` reads as no ``pg``. Nothing
that changes state is registered: torch's server checks no token. The rank's URL is spelled
``torch+http://host:port``, which tells the monitor to ask through the handlers.

torch's handler registry is process-wide and cannot be undone, so the handlers are registered
once per process and answer for the WorkerServer serving now (503 when none is). A job that
called ``start_debug_server()`` before the WorkerServer starts shares that server's port;
otherwise Lightkeeper starts a ``_WorkerServer`` of its own on the configured host and port.
At exit either one is stopped before the interpreter shuts down (:func:`_stop_all` says why).
A torch without ``_WorkerServer`` or ``_register_handler`` raises :class:`TorchServerUnavailable`
(the WorkerServer then serves on Flask and says so in one line).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from http_serving import http_url, is_loopback_host

from .endpoints import BadParameter, fr_trace_body, stacks_body, state_body
from .flight_recorder import (
    FlightRecorderBusy,
    FlightRecorderNotAvailable,
    IncarnationTracker,
    fr_dump,
)
from .metrics import WorkerMetrics
from .state import RankState

log = logging.getLogger(__name__)

SCHEME = "torch+http"  # a rank's URL on torch's server: the monitor POSTs to its handlers
PREFIX = "lightkeeper_"
JSON = "application/json"


class TorchServerUnavailable(RuntimeError):
    """torch's server cannot serve Lightkeeper's handlers in this process (the reason)."""


def unavailable() -> str | None:
    """Why torch's server cannot carry Lightkeeper's handlers here (one line), or None."""
    try:
        import torch
        from torch._C import _distributed_c10d as c10d
    except Exception as e:  # no torch, or a torch built without distributed
        return f"torch.distributed is not available ({type(e).__name__}: {e})"
    missing = [n for n in ("_WorkerServer", "_register_handler") if not hasattr(c10d, n)]
    if missing:
        return (f"torch {torch.__version__} has no {' or '.join(missing)} (Python handlers on "
                "torch's WorkerServer need torch 2.10+)")
    return None


class _Args:
    """A torch ``_Request``'s query arguments as :class:`worker_server.endpoints.Params`."""

    __slots__ = ("_req",)

    def __init__(self, req: Any) -> None:
        self._req = req

    def get(self, name: str) -> str | None:
        return self._req.get_param(name) or None


def _error(status: int, message: str, name: str, **extra: Any) -> tuple[int, bytes, str]:
    doc = {"error": message, "status": status, "path": f"/handler/{name}", **extra}
    return status, json.dumps(doc).encode(), JSON


class TorchServer:
    """Lightkeeper's handlers on torch's ``_WorkerServer``; what :class:`~worker_server.server.
    WorkerServer` needs of a server (``port``, ``url``, :meth:`start`, :meth:`stop`).

    Binds now: a port that is taken raises ``OSError``; a torch that cannot raises
    :class:`TorchServerUnavailable`."""

    def __init__(self, state: RankState, tracker: IncarnationTracker, metrics: WorkerMetrics, *,
                 host: str = "127.0.0.1", port: int = 0,
                 fr_dumper: Callable[..., bytes] = fr_dump) -> None:
        reason = unavailable()
        if reason:
            raise TorchServerUnavailable(reason)
        from torch._C import _distributed_c10d as c10d

        self.state, self.tracker, self.metrics, self.fr_dumper = state, tracker, metrics, fr_dumper
        _register(c10d)
        self._own: Any = None
        shared = job_debug_server()
        if shared is not None:  # the job's start_debug_server(): one port for both
            self.port = int(shared.port)
            if is_loopback_host(host):
                from .autostart import say

                say(f"Lightkeeper's handlers are served on the job's torch debug server (port "
                    f"{self.port}), which torch binds to every address, not {host}; its "
                    "handlers, like torch's, answer reads only")
        else:
            try:
                self._own = c10d._WorkerServer(host, port)
            except RuntimeError as e:  # torch says "Error binding to host:port"
                raise OSError(f"torch's WorkerServer cannot bind {host}:{port}: {e}") from None
            self.port = int(self._own.port)
        self.host = host
        self.shared = shared is not None
        _stop_at_exit(self)
        shown = host if host not in ("0.0.0.0", "::", "") else socket.gethostname()
        self.url = http_url(shown, self.port, scheme=SCHEME)

    def start(self) -> TorchServer:
        """Let the handlers answer for this server's rank (the last started wins)."""
        global _serving
        _serving = self
        return self

    def stop(self) -> None:
        """The handlers answer 503 from now; torch's server stops unless it is the job's."""
        global _serving
        if _serving is self:
            _serving = None
        with _lock:
            if self in _at_exit:
                _at_exit.remove(self)
        if self._own is not None:
            own, self._own = self._own, None
            _shutdown(own, self.host, self.port)

    def sent(self, timeout_s: float) -> bool:
        """Wait for the answers written to go out: torch's server shows none of its buffers, so
        SENT_S (at most ``timeout_s``), then True."""
        time.sleep(min(SENT_S, timeout_s))
        return True

    # --- the handlers' bodies: (status, body, content type) ------------------------------
    def state_(self, args: _Args) -> tuple[int, bytes, str]:
        finished = self.state.finished
        body = state_body(self.state, args)
        self.state.state_read(finished)  # torch's server writes it as this returns
        return 200, body, JSON

    def metrics_(self, args: _Args) -> tuple[int, bytes, str]:
        return 200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST

    def stacks_(self, args: _Args) -> tuple[int, bytes, str]:
        body, content_type = stacks_body(self.state, args)
        return 200, body, content_type

    def fr_trace_(self, args: _Args) -> tuple[int, bytes, str]:
        return 200, fr_trace_body(self.state, self.tracker, args, self.fr_dumper), JSON


#: handler name -> the TorchServer method that answers it (read-only endpoints only)
HANDLERS: dict[str, Callable[[TorchServer, _Args], tuple[int, bytes, str]]] = {
    PREFIX + "state": TorchServer.state_,
    PREFIX + "metrics": TorchServer.metrics_,
    PREFIX + "stacks": TorchServer.stacks_,
    PREFIX + "fr_trace": TorchServer.fr_trace_,
}

_serving: TorchServer | None = None  # whose rank the handlers answer for
_registered = False
_lock = threading.Lock()
_in_flight = 0  # Lightkeeper handlers running now (under _lock)
QUIET_S = 0.05  # no handler running this long before torch's shutdown() is called
SENT_S = 0.1  # sent(): torch's server writes an answer as its handler returns


def job_debug_server() -> Any:
    """The ``_WorkerServer`` the job's ``torch.distributed.debug.start_debug_server()`` started,
    or None (the module is not imported here: importing it registers torch's profiler)."""
    debug = sys.modules.get("torch.distributed.debug")
    return getattr(debug, "_WORKER_SERVER", None) if debug is not None else None


def _wait_quiet(deadline: float) -> None:
    """Until no Lightkeeper handler has run for QUIET_S (or ``deadline``). torch's shutdown()
    keeps the GIL while it waits for its server's threads, so a handler running then (or one
    accepted and waiting for the GIL to start) never ends, nor does the process."""
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        with _lock:
            busy = _in_flight
        now = time.monotonic()
        if busy:
            quiet_since = now
        elif now - quiet_since >= QUIET_S:
            return
        time.sleep(0.005)  # lets a handler waiting for the GIL run, and be seen


def _local_addresses(host: str) -> tuple[str, ...]:
    """Where this process reaches a server bound to ``host``. A wildcard bind is dialled on
    127.0.0.1 first: torch's ``::`` bind takes IPv4 too (unless V6ONLY), and ``::1`` is not
    configured on every host."""
    if host in ("0.0.0.0", ""):
        return ("127.0.0.1",)
    if host == "::":
        return ("127.0.0.1", "::1")
    return (host,)


def _answered(addresses: tuple[str, ...], port: int) -> bool:
    """One request answered on one of ``addresses``."""
    import http.client

    for address in addresses:
        try:
            conn = http.client.HTTPConnection(address, port, timeout=0.5)
            try:
                conn.request("GET", "/")
                conn.getresponse().read()
                return True
            finally:
                conn.close()
        except OSError:
            continue
    return False


def _shutdown(server: Any, host: str, port: int, timeout_s: float = 5.0) -> None:
    """``server.shutdown()``, bounded. torch's shutdown waits forever when it comes before the
    server's thread has begun to accept (torch 2.13), so one request is answered first, and
    holds the GIL, so it is called only once no Lightkeeper handler runs (:func:`_wait_quiet`).
    The request, the quiet wait and the shutdown each get ``timeout_s``: a request that never
    gets through must not leave the quiet wait no time."""
    addresses = _local_addresses(host)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not _answered(addresses, port):
        time.sleep(0.02)  # the server's thread has not begun to accept yet

    def stop() -> None:
        try:
            server.shutdown()
        except RuntimeError as e:  # stopped already: torch raises on a second shutdown
            log.debug("torch's WorkerServer on port %d: %s", port, e)

    done = threading.Thread(target=stop, name="lightkeeper-torch-server-stop", daemon=True)
    # last: a handler may have begun while the first request was answered
    _wait_quiet(time.monotonic() + timeout_s)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        log.warning("torch's WorkerServer on port %d did not stop within %.0fs", port, timeout_s)


_at_exit: list[TorchServer] = []  # servers to stop before the interpreter shuts down
_exit_hook = False
_served_shared = False  # handlers were served on the job's start_debug_server()


def _stop_at_exit(server: TorchServer) -> None:
    global _exit_hook, _served_shared
    with _lock:
        if not _exit_hook:
            atexit.register(_stop_all)
            _exit_hook = True
        _at_exit.append(server)
        _served_shared = _served_shared or server.shared


def _stop_all() -> None:
    """At exit, before the interpreter shuts down: stop torch's server, the job's too. A handler
    thread that asks for the GIL while Python shuts down is ended inside torch's C++ and aborts
    the process ("FATAL: exception not rethrown", torch 2.13); the monitor polls every second,
    so without this a job that finished would exit with a signal."""
    global _serving
    _serving = None
    for server in list(_at_exit):
        server.stop()
    shared = job_debug_server()
    if shared is not None and _served_shared:  # the job has not stopped it
        _shutdown(shared, "::", int(shared.port))


def _server_fds(port: int) -> list[int]:
    """This process's descriptors of TCP sockets whose local port is ``port``: the listening
    socket and the connections it accepted (Linux; elsewhere none). Read from /proc only:
    wrapping a descriptor in a Python socket could change its flags, which the parent shares."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows, None)  # the header
                for row in rows:
                    # sl, local address:port (hex), remote, state, ..., inode; a connection this
                    # process dialled to the port has it as its remote port, and is kept
                    f = row.split()
                    if len(f) > 9 and int(f[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f"socket:[{f[9]}]")
        except (OSError, ValueError):
            continue
    found = []
    if inodes:
        try:
            fds = os.listdir("/proc/self/fd")
        except OSError:
            return []
        for fd in fds:
            try:
                if os.readlink(f"/proc/self/fd/{fd}") in inodes:
                    found.append(int(fd))
            except OSError:  # closed since listed (the listing's own descriptor)
                continue
    return found


def _forked() -> None:
    """A fork's child (a DataLoader worker) serves none of its parent's torch servers: it closes
    its copies of their listening sockets, else the port stays bound while it lives and a rank
    restarted meanwhile cannot bind it, and of the connections they accepted, else a dead rank's
    client (the monitor's kept-alive poll) waits for an answer instead of reading the close. No
    lock is taken: one held by another thread at the fork is held for good in the child."""
    global _serving, _lock, _in_flight, _served_shared
    owned = [server for server in _at_exit if server._own is not None]
    _at_exit.clear()
    # its exit stops neither those nor the job's own (start_debug_server()): a shutdown() of a
    # copy shuts the parent's socket, and the parent's server thread aborts the rank
    _serving, _lock, _in_flight, _served_shared = None, threading.Lock(), 0, False
    for server in owned:
        # the parent's C++ server must never be destroyed here (its threads are not in this
        # process): the child keeps one reference for good
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(server._own))
        server._own = None
        for fd in _server_fds(server.port):
            try:
                os.close(fd)
            except OSError:
                pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _handler(name: str, answer: Callable[[TorchServer, _Args], tuple[int, bytes, str]]):
    def handle(req: Any, resp: Any) -> None:
        global _in_flight
        with _lock:
            _in_flight += 1
        try:
            _answer(req, resp)
        finally:
            with _lock:
                _in_flight -= 1

    def _answer(req: Any, resp: Any) -> None:
        server = _serving
        if server is not None:  # torch's request has no headers: the monitor's polls wait too
            server.metrics.pace()
        started = time.thread_time()
        try:
            if server is None:
                status, body, content_type = _error(
                    503, "no Lightkeeper WorkerServer is serving in this process", name)
            else:
                status, body, content_type = answer(server, _Args(req))
        except BadParameter as e:
            status, body, content_type = _error(400, str(e), name)
        except FlightRecorderNotAvailable as e:  # this torch has no such call: not a failure
            status, body, content_type = _error(501, str(e), name, torch=e.torch_version,
                                                missing=e.missing)
        except FlightRecorderBusy as e:  # as on Flask; torch's response sets no Retry-After
            status, body, content_type = _error(503, str(e), name)
        except Exception as e:
            # one line: a monitor polling a failing handler must not fill the job's log
            log.error("handler %s failed: %s: %s", name, type(e).__name__, e)
            status, body, content_type = _error(500, f"{type(e).__name__}: {e}", name)
        resp.set_content(body, content_type)
        resp.set_status(status)
        if server is not None:  # what serving costs this process, as on Flask
            server.metrics.served(time.thread_time() - started)

    handle.__name__ = name
    return handle


def _register(c10d: Any) -> None:
    """Register Lightkeeper's handlers with torch, once per process."""
    global _registered
    with _lock:
        if _registered:
            return
        for name, answer in HANDLERS.items():
            handle = _handler(name, answer)
            # torch's registry lives until the C++ runtime exits, after the interpreter: it must
            # never free a handler then (no GIL: "Fatal Python error", exit status 134), so the
            # handler keeps one reference for good
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(handle))
            try:
                c10d._register_handler(name, handle)
            except ValueError as e:  # "already registered": another copy of this module
                raise TorchServerUnavailable(f"torch's handler {name!r}: {e}") from None
        _registered = True
