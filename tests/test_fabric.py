"""Hosts as real network namespaces (lightkeeper/fabric.py): reachability by node name, each
host's own hostname, the thread entering the control namespace and leaving it, the forwarder
from 127.0.0.1, the network faults (rate limit, partition, disconnect) and heal, and cleanup
after close, a failed create and a SIGKILLed owner.

Real namespaces, veths, bridge and tc; the servers are small Python processes started inside
the namespaces through ``Fabric.wrap`` and stopped by PID. Needs root, iproute2 and unshare:
skipped with ``Fabric.unavailable()``'s reason elsewhere."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lightkeeper import fabric as fabric_mod
from lightkeeper.fabric import CTL_ADDR, CTL_NAME, Fabric, FabricError, tbf_burst
from lightkeeper.processes import stop_process
from tests.support.lines import first_line

pytestmark = pytest.mark.skipif(bool(Fabric.unavailable()),
                                reason=f"no network namespaces: {Fabric.unavailable()}")

NODES = ["node-0", "node-1", "node-2"]

# Serves every connection: says its hostname, counts what it is sent until EOF, says the count;
# exits when its stdin closes (the test's end, or its death: nothing outlives a killed run).
SERVER = r"""
import os, socket, sys, threading
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
s = socket.socket()
s.bind(("0.0.0.0", 0))
s.listen(64)
print(s.getsockname()[1], flush=True)
def serve(c):
    with c:
        c.sendall((socket.gethostname() + "\n").encode())
        n = 0
        while d := c.recv(1 << 16):
            n += len(d)
        c.sendall(f"{n}\n".encode())
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""

# The client side of SERVER: connect, read the hello, send ``send`` bytes, read the count.
TALK = r"""
import json, socket, sys, threading, time
def talk(host, port, send, timeout):
    t0 = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout) as c:
            f = c.makefile("rb")
            hello = f.readline().decode().strip()
            c.settimeout(60)
            if send:
                c.sendall(b"x" * send)
            c.shutdown(socket.SHUT_WR)
            count = int(f.readline() or -1)
        return {"hello": hello, "count": count, "s": time.monotonic() - t0}
    except OSError as e:
        return {"error": str(e) or type(e).__name__, "s": time.monotonic() - t0}
"""
# TALK as a process, one thread per target: argv[1] is JSON [[host, port, bytes, timeout], ...];
# prints {"me": its hostname, "results": [...]}.
CLIENT = TALK + r"""
jobs = json.loads(sys.argv[1])
out = [None] * len(jobs)
def run(i):
    out[i] = talk(*jobs[i])
ts = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
[t.start() for t in ts]
[t.join() for t in ts]
print(json.dumps({"me": socket.gethostname(), "results": out}))
"""

_talk: dict = {}
exec(TALK, _talk)
talk = _talk["talk"]  # the same client in this process, in whatever namespace the thread is


def probe(fab: Fabric, node: str, *jobs) -> tuple[str, list[dict]]:
    """Run CLIENT on ``node`` for jobs (host, port, bytes, timeout): its hostname, results."""
    argv = fab.wrap(node, [sys.executable, "-c", CLIENT, json.dumps(jobs)])
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    return out["me"], out["results"]


