"""A WSGI app served by waitress from a daemon thread, with a clean stop.

Shared by the WorkerServer and the monitor. waitress has no stop API for a server running in
another thread: closing its sockets under its select() loop makes the loop fail with EBADF. Here
that failure, once a stop was asked for, is the expected way out of the loop; any other error
still surfaces.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
import weakref

from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer, create_server
from waitress.task import WSGITask

from .urls import http_url

# Both servers take only small JSON bodies (a fault spec, a registration): anything larger is
# refused by waitress with 413 before it is buffered (waitress' own default is 1 GiB).
MAX_REQUEST_BODY = 64 * 1024
# waitress copies an answer past this (its default: 1 MiB) to a temp file: a read-only root fails
# it (logged), and a rank's dump goes to disk inside training. Above a rank's usual answers (a
# dump of 2x2,000 entries ~2 MB, the 4 MiB probe payload); not above the largest dump: each
# reader that stops reading keeps its answer in memory (up to the 100 connections waitress
# takes), so a larger dump still spills, and fails without a writable temp dir.
OUTBUF_OVERFLOW = 8 << 20
# "Task queue depth is N" under a burst of polls is waitress' own matter, not the job's log
logging.getLogger("waitress.queue").setLevel(logging.ERROR)
_BOUND: weakref.WeakSet = weakref.WeakSet()  # this process's servers
# environ key: ``environ[HOLD_RESPONSE](seconds)`` sends this response only that much later
HOLD_RESPONSE = "lightkeeper.hold_response"


def _forked() -> None:
    """A fork's child (a DataLoader worker) serves none of its parent's servers: it closes its
    copies of their sockets, else the port stays bound, answering nothing, while it lives."""
    for server in list(_BOUND):
        for dispatcher in list(server._server._map.values()):
            if isinstance(dispatcher.socket, socket.socket):
                dispatcher.socket.close()
    _BOUND.clear()


os.register_at_fork(after_in_child=_forked)

# an address this host does not have (::1 where IPv6 is off): the next one the name resolves to
_NOT_HERE = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to the first address ``host`` resolves to that this host has. waitress
    binds every address a name resolves to (localhost: ::1 and 127.0.0.1), each on a port of its
    own when ``port`` is 0, and returns a server with no one port: one socket, one port."""
    try:
        port = int(port)
        if not 0 <= port <= 65535:
            raise ValueError("not a port (0-65535)")
        # waitress' spelling of an IPv6 literal is accepted too
        name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        infos = socket.getaddrinfo(name, port, socket.AF_UNSPEC, socket.SOCK_STREAM,
                                   socket.IPPROTO_TCP, socket.AI_PASSIVE)
    except (OSError, ValueError, UnicodeError) as e:  # gaierror: not a name, nor an address
        raise ValueError(f"cannot bind {host!r} port {port}: {e}") from None
    error: OSError | None = None
    for family, socktype, proto, _, address in infos:
        try:
            sock = socket.socket(family, socktype, proto)
        except OSError as e:
            error = e
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as waitress
            if family == socket.AF_INET6 and address[0] == "::":
                # every address, IPv4 too (as 0.0.0.0 and :: together): a rank registers by its
                # host name, which the monitor polls at its IPv4 address when it has one
                with contextlib.suppress(OSError):  # no dual-stack here: IPv6 only, as before
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                try:
                    sock.bind(address)
                    return sock
                except OSError as e:
                    if e.errno != errno.EADDRINUSE:
                        raise
                # the port on IPv4 is another process's (ssh -4 -L, docker-proxy): IPv6 is still
                # served, as before dual-stack, rather than nothing
                sock.close()
                sock = socket.socket(family, socktype, proto)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                logging.getLogger(__name__).warning(
                    "%s: port %d on IPv4 is another process's: served on IPv6 only",
                    http_url(host, port), port)
                return sock
            if family == socket.AF_INET6:  # as waitress: IPv6 only, the IPv4 one is another
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            return sock
        except OSError as e:
            sock.close()
            error = e
            if e.errno not in _NOT_HERE:
                break
    assert error is not None  # getaddrinfo answers an address or raises
    raise OSError(error.errno, f"cannot bind {http_url(host, port)}: {error.strerror or error}")


class _Task(WSGITask):
    def get_environment(self):
        environ = super().get_environment()
        environ[HOLD_RESPONSE] = self.channel.hold
        self.channel.served_at = time.monotonic()
        return environ


