"""A rank on loopback registers with a monitor on this host, and only refuses one it knows runs
elsewhere (docs/run.md, Across hosts): ``localhost`` that also resolves to a ``::1`` a host
without IPv6 cannot bind (HPC nodes) is this host.

Faked: name resolution and bind, as such a host answers them."""

from __future__ import annotations

import errno
import socket
from types import SimpleNamespace

import pytest

from worker_server import server as server_module
from worker_server.server import loopback_for_remote

RANK = "http://127.0.0.1:1"


@pytest.fixture
def host(monkeypatch):
    """Resolves names to the addresses given; binds the ones given as this host's, fails the
    others with "not available" (a family it lacks: "not supported")."""
    names: dict[str, list[str]] = {}
    own: set[str] = set()
    lacks: set[int] = set()

    def getaddrinfo(name, port, *a, **k):
        if name not in names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a_ else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a_, 0, 0, 0) if ":" in a_ else (a_, 0)) for a_ in names[name]]

    class Socket:
        def __init__(self, family, kind):
            if family in lacks:
                raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")

        def bind(self, addr):
            if addr[0] not in own:
                raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(server_module, "socket", SimpleNamespace(
        getaddrinfo=getaddrinfo, socket=Socket, SOCK_STREAM=socket.SOCK_STREAM,
        SOCK_DGRAM=socket.SOCK_DGRAM))
    return SimpleNamespace(names=names, own=own, lacks=lacks)


def test_localhost_is_this_host_where_its_ipv6_address_cannot_be_bound(host):
    host.names["localhost"] = ["::1", "127.0.0.1"]  # /etc/hosts; IPv6 disabled
    host.own.add("127.0.0.1")
    assert loopback_for_remote(RANK, "http://localhost:19400") is False
    assert loopback_for_remote(RANK, "http://[::1]:19400") is False


def test_a_name_with_one_of_this_hosts_addresses_is_this_host(host):
    host.names["node7"] = ["fd00::7", "10.0.0.7"]
    host.own.add("10.0.0.7")
    host.lacks.add(socket.AF_INET6)
    assert loopback_for_remote(RANK, "http://node7:19400") is False


def test_a_monitor_on_another_host_is_still_refused(host):
    host.names["mon"] = ["fd00::5", "10.0.0.5"]
    host.own.add("10.0.0.7")
    assert loopback_for_remote(RANK, "http://mon:19400") is True
    host.lacks.add(socket.AF_INET6)  # its IPv6 address is not this host's either
    assert loopback_for_remote(RANK, "http://mon:19400") is True
    # a rank reached from other hosts registers anywhere; a name that does not resolve is the
    # registration's own failure to say
    assert loopback_for_remote("http://10.0.0.7:1", "http://mon:19400") is False
    assert loopback_for_remote(RANK, "http://nowhere:19400") is False