class CtlServer:
    """SERVER's protocol in this process, listening at 198.18.0.1 in the control namespace."""

    def __init__(self, fab: Fabric) -> None:
        with fab.entered():
            self.sock = socket.socket()
        self.sock.bind((CTL_ADDR, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    @staticmethod
    def _serve(c: socket.socket) -> None:
        with c:
            c.sendall(b"ctl\n")
            n = 0
            while d := c.recv(1 << 16):
                n += len(d)
            c.sendall(f"{n}\n".encode())

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def fab():
    """One 3-host fabric, a SERVER on every host and one in the control namespace."""
    Fabric.sweep_stale()  # what a killed earlier run left
    fab = Fabric.create(NODES)
    procs = []
    try:
        for node in NODES:
            procs.append(subprocess.Popen(fab.wrap(node, [sys.executable, "-c", SERVER]),
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        fab.ports = {node: int(first_line(p)) for node, p in zip(NODES, procs, strict=True)}
        fab.ctl_server = CtlServer(fab)
        yield fab
    finally:
        for p in procs:
            stop_process(p, grace=1.0)
        if hasattr(fab, "ctl_server"):
            fab.ctl_server.close()
        fab.close()


@pytest.fixture
def healed(fab):
    yield fab
    for node in NODES:
        assert fab.heal(node).ok


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def ours(prefix: str) -> tuple[set[str], set[str]]:
    """This fabric's namespaces and /etc/netns entries that exist now."""
    etc = set(os.listdir("/etc/netns")) if os.path.isdir("/etc/netns") else set()
    return ({n for n in netns_names() if n.startswith(prefix + "-")},
            {n for n in etc if n.startswith(prefix + "-")})


def test_hosts_reach_each_other_and_ctl_by_name_each_with_its_own_hostname(fab):
    root_hostname = socket.gethostname()
    me, res = probe(fab, "node-0", ["node-1", fab.ports["node-1"], 1000, 5],
                    ["node-2", fab.ports["node-2"], 0, 5],
                    [CTL_NAME, fab.ctl_server.port, 10, 5])
    assert me == "node-0"
    assert [r.get("hello") for r in res] == ["node-1", "node-2", "ctl"], res
    assert [r.get("count") for r in res] == [1000, 0, 10]
    me, res = probe(fab, "node-2", ["node-0", fab.ports["node-0"], 0, 5])
    assert (me, res[0].get("hello")) == ("node-2", "node-0"), res
    # every namespace's hosts file names every node and the control address
    hosts = open(f"/etc/netns/{fab.ctl_ns}/hosts").read()
    assert all(f"{h.addr}\t{h.node}" in hosts for h in fab.hosts) and CTL_NAME in hosts
    assert [h.addr for h in fab.hosts] == ["198.18.0.10", "198.18.0.11", "198.18.0.12"]
    assert socket.gethostname() == root_hostname not in NODES


def test_entered_moves_this_thread_into_ctl_and_back(fab):
    before_ns = os.stat("/proc/thread-self/ns/net").st_ino
    made_outside = socket.socket()
    with fab.entered():
        assert os.stat("/proc/thread-self/ns/net").st_ino != before_ns
        r = talk(fab.host("node-1").addr, fab.ports["node-1"], 100, 5)
        assert (r.get("hello"), r.get("count")) == ("node-1", 100), r
        with socket.socket() as s:
            s.bind((CTL_ADDR, 0))  # the control address is this thread's now
        with pytest.raises(OSError) as e:  # ...but not a socket made before it entered
            made_outside.bind((CTL_ADDR, 0))
        assert e.value.errno == errno.EADDRNOTAVAIL
        seen = {}
        t = threading.Thread(target=lambda: seen.update(
            r=talk(fab.host("node-2").addr, fab.ports["node-2"], 0, 5)))
        t.start()
        t.join()
        assert seen["r"].get("hello") == "node-2"  # a thread started inside is inside
    made_outside.close()
    assert os.stat("/proc/thread-self/ns/net").st_ino == before_ns
    with socket.socket() as s, pytest.raises(OSError) as e:
        s.bind((CTL_ADDR, 0))  # back outside: 198.18.0.1 is nobody's here
    assert e.value.errno == errno.EADDRNOTAVAIL


def test_forward_reaches_ctl_and_a_host_from_127_0_0_1(fab):
    for addr, port, hello in ((None, fab.ctl_server.port, "ctl"),
                              (fab.host("node-1").addr, fab.ports["node-1"], "node-1")):
        local = fab.forward(port, addr)
        r = talk("127.0.0.1", local, 5000, 5)
        assert (r.get("hello"), r.get("count")) == (hello, 5000), r


def test_rate_limit_bounds_both_directions_and_heal_lifts_it(healed):
    fab = healed
    mbit, n = 16.0, 1_000_000
    # the bound: what passes the token bucket at line rate, the rest at the rate (headers on top)
    bound = (n - tbf_burst(mbit)) * 8 / (mbit * 1e6)
    a = fab.rate_limit("node-0", mbit)
    assert a.ok and fab.faults("node-0") == ["rate_limit 16 Mbit/s"], a

    def both_ways():
        with fab.entered():  # control -> node-0: through node-0's bridge port
            down = talk(fab.host("node-0").addr, fab.ports["node-0"], n, 10)
        _, (up,) = probe(fab, "node-0", [CTL_NAME, fab.ctl_server.port, n, 10])  # node-0 -> ctl
        assert down.get("count") == n and up.get("count") == n, (down, up)
        return down["s"], up["s"]

    down_s, up_s = both_ways()
    assert down_s >= bound and up_s >= bound, (down_s, up_s, bound)
    h = fab.heal("node-0")
    assert h.ok and "rate limit 16 Mbit/s removed" in h.detail and fab.faults("node-0") == []
    down_s, up_s = both_ways()
    assert down_s < bound / 2 and up_s < bound / 2, (down_s, up_s, bound)


def test_partition_cuts_a_host_from_its_peers_not_from_ctl_and_heal_restores(healed):
    fab = healed
    assert fab.partition("node-1").ok
    to = 0.3
    _, res = probe(fab, "node-1", [CTL_NAME, fab.ctl_server.port, 0, 5],
                   ["node-0", fab.ports["node-0"], 0, to], ["node-2", fab.ports["node-2"], 0, to])
    assert res[0].get("hello") == "ctl", res
    # packets vanish as in a real partition: the connects time out, they are not refused
    assert ["timed out" in r.get("error", "") for r in res[1:]] == [True, True], res
    _, res = probe(fab, "node-0", ["node-1", fab.ports["node-1"], 0, to],
                   ["node-2", fab.ports["node-2"], 0, 5])
    assert "timed out" in res[0].get("error", "") and res[1].get("hello") == "node-2", res
    with fab.entered():
        r = talk(fab.host("node-1").addr, fab.ports["node-1"], 0, 5)
    assert r.get("hello") == "node-1", r  # the control namespace still reaches it
    h = fab.heal("node-1")
    assert h.ok and h.detail == "partition lifted", h
    _, res = probe(fab, "node-1", ["node-0", fab.ports["node-0"], 0, 5],
                   ["node-2", fab.ports["node-2"], 0, 5])
    assert [r.get("hello") for r in res] == ["node-0", "node-2"], res
    _, res = probe(fab, "node-2", ["node-1", fab.ports["node-1"], 0, 5])
    assert res[0].get("hello") == "node-1", res


def test_disconnect_takes_a_host_off_the_network_and_heal_brings_it_back(healed):
    fab = healed
    assert fab.disconnect("node-2").ok and fab.faults("node-2") == ["disconnect"]
    to = 0.3
    _, res = probe(fab, "node-0", ["node-2", fab.ports["node-2"], 0, to])
    assert "error" in res[0], res
    with fab.entered():
        r = talk(fab.host("node-2").addr, fab.ports["node-2"], 0, to)
    assert "error" in r, r
    _, res = probe(fab, "node-2", [CTL_NAME, fab.ctl_server.port, 0, to],
                   ["node-0", fab.ports["node-0"], 0, to])
    assert all("error" in r for r in res), res
    h = fab.heal("node-2")
    assert h.ok and h.detail == "link up", h
    assert fab.heal("node-2").detail == "nothing to undo"  # idempotent
    _, res = probe(fab, "node-2", [CTL_NAME, fab.ctl_server.port, 0, 5],
                   ["node-0", fab.ports["node-0"], 0, 5])
    assert [r.get("hello") for r in res] == ["ctl", "node-0"], res
    with fab.entered():
        assert talk(fab.host("node-2").addr, fab.ports["node-2"], 0, 5).get("hello") == "node-2"


def test_close_removes_every_namespace_link_and_hosts_file():
    links_before = root_links()
    fab = Fabric.create(["a", "b"])
    with fab.entered():
        server = socket.create_server((CTL_ADDR, 0))
    local = fab.forward(server.getsockname()[1])
    made = {fab.ctl_ns, *(h.netns for h in fab.hosts)}
    assert ours(fab.prefix) == (made, made)
    assert root_links() == links_before  # nothing in the root namespace, ever
    fab.close()
    server.close()
    assert ours(fab.prefix) == (set(), set())
    with pytest.raises(ConnectionRefusedError):  # its forwarder stopped with it
        socket.create_connection(("127.0.0.1", local), timeout=5).close()
    fab.close()  # idempotent
    a = fab.rate_limit("a", 10)
    assert not a.ok and "not up" in a.error  # said, not raised
    assert root_links() == links_before


def test_a_create_failing_midway_removes_what_it_made(monkeypatch):
    real = Fabric._ip_batch
    calls = []

    def failing(self, ns, lines):  # the control namespace and the first host are built
        calls.append(ns)
        if len(calls) == 3:
            raise FabricError("injected failure")
        return real(self, ns, lines)

    monkeypatch.setattr(Fabric, "_ip_batch", failing)
    fab = Fabric(["a", "b", "c"])
    with pytest.raises(FabricError, match="injected"):
        fab.up()
    assert len(calls) == 3
    assert ours(fab.prefix) == (set(), set())


def test_sweep_stale_removes_a_sigkilled_owners_fabric_only(fab):
    code = ("import time; from lightkeeper.fabric import Fabric; "
            "f = Fabric.create(['a', 'b']); print(f.prefix, flush=True); time.sleep(60)")
    root = str(Path(fabric_mod.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        root, os.environ.get("PYTHONPATH")]))}
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    try:
        prefix = first_line(owner)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
    left = ours(prefix)
    assert len(left[0]) == 3 and left[0] == left[1]  # SIGKILL: no atexit, all left behind
    swept = Fabric.sweep_stale()
    assert left[0] <= set(swept)
    assert ours(prefix) == (set(), set())
    assert fab.ctl_ns in netns_names()  # a live fabric is not stale
