"""A rank on loopback registers with a monitor on this host, and only refuses one it knows runs
elsewhere (docs/run.md, Across hosts): ``localhost`` that also resolves to a ``::1`` a host
without IPv6 lacks (HPC nodes) is this host. An address is this host's when the kernel routes
it locally, not when it binds: with ``ip_nonlocal_bind`` (keepalived/HAProxy VIP hosts) every
address binds.

Faked: name resolution and routing (a UDP connect() and the address it is sent from), as such a
host answers them; bind() succeeds for every address, as with ``ip_nonlocal_bind=1``."""

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
    """Resolves names to the addresses given (``fe80::5%2``: scope id 2), an address to
    itself. Routes the addresses
    given as this host's to themselves (both loopbacks unless a test switches one off; the rest
    of 127.0.0.0/8 from 127.0.0.1) and any other through its default route, sent from ``via``'s
    address of that family; a family with none: "network unreachable". An unscoped link-local
    fails with "invalid" as Linux does, a family it lacks with "not supported", an address in
    ``fails`` with that errno; a family switched off, every address of it with "cannot assign
    requested address" (EADDRNOTAVAIL: no source address), its loopback too, as Linux does."""
    names: dict[str, list[str]] = {}
    own: set[str] = {"127.0.0.1", "::1"}
    via: dict[int, str] = {socket.AF_INET: "10.0.0.7", socket.AF_INET6: "fd00::7"}
    lacks: set[int] = set()
    off: set[int] = set()
    fails: dict[str, int] = {}

    def getaddrinfo(name, port, *a, **k):
        try:
            listed = names[name] if name in names else [str(ipaddress.ip_address(name))]
        except ValueError:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known") from None
        infos = []
        for a_ in listed:
            ip, _, scope = a_.partition("%")
            infos.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", (ip, 0, 0, int(scope or 0)))
                         if ":" in ip else (socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, 0)))
        return infos

    class Socket:
        def __init__(self, family, kind):
            if family in lacks:
                raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
            self.family, self.source = family, None

        def bind(self, addr):
            pass  # ip_nonlocal_bind: every address binds

        def connect(self, addr):
            scope = addr[3] if len(addr) > 3 else 0
            shown = f"{addr[0]}%{scope}" if scope else addr[0]
            if shown in fails:
                raise OSError(fails[shown], os.strerror(fails[shown]))
            if self.family in off:
                raise OSError(errno.EADDRNOTAVAIL, os.strerror(errno.EADDRNOTAVAIL))
            ip = ipaddress.ip_address(addr[0])
            if ip.is_link_local and not scope:
                raise OSError(errno.EINVAL, "Invalid argument")
            if shown in own:
                self.source = addr[0]
            elif ip.is_loopback and ip.version == 4 and "127.0.0.1" in own:
                self.source = "127.0.0.1"
            elif self.family in via:
                self.source = via[self.family]
            else:
                raise OSError(errno.ENETUNREACH, "Network is unreachable")

        def getsockname(self):
            return (self.source, 40000, 0, 0) if self.family == socket.AF_INET6 \
                else (self.source, 40000)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def switch_off(family):
        """disable_ipv6 on every interface: the socket is made, no address of it has a
        source address."""
        off.add(family)

    monkeypatch.setattr(server_module, "socket", SimpleNamespace(
        getaddrinfo=getaddrinfo, socket=Socket, SOCK_STREAM=socket.SOCK_STREAM,
        SOCK_DGRAM=socket.SOCK_DGRAM))
    return SimpleNamespace(names=names, own=own, via=via, lacks=lacks, fails=fails,
                           switch_off=switch_off)


def test_localhost_is_this_host_where_its_ipv6_address_is_off(host):
    host.names["localhost"] = ["::1", "127.0.0.1"]  # /etc/hosts; IPv6 disabled
    host.switch_off(socket.AF_INET6)
    assert loopback_for_remote(RANK, "http://localhost:19400") is False
    assert loopback_for_remote(RANK, "http://[::1]:19400") is False
    # a loopback name resolved, not recognised: its ::1 is skipped, 127.0.0.1 is this host
    host.names["localhost.localdomain"] = ["::1", "127.0.0.1"]
    assert loopback_for_remote(RANK, "http://localhost.localdomain:19400") is False


def test_a_name_with_one_of_this_hosts_addresses_is_this_host(host):
    host.names["node7"] = ["fd00::7", "10.0.0.7"]
    host.own.add("10.0.0.7")
    host.lacks.add(socket.AF_INET6)
    assert loopback_for_remote(RANK, "http://node7:19400") is False
    host.names["deb"] = ["127.0.1.1"]  # Debian's /etc/hosts line for the host's own name
    assert loopback_for_remote(RANK, "http://deb:19400") is False


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
    """docker0's 172.17.0.1 (a keepalived VIP, a kube-ipvs0 ClusterIP) is on every host: the
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
    # with its scope id, this host's own link-local address is routed to itself
    host.names["node7"] = ["fe80::7%2", "10.0.0.7"]
    host.own.add("fe80::7%2")
    assert loopback_for_remote(RANK, "http://node7:19400") is False


def test_ipv6_switched_off_skips_a_names_ipv6_address(host):
    """disable_ipv6: the socket is made, but no IPv6 address is routed, ::1 neither."""
    host.switch_off(socket.AF_INET6)
    host.own.add("10.0.0.7")
    host.names["node7"] = ["fd00::7", "10.0.0.7"]
    assert loopback_for_remote(RANK, "http://node7:19400") is False
    host.names["mon"] = ["fd00::5", "10.0.0.5"]
    assert loopback_for_remote(RANK, "http://mon:19400") is True
    host.names["mon6"] = ["fd00::5"]  # only IPv6, which this host has off: not here
    assert loopback_for_remote(RANK, "http://mon6:19400") is True


def test_an_address_without_a_source_address_is_not_this_hosts_where_its_family_is_on(host):
    """EADDRNOTAVAIL for one IPv6 address while ::1 is routed: IPv6 is on, that address is not
    this host's."""
    host.own.add("10.0.0.7")
    host.names["mon"] = ["2001:db8::5", "172.17.0.1"]
    host.own.add("172.17.0.1")  # docker0's, on every host
    host.fails["2001:db8::5"] = errno.EADDRNOTAVAIL
    assert loopback_for_remote(RANK, "http://mon:19400") is True


