"""Hosts as network namespaces: every "host" of the local job a network of its own.

Each node of a :class:`Fabric` is a network namespace ``lkf-<pid>-<k>-h<i>`` with ``eth0`` at
``198.18.0.(10+i)``, its own hostname (a UTS namespace per process started through
:meth:`Fabric.wrap`) and an ``/etc/hosts`` (``/etc/netns/<ns>/hosts``, mounted by
``ip netns exec``) naming every node and ``lightkeeper-ctl``. A control namespace
``lkf-<pid>-<k>-ctl`` holds the bridge every ``eth0`` is plugged into, at ``198.18.0.1``
(``lightkeeper-ctl``), where the Lighthouse, the monitor and Prometheus run. The root
namespace gets no address and no interface: nothing leaves this machine, and parallel fabrics
never meet (each uses 198.18.0.0/24 inside its own namespaces).

From outside, :meth:`~Fabric.wrap`/:meth:`~Fabric.wrap_ctl` give the argv of a process inside,
:meth:`~Fabric.entered` moves the calling thread into the control namespace, and
:meth:`~Fabric.forward` forwards a port on 127.0.0.1 into it.

Network faults, applied and undone at any time: :meth:`~Fabric.rate_limit` (a slow link),
:meth:`~Fabric.partition` (no peer reachable, the control namespace still is: peers' packets
are routed into a dead-end interface, so connections time out as in a real partition instead
of failing at once as with a blackhole route), :meth:`~Fabric.disconnect` (link down) and
:meth:`~Fabric.heal`. A fault that cannot be applied is logged in one line and returned as an
:class:`Action` with ``ok=False``: it never raises into the caller's job.

Needs root, iproute2 and util-linux ``unshare`` (:meth:`Fabric.unavailable` says why not).
:meth:`Fabric.close` (also run at exit) removes every namespace, interface and ``/etc/netns``
entry the fabric made; :meth:`Fabric.sweep_stale`, those of fabrics whose process was killed.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lightkeeper.cluster import Host
from lightkeeper.netns import Forwarder, in_netns, libc_setns, setns

log = logging.getLogger(__name__)

SUBNET = "198.18.0"
CIDR = f"{SUBNET}.0/24"  # every address of a fabric, inside its own namespaces
CTL_ADDR = f"{SUBNET}.1"
CTL_NAME = "lightkeeper-ctl"
FIRST_HOST = 10
MAX_HOSTS = 240  # 198.18.0.10 .. 198.18.0.249
NETNS_RUN = Path("/run/netns")
NETNS_ETC = Path("/etc/netns")
# Every name a fabric makes matches this, with the pid of the process that made it.
NAME_RE = re.compile(r"^lkf-(\d+)-(\d+)-(ctl|h\d+|probe)$")
_LINK_RE = re.compile(r"^\d+: ([^:@]+)(?:@[^:]*)?: <([^>]*)>", re.M)  # ip -o link show
_NODE_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,61}[A-Za-z0-9])?$")
# Sets the hostname in the new UTS namespace, then becomes the command (no extra process).
_HOSTNAME_SH = 'echo "$0" > /proc/sys/kernel/hostname && exec "$@"'
_counter = itertools.count()


class FabricError(RuntimeError):
    """A fabric could not be built (the caller falls back to loopback hosts)."""


@dataclass(frozen=True)
class Action:
    """What a fault method did: ``ok=False`` with ``error`` when it could not (logged)."""

    node: str
    fault: str          # rate_limit | partition | disconnect | heal
    detail: str
    ok: bool = True
    error: str = ""
    at: float = field(default_factory=time.time)


def tbf_burst(mbit: float) -> int:
    """Bytes a :meth:`Fabric.rate_limit` of ``mbit`` lets through at line rate (the token
    bucket's depth): 4 ms at the rate, at least 16 KiB (a few full-size packets)."""
    return max(16 * 1024, int(mbit * 1e6 / 8 * 0.004))


def _run(argv: list[str], stdin: str | None = None, timeout: float = 20.0) -> str:
    """Run one ip/tc command; raise :class:`FabricError` with its error line when it fails."""
    try:
        p = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FabricError(f"{' '.join(argv[:4])}: {e}") from None
    if p.returncode != 0:
        err = " ".join((p.stderr or p.stdout).split())[:300]
        raise FabricError(f"{' '.join(argv[:6])} failed: {err}")
    return p.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        pass
    return True


class Fabric:
    """Hosts as network namespaces on a bridge, with network faults (see the module docstring).

    ``Fabric(nodes)`` only names things; :meth:`create` (or :meth:`up`) builds them, removing its
    partial work before it raises. :meth:`close` deletes the namespaces by name: a process still
    inside one keeps it (and its interfaces) alive until it exits, so callers stop their
    processes first.
    """

    def __init__(self, nodes: list[str]) -> None:
        nodes = list(nodes)
        if not nodes or len(nodes) > MAX_HOSTS:
            raise ValueError(f"a fabric has 1..{MAX_HOSTS} hosts, not {len(nodes)}")
        for n in nodes:
            if not _NODE_RE.match(n) or n in (CTL_NAME, "localhost"):
                raise ValueError(f"not a usable host name: {n!r}")
        if len(set(nodes)) != len(nodes):
            raise ValueError("node names must be distinct")
        self.prefix = f"lkf-{os.getpid()}-{next(_counter)}"
        self.ctl_ns = f"{self.prefix}-ctl"
        self.ctl_addr = CTL_ADDR
        self.ctl_name = CTL_NAME
        self.hosts = [Host(n, f"{SUBNET}.{FIRST_HOST + i}", f"{self.prefix}-h{i}")
                      for i, n in enumerate(nodes)]
        self._by_node = {h.node: (i, h) for i, h in enumerate(self.hosts)}
        self.actions: list[Action] = []
        self._lock = threading.RLock()
        self._made_ns: list[str] = []     # namespaces this fabric added (deleted by close)
        self._made_etc: list[Path] = []   # /etc/netns/<ns> directories it wrote
        self._ctl_fd: int | None = None
        self._outside_fd: int | None = None
        self._forwarders: list[Forwarder] = []
        self._rate: dict[str, float] = {}
        self._partitioned: set[str] = set()
        self._disconnected: set[str] = set()
        self._routes: dict[str, set[str]] = {h.node: set() for h in self.hosts}
        self._closed = False
        self._pid = os.getpid()  # a forked child (its atexit) must not remove its parent's
        self._ip = shutil.which("ip") or "ip"
        self._tc = shutil.which("tc") or "tc"
        self._unshare = shutil.which("unshare") or "unshare"

    # --- building and removing -------------------------------------------------------
    @staticmethod
    @functools.cache
    def unavailable() -> str | None:
        """Why no fabric can be built here, in one line, or None (checked once per process:
        root, ``ip``/``tc``/``unshare``, setns(2), and a namespace with a veth actually made
        and removed)."""
        if os.geteuid() != 0:
            return f"network namespaces need root (running as uid {os.geteuid()})"
        for tool in ("ip", "tc", "unshare"):
            if shutil.which(tool) is None:
                return f"{tool} not found on PATH (iproute2 / util-linux)"
        if not os.path.exists("/proc/thread-self/ns/net"):
            return "/proc/thread-self/ns/net is missing"
        try:
            libc_setns()
        except (OSError, AttributeError) as e:
            return f"setns(2) not available from libc: {e}"
        probe = f"lkf-{os.getpid()}-{next(_counter)}-probe"
        try:
            _run(["ip", "netns", "add", probe])
            _run(["ip", "-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0"])
        except FabricError as e:
            return f"cannot make a network namespace with a veth: {e}"
        finally:
            if (NETNS_RUN / probe).exists():
                with contextlib.suppress(FabricError):
                    _run(["ip", "netns", "del", probe])
        return None

    @classmethod
    def create(cls, nodes: list[str]) -> Fabric:
        """A fabric of ``nodes``, built and ready (every link up); raises :class:`FabricError`
        (after removing what it made) when it cannot be built."""
        fabric = cls(nodes)
        fabric.up()
        return fabric

    def up(self) -> Fabric:
        """Build the namespaces, bridge, veths and hosts files; wait until every link is up.
        On failure remove everything made so far and raise :class:`FabricError`; on Ctrl-C
        (KeyboardInterrupt) or SystemExit, remove it and re-raise that unchanged."""
        if self._closed or self._made_ns:
            raise FabricError("a fabric is built once")
        atexit.register(self.close)
        try:
            self._build()
        except BaseException as e:
            self.close()
            # an interrupt stays one: a FabricError means "cannot be built here", and the
            # demo would go on with loopback hosts
            if isinstance(e, FabricError) or not isinstance(e, Exception):
                raise
            raise FabricError(f"building the fabric failed: {e}") from e
        return self

    def _build(self) -> None:
        names = [self.ctl_ns, *(h.netns for h in self.hosts)]
        for ns in names:
            if (NETNS_RUN / ns).exists() or (NETNS_ETC / ns).exists():
                raise FabricError(f"{ns} already exists")
        hosts_file = self._hosts_file()
        for ns in names:
            d = NETNS_ETC / ns
            d.mkdir(parents=True)
            self._made_etc.append(d)
            (d / "hosts").write_text(hosts_file)
        self._made_ns += names  # before they exist: half-made ones are removed too
        _run([self._ip, "-batch", "-"], stdin="".join(f"netns add {ns}\n" for ns in names))
        ctl = ["link set lo up", "link add br0 type bridge",
               f"addr add {CTL_ADDR}/24 dev br0", "link set br0 up"]
        for i, h in enumerate(self.hosts):
            ctl += [f"link add p{i} type veth peer name eth0 netns {h.netns}",
                    f"link set p{i} master br0", f"link set p{i} up"]
        self._ip_batch(self.ctl_ns, ctl)
        self._ctl_fd = os.open(NETNS_RUN / self.ctl_ns, os.O_RDONLY | os.O_CLOEXEC)
        self._outside_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        for h in self.hosts:
            # dead0 -> dead1 (down, so it never delivers): where a partition routes peers to
            self._ip_batch(h.netns, [
                "link set lo up", f"addr add {h.addr}/24 dev eth0", "link set eth0 up",
                "link add dead0 type veth peer name dead1", "link set dead0 arp off",
                "link set dead0 up"])
            # IPv4 sysctls are inherited from the root namespace: a route over a link without
            # carrier (dead0) must be used, not skipped, or a partition would not cut anything.
            fd = os.open(NETNS_RUN / h.netns, os.O_RDONLY | os.O_CLOEXEC)
            try:
                in_netns(fd, _use_linkdown_routes)
            finally:
                os.close(fd)
        self._wait_links_up([(self.ctl_ns, f"p{i}") for i in range(len(self.hosts))])

    def _hosts_file(self) -> str:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
                 f"{CTL_ADDR}\t{CTL_NAME}"]
        lines += [f"{h.addr}\t{h.node}" for h in self.hosts]
        return "# written by lightkeeper.fabric; removed with its namespace\n" + \
            "\n".join(lines) + "\n"

    def _wait_links_up(self, links: list[tuple[str, str]], timeout: float = 5.0) -> None:
        """Until every (namespace, interface) is up with carrier (the bridge forwards through
        a port only then)."""
        deadline = time.monotonic() + timeout
        pending = set(links)
        while True:
            for ns in sorted({ns for ns, _ in pending}):
                out = self._ip_cmd(["-n", ns, "-o", "link", "show"])
                up = {m.group(1) for m in _LINK_RE.finditer(out)
                      if "LOWER_UP" in m.group(2).split(",")}
                pending -= {(ns, i) for i in up}
            if not pending:
                return
            if time.monotonic() > deadline:
                raise FabricError(f"links not up after {timeout:.0f}s: {sorted(pending)}")
            time.sleep(0.02)

    def close(self) -> None:
        """Remove every namespace (and with it its interfaces) and /etc/netns entry this
        fabric made, stop its forwarders. Idempotent; never raises (what fails is logged)."""
        with self._lock:
            if self._closed or os.getpid() != self._pid:
                return
            self._closed = True
        atexit.unregister(self.close)
        for fw in self._forwarders:
            fw.close()
        self._forwarders.clear()
        for attr in ("_ctl_fd", "_outside_fd"):
            fd = getattr(self, attr)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, None)
        _remove(self._made_ns, self._made_etc, self._ip)
        self._made_etc.clear()

    @staticmethod
    def sweep_stale() -> list[str]:
        """Remove the namespaces and /etc/netns entries of fabrics whose process is gone (one
        killed before its close ran), killing what still runs inside them first. Only names a
        fabric makes (``lkf-<pid>-<k>-...``) whose pid no longer runs; a reused pid keeps its
        stale entries until it exits. Returns the names removed."""
        found: dict[str, int] = {}
        for d in (NETNS_RUN, NETNS_ETC):
            with contextlib.suppress(OSError):
                for name in os.listdir(d):
                    m = NAME_RE.match(name)
                    if m:
                        found[name] = int(m.group(1))
        stale = sorted(n for n, pid in found.items() if not _pid_alive(pid))
        ip = shutil.which("ip") or "ip"
        _kill_inside(stale, ip)
        _remove(stale, [NETNS_ETC / n for n in stale], ip)
        return stale

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- reaching into it ------------------------------------------------------------
    def host(self, node: str) -> Host:
        """The host named ``node`` (ValueError: no such host)."""
        return self._index(node)[1]

    def wrap(self, node: str, cmd: list[str]) -> list[str]:
        """argv running ``cmd`` on host ``node``: in its namespace (its /etc/hosts), in a UTS
        namespace of its own whose hostname is ``node``. The process exec's through, so the
        PID of the started argv is the command's."""
        return self._wrap(self.host(node).netns, node, cmd)

    def wrap_ctl(self, cmd: list[str]) -> list[str]:
        """argv running ``cmd`` in the control namespace, hostname ``lightkeeper-ctl``."""
        return self._wrap(self.ctl_ns, CTL_NAME, cmd)

    def _wrap(self, ns: str, hostname: str, cmd: list[str]) -> list[str]:
        return [self._ip, "netns", "exec", ns, self._unshare, "--uts", "/bin/sh", "-c",
                _HOSTNAME_SH, hostname, *cmd]

    @contextlib.contextmanager
    def entered(self):
        """The calling thread in the control namespace until the block ends (setns(2)):
        sockets it creates there, and threads and processes it starts there, are in the
        fabric; sockets made before keep theirs. Names do not resolve through the fabric's
        hosts file here (that is ``ip netns exec``'s doing): use addresses."""
        if self._ctl_fd is None:
            raise FabricError("the fabric is not up")
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            setns(self._ctl_fd)
            try:
                yield self
            finally:
                setns(back)
        finally:
            os.close(back)

    def forward(self, port: int, addr: str | None = None) -> int:
        """A port on 127.0.0.1 in the namespace that built the fabric, forwarded to
        ``addr:port`` (default the control address) in the control namespace, until
        :meth:`close`. Returns the local port."""
        with self._lock:
            if self._ctl_fd is None or self._outside_fd is None:
                raise FabricError("the fabric is not up")
            fw = Forwarder(self._outside_fd, self._ctl_fd, addr or CTL_ADDR, port)
            self._forwarders.append(fw)
            return fw.port

    # --- faults ----------------------------------------------------------------------
    def rate_limit(self, node: str, mbit: float) -> Action:
        """A slow link: ``node``'s traffic limited to ``mbit`` Mbit/s each way (tbf on its
        ``eth0`` egress and on its bridge port's egress; :func:`tbf_burst` bytes pass at line
        rate). A new limit replaces the old."""
        i, h = self._index(node)
        if not mbit > 0:
            raise ValueError(f"rate must be > 0 Mbit/s, not {mbit}")
        burst = tbf_burst(mbit)
        tbf = ["root", "tbf", "rate", f"{int(mbit * 1e6)}bit", "burst", str(burst),
               "latency", "100ms"]

        def apply():
            self._rate[node] = mbit  # first: heal removes a half-applied limit too
            self._tc_cmd(["-n", h.netns, "qdisc", "replace", "dev", "eth0", *tbf])
            self._tc_cmd(["-n", self.ctl_ns, "qdisc", "replace", "dev", f"p{i}", *tbf])
        return self._act(node, "rate_limit", f"{mbit:g} Mbit/s each way, burst {burst} B", apply)

    def partition(self, node: str) -> Action:
        """``node`` cut off from every peer host both ways, still reaching (and reached from)
        the control namespace: each side routes the other's address into a dead end, so
        packets vanish and connections time out."""
        self._index(node)

        def apply():
            self._partitioned.add(node)
            self._sync_routes()
        return self._act(node, "partition", "cut off from its peers, both ways", apply)

    def disconnect(self, node: str) -> Action:
        """``node`` off the network: its ``eth0`` down (packets to it are lost; its own sends
        fail at once: no route)."""
        _, h = self._index(node)

        def apply():
            self._disconnected.add(node)
            self._ip_cmd(["-n", h.netns, "link", "set", "eth0", "down"])
        return self._act(node, "disconnect", "link down", apply)

    def heal(self, node: str) -> Action:
        """Undo every fault of ``node`` (idempotent): rate limit removed, partition lifted,
        link up (waited for)."""
        i, h = self._index(node)

        def apply():
            undone = []
            if node in self._rate:
                for ns, dev in ((h.netns, "eth0"), (self.ctl_ns, f"p{i}")):
                    with contextlib.suppress(FabricError):  # none there: nothing to undo
                        self._tc_cmd(["-n", ns, "qdisc", "del", "dev", dev, "root"])
                undone.append(f"rate limit {self._rate.pop(node):g} Mbit/s removed")
            if node in self._partitioned:
                self._partitioned.discard(node)
                undone.append("partition lifted")
            self._sync_routes()
            self._ip_cmd(["-n", h.netns, "link", "set", "eth0", "up"])
            if node in self._disconnected:
                self._wait_links_up([(h.netns, "eth0"), (self.ctl_ns, f"p{i}")])
                self._disconnected.discard(node)
                undone.append("link up")
            return "; ".join(undone) or "nothing to undo"
        return self._act(node, "heal", "undo every fault", apply)

    def faults(self, node: str) -> list[str]:
        """The faults in force on ``node`` now, e.g. ``["rate_limit 10 Mbit/s", "partition"]``."""
        self._index(node)
        with self._lock:
            out = [f"rate_limit {self._rate[node]:g} Mbit/s"] if node in self._rate else []
            out += ["partition"] if node in self._partitioned else []
            return out + (["disconnect"] if node in self._disconnected else [])

    def _index(self, node: str) -> tuple[int, Host]:
        try:
            return self._by_node[node]
        except KeyError:
            raise ValueError(f"no host {node!r} in this fabric") from None

    def _act(self, node: str, fault: str, intent: str, apply) -> Action:
        """Run ``apply`` (which may return what it did) under the lock; record the Action."""
        with self._lock:
            if self._closed or self._ctl_fd is None:
                action = Action(node, fault, intent, False, "the fabric is not up")
            else:
                try:
                    action = Action(node, fault, apply() or intent)
                except FabricError as e:
                    action = Action(node, fault, intent, False, str(e))
            if not action.ok:
                log.warning("fabric: %s %s not done: %s", fault, node, action.error)
            self.actions.append(action)
            return action

    def _sync_routes(self) -> None:
        """Routes to dead0 for every pair with a partitioned end, none for the others."""
        cut = self._partitioned
        for h in self.hosts:
            want = {p.node for p in self.hosts
                    if p.node != h.node and (h.node in cut or p.node in cut)}
            have = self._routes[h.node]
            if want == have:
                continue
            cmds = [f"route replace {self.host(p).addr}/32 dev dead0 src {h.addr}"
                    for p in sorted(want - have)]
            cmds += [f"route del {self.host(p).addr}/32 dev dead0" for p in sorted(have - want)]
            self._ip_batch(h.netns, cmds)
            self._routes[h.node] = want

    # --- commands --------------------------------------------------------------------
    def _ip_cmd(self, args: list[str]) -> str:
        return _run([self._ip, *args])

    def _ip_batch(self, ns: str, lines: list[str]) -> str:
        return _run([self._ip, "-n", ns, "-batch", "-"], stdin="\n".join(lines) + "\n")

    def _tc_cmd(self, args: list[str]) -> str:
        return _run([self._tc, *args])


