"""A rank on loopback registers with a monitor on this host, and only refuses one it knows runs
elsewhere (docs/run.md, Across hosts): ``localhost`` that also resolves to a ``::1`` a host
without IPv6 cannot bind (HPC nodes) is this host.

Faked: name resolution and bind, as such a host answers them."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from types import SimpleNamespace

import pytest

from worker_server import server as server_module
from worker_server.server import loopback_for_remote

RANK = "http://127.0.0.1:1"


@pytest.fixture
def host(monkeypatch):
    """Resolves names to the addresses given (``fe80::5%2``: scope id 2); binds the ones given as
    this host's (both loopbacks unless a test switches one off), fails the others with "not
    available", an unscoped link-local with "invalid" as Linux does, a family it lacks with "not
    supported", and an address in ``fails`` with that errno."""
    names: dict[str, list[str]] = {}
    own: set[str] = {"127.0.0.1", "::1"}
    lacks: set[int] = set()
    fails: dict[str, int] = {}

    def getaddrinfo(name, port, *a, **k):
        if name not in names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        infos = []
        for a_ in names[name]:
            ip, _, scope = a_.partition("%")
            infos.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", (ip, 0, 0, int(scope or 0)))
                         if ":" in ip else (socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, 0)))
        return infos

    class Socket:
        def __init__(self, family, kind):
            if family in lacks:
                raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")

        def bind(self, addr):
            scope = addr[3] if len(addr) > 3 else 0
            shown = f"{addr[0]}%{scope}" if scope else addr[0]
            if shown in fails:
                raise OSError(fails[shown], os.strerror(fails[shown]))
            if ipaddress.ip_address(addr[0]).is_link_local and not scope:
                raise OSError(errno.EINVAL, "Invalid argument")
            if shown not in own:
                raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(server_module, "socket", SimpleNamespace(
        getaddrinfo=getaddrinfo, socket=Socket, SOCK_STREAM=socket.SOCK_STREAM,
        SOCK_DGRAM=socket.SOCK_DGRAM))
    return SimpleNamespace(names=names, own=own, lacks=lacks, fails=fails)


def test_localhost_is_this_host_where_its_ipv6_address_cannot_be_bound(host):
    host.names["localhost"] = ["::1", "127.0.0.1"]  # /etc/hosts; IPv6 disabled
    host.own.discard("::1")
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


def test_a_monitor_whose_name_also_lists_an_address_every_host_has_is_refused(host):
    """docker0's 172.17.0.1 (a keepalived VIP, a kube-ipvs0 ClusterIP) binds on every host: the
    monitor's other address says it is elsewhere."""
    host.names["mon"] = ["10.0.0.5", "172.17.0.1"]
    host.own.update({"172.17.0.1", "10.0.0.7"})
    assert loopback_for_remote(RANK, "http://mon:19400") is True
    host.names["mon"].reverse()
    assert loopback_for_remote(RANK, "http://mon:19400") is True


def test_an_unscoped_link_local_address_is_not_this_hosts(host):
    host.names["mon"] = ["fe80::5", "10.0.0.5"]  # EINVAL: no interface named
    host.own.add("10.0.0.7")
    assert loopback_for_remote(RANK, "http://mon:19400") is True
    host.names["mon"] = ["fe80::5"]
    assert loopback_for_remote(RANK, "http://mon:19400") is True
    # with its scope id, this host's own link-local address binds
    host.names["node7"] = ["fe80::7%2", "10.0.0.7"]
    host.own.add("fe80::7%2")
    assert loopback_for_remote(RANK, "http://node7:19400") is False


def test_ipv6_switched_off_skips_a_names_ipv6_address(host):
    """disable_ipv6: the socket is made, but no IPv6 address binds, ::1 neither."""
    host.own.discard("::1")
    host.own.add("10.0.0.7")
    host.names["node7"] = ["fd00::7", "10.0.0.7"]
    assert loopback_for_remote(RANK, "http://node7:19400") is False
    host.names["mon"] = ["fd00::5", "10.0.0.5"]
    assert loopback_for_remote(RANK, "http://mon:19400") is True
    host.names["mon6"] = ["fd00::5"]  # only IPv6, which this host has off: not here
    assert loopback_for_remote(RANK, "http://mon6:19400") is True


def test_a_bind_that_fails_for_another_reason_leaves_the_registration_to_try(host):
    """EMFILE, EACCES: whether the address is this host's is not known; refusing would cost the
    registration with a monitor that may be on this host."""
    host.own.add("10.0.0.7")
    host.names["node7"] = ["10.0.0.7", "10.0.0.8"]
    host.fails["10.0.0.8"] = errno.EMFILE
    assert loopback_for_remote(RANK, "http://node7:19400") is False
    host.fails["10.0.0.8"] = errno.EACCES
    assert loopback_for_remote(RANK, "http://node7:19400") is False