def test_routing_that_fails_for_another_reason_leaves_the_registration_to_try(host):
    """EMFILE, EACCES: whether the address is this host's is not known; refusing would cost the
    registration with a monitor that may be on this host."""
    host.own.add("10.0.0.7")
    host.names["node7"] = ["10.0.0.7", "10.0.0.8"]
    host.fails["10.0.0.8"] = errno.EMFILE
    assert loopback_for_remote(RANK, "http://node7:19400") is False
    host.fails["10.0.0.8"] = errno.EACCES
    assert loopback_for_remote(RANK, "http://node7:19400") is False


def test_an_address_that_binds_is_not_this_hosts_unless_routed_here(host):
    """ip_nonlocal_bind=1 (keepalived/HAProxy VIP hosts): every address binds, a remote
    monitor's too; the kernel still sends to it out of this host."""
    host.own.add("10.0.0.7")
    host.names["mon"] = ["10.0.0.5"]
    assert loopback_for_remote(RANK, "http://mon:19400") is True
    assert loopback_for_remote(RANK, "http://10.0.0.5:19400") is True
    host.names["node7"] = ["10.0.0.7"]
    assert loopback_for_remote(RANK, "http://node7:19400") is False


def test_ipv6_off_on_loopback_only_is_not_ipv6_off(host):
    """lo.disable_ipv6=1 while eth0 has IPv6: ::1 is gone, yet a monitor's IPv6 address is
    routed out of eth0, so a monitor named also by docker0's 172.17.0.1 is elsewhere."""
    host.own.discard("::1")
    host.own.update({"2001:db8::7", "10.0.0.7", "172.17.0.1"})
    host.via[socket.AF_INET6] = "2001:db8::7"
    host.names["mon"] = ["2001:db8::5", "172.17.0.1"]
    assert loopback_for_remote(RANK, "http://mon:19400") is True
    host.names["node7"] = ["2001:db8::7", "10.0.0.7"]
    assert loopback_for_remote(RANK, "http://node7:19400") is False
    # IPv6 on, but no route to the monitor's address: not this host's either
    host.own.add("::1")
    del host.via[socket.AF_INET6]
    assert loopback_for_remote(RANK, "http://mon:19400") is True


def _in_a_network_without_ipv6(probe):
    """``probe()``'s result, run by a thread moved into a network namespace of its own (the
    test's other threads stay in the host's) with only ``lo`` up and ``disable_ipv6=1``: what
    a real Linux kernel answers there, not what the fake above says it does."""
    import ctypes
    import fcntl
    import struct
    import threading

    done: dict = {}

    def run():
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET: this thread only
                done["skip"] = f"unshare: {os.strerror(ctypes.get_errno())}"
                return
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # lo up
                ifreq = fcntl.ioctl(s, 0x8913, struct.pack("16sH14x", b"lo", 0))  # SIOCGIFFLAGS
                flags = struct.unpack("16sH14x", ifreq)[1] | 1  # IFF_UP
                fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags))  # SIOCSIFFLAGS
            # /proc/sys/net is the calling thread's namespace's
            try:
                with open("/proc/sys/net/ipv6/conf/all/disable_ipv6", "w") as f:
                    f.write("1")
            except OSError as e:  # a container's read-only /proc/sys: nothing to show here
                done["skip"] = f"disable_ipv6 not writable: {e.strerror}"
                return
            done["result"] = probe()
        except BaseException as e:  # noqa: BLE001 - reported to the test's own thread
            done["error"] = e

    thread = threading.Thread(target=run, name="netns-probe")
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the probe in its own network namespace did not end in 10 s"
    if "skip" in done:
        pytest.skip(done["skip"])
    if "error" in done:
        raise done["error"]
    return done["result"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0
                    or not os.path.exists("/proc/sys/net/ipv6/conf/all/disable_ipv6"),
                    reason="needs root and a Linux kernel with IPv6 (a network namespace)")
def test_a_real_kernel_with_ipv6_off_routes_localhost_localdomain_here(monkeypatch):
    """Linux with disable_ipv6=1 answers a connect() to ::1 with EADDRNOTAVAIL: the ::1 of
    ``localhost.localdomain`` is skipped, its 127.0.0.1 makes it this host."""
    names = {"localhost.localdomain": ["::1", "127.0.0.1"],
             "mon": ["2001:db8::5", "10.0.0.5"]}  # no route to it: another host

    def getaddrinfo(name, port, *a, **k):
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", (ip, 0, 0, 0)) if ":" in ip
                else (socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, 0)) for ip in names[name]]

    monkeypatch.setattr(server_module, "socket", SimpleNamespace(
        getaddrinfo=getaddrinfo, socket=socket.socket, SOCK_STREAM=socket.SOCK_STREAM,
        SOCK_DGRAM=socket.SOCK_DGRAM))
    here, there = _in_a_network_without_ipv6(lambda: (
        loopback_for_remote(RANK, "http://localhost.localdomain:19400"),
        loopback_for_remote(RANK, "http://mon:19400")))
    assert here is False  # registers
    assert there is True  # still refused