def _use_linkdown_routes() -> None:
    for conf in ("all", "dead0"):
        with open(f"/proc/sys/net/ipv4/conf/{conf}/ignore_routes_with_linkdown", "w") as f:
            f.write("0")


def _kill_inside(namespaces: list[str], ip: str) -> None:
    """SIGKILL every process inside the named namespaces (a killed demo's ranks, in sessions of
    their own): deleting a namespace only drops its name, and they would train on, unseen."""
    for ns in namespaces:
        if not (NETNS_RUN / ns).exists():
            continue
        try:
            pids = _run([ip, "netns", "pids", ns], timeout=10).split()
        except FabricError as e:
            log.warning("fabric: listing the processes in %s: %s", ns, e)
            continue
        for pid in pids:
            with contextlib.suppress(ValueError, OSError):  # gone already
                os.kill(int(pid), signal.SIGKILL)


def _remove(namespaces: list[str], etc_dirs: list[Path], ip: str) -> None:
    """Delete the named namespaces that exist and the /etc/netns directories; log failures."""
    live = [ns for ns in namespaces if (NETNS_RUN / ns).exists()]
    if live:
        try:
            _run([ip, "-force", "-batch", "-"], stdin="".join(f"netns del {ns}\n" for ns in live))
        except FabricError as e:
            log.warning("fabric: removing namespaces %s: %s", " ".join(live), e)
    for d in etc_dirs:
        try:
            shutil.rmtree(d)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("fabric: removing %s: %s", d, e)
