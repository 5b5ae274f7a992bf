"""A bind host that resolves to several addresses (``localhost`` with ``::1`` in /etc/hosts) is
served on one of them, one socket on one port: waitress bound each address and returned a server
with no port, so ``WorkerServer.start(host="localhost")`` raised AttributeError (not the
OSError/ValueError a job catches to train on unobserved) with its sockets left bound."""

from __future__ import annotations

import socket

import pytest
import requests

from http_serving import BackgroundWSGIServer
from worker_server import WorkerServer

_real_getaddrinfo = socket.getaddrinfo


def _resolving(monkeypatch, name: str, *addresses: str) -> None:
    """``name`` resolves to ``addresses``, in that order (as a dual-stack /etc/hosts would)."""
    def fake(host, port, *args, **kwargs):
        if host == name:
            return [info for address in addresses
                    for info in _real_getaddrinfo(address, port, *args, **kwargs)]
        return _real_getaddrinfo(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def _held_here(port: int) -> set[str]:
    """The addresses this process listens on at ``port`` (its sockets in /proc/net/tcp*): what
    the server holds, whatever other processes (another xdist worker) bind meanwhile."""
    import os

    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    held = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            address, hex_port = f[1].split(":")
            if f[3] == "0A" and int(hex_port, 16) == port and f[9] in mine:  # LISTEN
                raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1]
                               for i in range(0, len(address), 8))
                held.add(socket.inet_ntop(family, raw))
    return held


def _hello(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"hello"]


def test_a_worker_server_on_a_dual_stack_localhost_serves_and_frees_its_port(monkeypatch):
    for name in ("LIGHTKEEPER_MONITOR", "LIGHTKEEPER_EXIT_TOKEN", "LIGHTKEEPER_FAULT_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    _resolving(monkeypatch, "localhost", "::1", "127.0.0.1")
    server = WorkerServer.start(replica_group=0, group_rank=0, group_world_size=1,
                                host="localhost", port=0)
    try:
        assert server.url == f"http://localhost:{server.port}"
        state = requests.get(server.url + "/v1/state", timeout=5)
        assert state.status_code == 200 and state.json()["worker_url"] == server.url
    finally:
        server.stop()
    # nothing of it holds the port once stopped, on either address
    assert _held_here(server.port) == set()


@pytest.mark.skipif(not _ipv6_loopback(), reason="no ::1 on this host")
def test_the_first_address_is_the_one_bound(monkeypatch):
    """What a user asking for "localhost" means: the first address it resolves to."""
    _resolving(monkeypatch, "localhost", "::1", "127.0.0.1")
    server = BackgroundWSGIServer(_hello, host="localhost", port=0).start()
    try:
        with socket.create_connection(("::1", server.port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert b"hello" in s.makefile("rb").read()
        # one socket: the port is taken on ::1 only (waitress took another port on 127.0.0.1)
        assert _held_here(server.port) == {"::1"}
    finally:
        server.stop()


def test_an_address_this_host_does_not_have_is_passed_over(monkeypatch):
    """::1 where IPv6 is off (or any address not here): the next address is bound."""
    _resolving(monkeypatch, "dual.test", "192.0.2.1", "127.0.0.1")  # TEST-NET-1: not here
    server = BackgroundWSGIServer(_hello, host="dual.test", port=0).start()
    try:
        got = requests.get(f"http://127.0.0.1:{server.port}/", timeout=5)
        assert got.text == "hello"
        assert server.url == f"http://dual.test:{server.port}"
    finally:
        server.stop()


def test_a_taken_port_is_an_oserror_and_no_address_a_valueerror():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot bind http://127.0.0.1:{port}"):
            BackgroundWSGIServer(_hello, host="127.0.0.1", port=port)
    with pytest.raises(ValueError, match="'no-such-host.invalid' port 0"):
        BackgroundWSGIServer(_hello, host="no-such-host.invalid", port=0)
    with pytest.raises(ValueError, match="port 70000"):
        BackgroundWSGIServer(_hello, host="127.0.0.1", port=70000)


def _dual_stack_wildcard() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind(("::", 0))
        return True
    except OSError:
        return False


def _get(address: str, port: int) -> bytes:
    with socket.create_connection((address, port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return s.makefile("rb").read()


@pytest.mark.skipif(not _dual_stack_wildcard(), reason="no dual-stack IPv6 on this host")
def test_the_ipv6_wildcard_hears_ipv4_too():
    """``LIGHTKEEPER_WORKER_HOST=::`` registers by host name, which the monitor polls at its
    IPv4 address: before, the socket was IPv6 only and every poll was refused."""
    server = BackgroundWSGIServer(_hello, host="::", port=0).start()
    try:
        assert b"hello" in _get("127.0.0.1", server.port)
        if _ipv6_loopback():
            assert b"hello" in _get("::1", server.port)
    finally:
        server.stop()
    assert _held_here(server.port) == set()


@pytest.mark.skipif(not _ipv6_loopback(), reason="no ::1 on this host")
def test_a_specific_ipv6_address_is_served_on_ipv6_only():
    server = BackgroundWSGIServer(_hello, host="::1", port=0).start()
    try:
        assert b"hello" in _get("::1", server.port)
        assert _held_here(server.port) == {"::1"}  # as waitress: the IPv4 port is another's
    finally:
        server.stop()


@pytest.mark.skipif(not (_dual_stack_wildcard() and _ipv6_loopback()),
                    reason="no dual-stack IPv6 or no ::1 on this host")
def test_the_ipv6_wildcard_on_a_port_another_holds_on_ipv4_is_served_on_ipv6(caplog):
    """Before: with the port held on IPv4 only (``ssh -4 -L``, docker-proxy) the dual-stack
    bind failed EADDRINUSE, so the rank trained unobserved and the monitor exited 1; until the
    :: wildcard heard IPv4 too it served on IPv6."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level("WARNING", logger="http_serving.wsgi"):
            server = BackgroundWSGIServer(_hello, host="::", port=port).start()
        try:
            assert b"hello" in _get("::1", server.port)
        finally:
            server.stop()
        lines = [r.getMessage() for r in caplog.records]
        assert lines == [f"http://[::]:{port}: port {port} on IPv4 is another process's: "
                         "served on IPv6 only"], lines
        with socket.socket(socket.AF_INET6) as v6:  # IPv6 taken as well: still an OSError
            v6.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the TIME_WAIT
            v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            v6.bind(("::1", port))
            v6.listen()
            with pytest.raises(OSError, match=rf"cannot bind http://\[::\]:{port}"):
                BackgroundWSGIServer(_hello, host="::", port=port)
