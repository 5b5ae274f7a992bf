"""Moving threads and sockets between network namespaces: a spare entering its host, a thread
run inside a namespace, and a TCP forwarder from one namespace into another.

Used by :mod:`lightkeeper.fabric` (hosts as namespaces) and a warm spare taking its host. Needs
root (``setns``); each call raises OSError when it cannot.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import socket
import threading

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000


@functools.cache
def libc_setns():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.setns
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    return fn


def enter_host(netns: str, node: str) -> None:
    """Move the calling thread into host ``netns``'s network namespace, in a UTS namespace of
    its own named ``node``: a warm spare, started before its host was known, taking its place.
    Threads and processes it starts then are on that host. Raises OSError if it cannot."""
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(fd)
    finally:
        os.close(fd)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUTS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUTS): {os.strerror(err)}")
    socket.sethostname(node)


def setns(fd: int) -> None:
    if libc_setns()(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def in_netns(fd: int, fn):
    """``fn()`` run in a fresh thread moved into the network namespace ``fd`` (that thread
    only): a socket it creates belongs to that namespace for good; /proc/sys/net it opens is
    that namespace's."""
    out: dict = {}

    def target():
        try:
            setns(fd)
            out["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    t = threading.Thread(target=target, name="lightkeeper-fabric-netns", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class Forwarder:
    """127.0.0.1:<ephemeral> in one namespace -> ``addr:port`` in another, a daemon thread
    accepting and two per connection pumping; :meth:`close` ends them all."""

    def __init__(self, listen_fd: int, target_fd: int, addr: str, port: int) -> None:
        self.target_fd, self.target = target_fd, (addr, port)
        self.listener = in_netns(listen_fd, lambda: socket.socket(socket.AF_INET))
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.conns: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, name=f"lightkeeper-forward-{self.port}",
                         daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._connect, args=(conn,), daemon=True).start()

    def _connect(self, conn: socket.socket) -> None:
        try:
            up = in_netns(self.target_fd, lambda: socket.socket(socket.AF_INET))
            up.settimeout(10)
            up.connect(self.target)
            up.settimeout(None)
        except OSError as e:
            log.warning("fabric: forward 127.0.0.1:%d -> %s:%d: %s", self.port, *self.target, e)
            conn.close()
            return
        with self.lock:
            if self.closed:
                conn.close()
                up.close()
                return
            self.conns |= {conn, up}
        done = threading.Barrier(2, action=lambda: self._drop(conn, up))
        for a, b in ((conn, up), (up, conn)):
            threading.Thread(target=self._pump, args=(a, b, done), daemon=True).start()

    def _drop(self, *socks: socket.socket) -> None:
        with self.lock:
            for s in socks:
                self.conns.discard(s)
                s.close()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, done: threading.Barrier) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)  # pass the half-close on
        with contextlib.suppress(threading.BrokenBarrierError):
            done.wait()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            socks = [self.listener, *self.conns]
            self.conns.clear()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