class _Channel(HTTPChannel):
    """A connection whose response can be held back without holding a thread: a client that
    loops on a refusal (429) then asks once per hold, however fast it loops, and the thread that
    answered it serves others meanwhile."""

    task_class = _Task
    _hold_until = 0.0
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.served_at = time.monotonic()  # when its last request began to be served, or now

    def hold(self, seconds: float) -> None:
        self._hold_until = time.monotonic() + seconds
        # the server's loop sees the hold end when it wakes: at the end, not up to its poll's
        # timeout (1 s) later
        waker = threading.Timer(seconds, self._wake)
        waker.daemon = True
        try:
            waker.start()
        except RuntimeError:  # no thread left: the loop's poll timeout (1 s) ends the hold
            pass

    def _wake(self) -> None:
        if self.connected:  # a server stopped since closed its connections and its trigger
            try:
                self.server.pull_trigger()
            except OSError:
                pass

    def _held(self) -> bool:
        # a connection closing anyway goes now; nothing is read from it while its answer waits
        return not self.will_close and time.monotonic() < self._hold_until

    def writable(self):
        return not self._held() and super().writable()

    def _flush_some(self, do_close=True):
        # the task's thread flushes too, as it writes: the hold holds there as well
        return False if self._held() else super()._flush_some(do_close=do_close)

    def _flush_outbufs_below_high_watermark(self):
        """waitress' wait, on the task's thread, for the client to read its answers down below
        the high watermark, but not forever: clients pipelining large answers and never reading
        held every thread, and the rank answered no one, its monitor included. A client that
        reads nothing for WRITE_STALL_S loses its connection."""
        if self.total_outbufs_len <= self.adj.outbuf_high_watermark:
            return
        with self.outbuf_lock:
            left, since = self.total_outbufs_len, time.monotonic()
            while self.connected and self.total_outbufs_len > self.adj.outbuf_high_watermark:
                if self.total_outbufs_len < left:  # it reads: however slowly, it may go on
                    left, since = self.total_outbufs_len, time.monotonic()
                elif since and time.monotonic() - since >= WRITE_STALL_S:
                    # closed by the loop's thread (a socket that takes nothing never gets to
                    # waitress' own close), which wakes this wait
                    self.server.stalled.append(self)
                    since = 0.0
                self.server.pull_trigger()  # the loop flushes what the socket takes
                self.outbuf_lock.wait(1.0)


class _Server(TcpWSGIServer):
    """waitress' server, pausing its accepts while this process is out of file descriptors:
    waitress retries at once and logs a traceback each time, spinning a core and flooding the
    job's log. One line when it starts and one when it ends."""

    _paused_until = 0.0
    _short = False
    stalled: list[HTTPChannel]  # connections whose client stopped reading: the loop closes them

    def accept(self):
        try:
            pair = super().accept()
        except OSError as e:
            if e.errno not in _NO_FDS:
                raise
            if not self._short:
                self._short = True
                logging.getLogger(__name__).warning(
                    "%s: cannot accept connections (%s): retrying every %.1f s",
                    http_url(self.effective_host, self.effective_port),
                    os.strerror(e.errno), ACCEPT_PAUSE_S)
            self._paused_until = time.monotonic() + ACCEPT_PAUSE_S
            return None
        if pair is not None and self._short:
            self._short = False
            logging.getLogger(__name__).warning(
                "%s: accepting connections again",
                http_url(self.effective_host, self.effective_port))
        return pair

    def readable(self):
        while self.stalled:
            self.stalled.pop().handle_close()
        if len(self._map) >= self.adj.connection_limit:
            self._make_room()
        # the loop's poll timeout (1 s) ends a pause at the latest
        return super().readable() and time.monotonic() >= self._paused_until

    def _make_room(self) -> None:
        """At waitress' connection limit it stops accepting, so clients that open connections
        and never finish a request (one header line every few seconds keeps waitress' idle
        timeout away) locked every new client out for as long as they liked. Instead the
        connection longest without a request served, and none in progress, is closed: a client
        sending requests keeps its connection, one that sends none loses it."""
        now = time.monotonic()
        idle = [ch for ch in self._map.values() if isinstance(ch, _Channel) and not ch.requests
                and not ch.total_outbufs_len and now - ch.served_at >= MIN_IDLE_S]
        if idle:
            min(idle, key=lambda ch: ch.served_at).close()


_NO_FDS = (errno.EMFILE, errno.ENFILE)
ACCEPT_PAUSE_S = 0.5
WRITE_STALL_S = 10.0  # a client reading none of its answers this long is closed
MIN_IDLE_S = 1.0  # a connection this young is not closed to make room: it may be about to ask
SENT_POLL_S = 0.005  # sent(): how often the connections' unsent answers are looked at


class BackgroundWSGIServer:
    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 0, threads: int = 4,
                 name: str = "lightkeeper-http",
                 max_request_body_size: int = MAX_REQUEST_BODY) -> None:
        """Bind now (raises ``OSError`` when the address is taken, ``ValueError`` when it is no
        address; both naming it); serve after :meth:`start`. A name that resolves to several
        addresses is bound on the first of them this host has."""
        sock = _bind(host, port)
        try:
            self._server = create_server(app, sockets=[sock], threads=threads, ident=name,
                                         clear_untrusted_proxy_headers=True,
                                         # select() fails on a descriptor past 1023 and ends
                                         # the server: a rank's job or a monitor's pool has more
                                         asyncore_use_poll=True,
                                         max_request_body_size=max_request_body_size,
                                         outbuf_overflow=OUTBUF_OVERFLOW)
        except BaseException:
            sock.close()
            raise
        self._server.__class__ = _Server  # create_server's TcpWSGIServer for the one socket
        self._server.stalled = []
        self._server.channel_class = _Channel
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

    def sent(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no connection holds an answer not yet handed to its
        socket (waitress sends from its loop's thread after the handler returned, so a process
        exiting at once could lose the answer); whether none did."""
        deadline = time.monotonic() + timeout_s
        # the map's values copied in one call: the loop's thread adds and drops connections;
        # a request still in a task may be writing its answer
        while any(getattr(c, "total_outbufs_len", 0) or getattr(c, "requests", None)
                  for c in list(self._server._map.values())):
            if time.monotonic() >= deadline:
                return False
            time.sleep(SENT_POLL_S)
        return True

    def _close_sockets(self) -> None:
        self._server.close()
        for channel in list(self._server._map.values()):  # open client connections
            try:
                channel.close()
            except OSError:
                pass
