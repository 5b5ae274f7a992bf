"""A local torchft job: a Lighthouse and replica groups as real processes on this machine.

Used by ``lightkeeper demo`` and by the tests. Every process is started in its own session and
stopped by PID (SIGTERM, then SIGKILL after a grace period); ports are ephemeral; everything
binds 127.0.0.1, except a group started on a :class:`Host` with an address of its own (its
ranks' WorkerServers bind 127.0.0.x; :class:`HostPool` places groups on hosts as a scheduler
honouring a quarantine would). Logs go to files in ``log_dir``.

A group of several ranks is launched with torchrun (``launcher="torchrun"``: its agent relays the
group's store and tears the whole group down when one rank exits) or as bare processes, one per
rank, with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` set, as a
Kubernetes operator runs pods (``launcher="bare"``: group rank 0 hosts the store; a rank that
exits leaves the others running).

**Warm spares** (``start_spare``): a replica group's next incarnation started ahead of need, as a
job's hot spare is: its process(es) (under torchrun the agent and every rank) import torch, torchft
and the trainer, then wait, joining nothing, until :meth:`LocalCluster.start_group` hands them the
go-ahead (a file appears). The restart then skips the interpreter start and the imports (5-12 s on
the 2-core development VM). A spare whose parent is gone exits on its own; one that fails to come
up is not used (the group is started cold). With ``fork_ranks`` (the demo) a torchrun agent
imports the trainer once and forks its ranks and its spare's ranks (lightkeeper/forkrank.py)
instead of each starting an interpreter and importing it all again. See docs/demo.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .processes import SAFE_PATH, ClusterError, free_port, stop_process, wait_until

# The URL must end the line: a line another process's output ran into is not trusted.
WORKER_URL_RE = re.compile(r"group_rank=(\d+) worker_server=(http://[^\s/]+:\d+)$", re.M)
# The Lighthouse reports its URL through a file of its own, written atomically: torchft's Rust
# logger shares the log file and can interleave with a printed line.
#
# The Lighthouse is torchft's Rust extension alone: loaded from its file it starts in ~0.05 s,
# where `torchft.coordination` imports torch first (~2 s of CPU, ahead of every other process
# the demo starts); a torchft laid out otherwise is imported as usual.
LIGHTHOUSE_SCRIPT = r"""
import os, sys, time
try:
    import glob, importlib.util
    _dir = importlib.util.find_spec("torchft").submodule_search_locations[0]
    _spec = importlib.util.spec_from_file_location(
        "torchft._torchft", glob.glob(os.path.join(_dir, "_torchft*.so"))[0])
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    LighthouseServer = _mod.LighthouseServer
except Exception:
    from torchft.coordination import LighthouseServer
addr = sys.argv[5]
lh = LighthouseServer(bind=f"{addr}:0", min_replicas=int(sys.argv[1]),
                      join_timeout_ms=int(sys.argv[2]), heartbeat_timeout_ms=int(sys.argv[3]))
port = lh.address().rsplit(":", 1)[1]
with open(sys.argv[4] + ".tmp", "w") as f:
    f.write(f"http://{addr}:{port}")
os.replace(sys.argv[4] + ".tmp", sys.argv[4])
while True:
    time.sleep(3600)
"""


FORKRANK_PATH = str(Path(__file__).resolve().parent / "forkrank.py")

# torchrun, ended as promptly as its ranks: once its agent returns (its ranks are done, or it
# stopped them), flush and exit, skipping the interpreter's teardown of the torch modules the
# agent imported (1.2 s from the agent's return to its exit measured on a loaded 2-core box).
# argv: torchrun's own.
TORCHRUN_SCRIPT = r"""
import os, sys, traceback
if "--run-path" in sys.argv:  # LocalCluster(fork_ranks=True): import once, fork the ranks
    from lightkeeper.forkrank import preload
    preload()
from torch.distributed.run import main
try:
    main()
    code = 0
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
except BaseException:  # a worker failed (ChildFailedError), or a signal: as torchrun reports it
    traceback.print_exc()
    code = 1
for stream in (sys.stdout, sys.stderr):
    stream.flush()
os._exit(code)
"""


# A warm spare: import what the trainer needs, say so, wait for the go-ahead file, then run
# ``lightkeeper train`` with the arguments it was given. argv: go file, ready file, train args.
SPARE_SCRIPT = r"""
import sys
from worker_server.stop_signal import watch_sigterm
watch_sigterm()  # before torch starts a thread, as `lightkeeper train` does: a planned stop is said
from lightkeeper.forkrank import await_go, preload
preload()  # the imports, and what the first training step would load lazily
args = await_go(sys.argv[1], sys.argv[2])  # ready, then where this incarnation runs
import lightkeeper.cli
sys.argv = ["lightkeeper", *sys.argv[3:], *args]
sys.exit(lightkeeper.cli.main())
"""


@dataclass(frozen=True)
class Host:
    """A host a replica group can run on: its node name (set as ``NODE_NAME`` for its ranks, as
    Kubernetes' downward API does) and the address its ranks bind (``None``: the default,
    127.0.0.1). On one machine each "host" gets a loopback address of its own (Linux routes all
    of 127.0.0.0/8 to ``lo``): see docs/demo.md for what binds there and what cannot."""

    node: str
    addr: str | None = None
    netns: str | None = None  # a network namespace of its own (lightkeeper/fabric.py)

    def __str__(self) -> str:
        return self.node + (f" ({self.addr})" if self.addr else "")


def loopback_hosts(count: int, prefix: str = "node-") -> list[Host]:
    """``count`` hosts ``node-0``.. on 127.0.0.2, 127.0.0.3, ... (127.0.0.1 stays the shared
    services' address: Lighthouse, monitor, Prometheus)."""
    if not 0 <= count <= 250:
        raise ValueError(f"at most 250 loopback hosts (127.0.0.2..127.0.0.251), not {count}")
    return [Host(f"{prefix}{i}", f"127.0.0.{i + 2}") for i in range(count)]


class HostPool:
    """Where each replica group runs, placed as a scheduler honouring the quarantine taint
    places a pod: the first ``groups`` hosts start groups 0..groups-1, the rest are spares.

    :meth:`place` keeps a group on its host unless that host is quarantined; then it moves the
    group to a free host (not quarantined, no other group on it), a never-used spare first.
    None when no host is free: the group waits (the caller says so and asks again later).
    """

    def __init__(self, hosts: list[Host], groups: int) -> None:
        if len({h.node for h in hosts}) != len(hosts):
            raise ValueError("host node names must be distinct")
        if len(hosts) < groups:
            raise ValueError(f"{groups} groups need at least {groups} hosts, got {len(hosts)}")
        self.hosts = list(hosts)
        self.assigned: dict[int, Host] = {g: hosts[g] for g in range(groups)}
        self.used: set[str] = {h.node for h in self.assigned.values()}
        # (group, from node or None, to node, why) per placement that moved a group
        self.moves: list[tuple[int, str | None, str, str]] = []

    def spares(self, quarantined=()) -> list[Host]:
        """Hosts no group runs on and not quarantined, never-used ones first."""
        taken = {h.node for h in self.assigned.values()}
        free = [h for h in self.hosts if h.node not in taken and h.node not in set(quarantined)]
        return sorted(free, key=lambda h: h.node in self.used)  # stable: pool order otherwise

    def host_of(self, group: int) -> Host | None:
        return self.assigned.get(group)

    def place(self, group: int, quarantined=()) -> Host | None:
        """The host ``group``'s next incarnation runs on (recorded), or None: none is free."""
        bad = set(quarantined)
        cur = self.assigned.get(group)
        if cur is not None and cur.node not in bad:
            return cur
        free = self.spares(bad)
        if not free:
            return None
        new = self.assigned[group] = free[0]
        self.used.add(new.node)
        self.moves.append((group, None if cur is None else cur.node, new.node,
                           "quarantined" if cur is not None else "first start"))
        return new


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


@dataclass
class ManagedProcess:
    name: str
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return _read_text(self.log_path)

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class ReplicaGroupProcess(ManagedProcess):
    replica_group: int = 0
    worker_urls: dict[int, str] = field(default_factory=dict)
    faults: list[str] = field(default_factory=list)
    # launcher="bare": one process per group rank (``proc`` is rank 0's); empty under torchrun.
    rank_procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    warm: bool = False  # started from a warm spare (already imported, waiting for the go-ahead)
    host: Host | None = None  # where it runs (None: this machine as it is, no NODE_NAME given)

    def processes(self) -> list[subprocess.Popen]:
        return list(self.rank_procs.values()) or [self.proc]

    def alive(self) -> bool:
        """Whether any process of the group still runs."""
        return any(p.poll() is None for p in self.processes())

    def alive_ranks(self) -> list[int]:
        """Group ranks whose own process runs (launcher="bare"; under torchrun: all or none)."""
        if not self.rank_procs:
            return sorted(self.worker_urls) if self.proc.poll() is None else []
        return sorted(r for r, p in self.rank_procs.items() if p.poll() is None)


@dataclass
class Spare:
    """A group's next incarnation, started ahead of need and waiting (see the module docstring)."""

    group: ReplicaGroupProcess
    go_file: Path
    ready_prefix: Path      # each rank writes ``<ready_prefix>.<pid>`` once it has imported
    ranks: int

    def ready(self) -> bool:
        """Every rank imported and waits (and none exited)."""
        n = len(list(self.ready_prefix.parent.glob(self.ready_prefix.name + ".*")))
        return n >= self.ranks and self.group.alive()


class LocalCluster:
    """A Lighthouse plus replica-group processes (1 rank per group, or torchrun for more)."""

    def __init__(self, log_dir: str | os.PathLike, *, num_groups: int = 2, ranks_per_group: int = 1,
                 steps: int = 1000, job: str = "lightkeeper", min_replicas: int = 1,
                 join_timeout_ms: int = 5000, heartbeat_timeout_ms: int = 5000,
                 pg_timeout_s: float = 20.0, quorum_timeout_s: float = 60.0,
                 step_pause_s: float = 0.0, extra_env: dict[str, str] | None = None,
                 launcher: str = "torchrun", fabric=None, fork_ranks: bool = False) -> None:
        if launcher not in ("torchrun", "bare"):
            raise ValueError(f"launcher must be torchrun or bare, got {launcher!r}")
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.num_groups = num_groups
        self.ranks_per_group = ranks_per_group
        self.steps = steps
        self.job = job
        self.min_replicas = min_replicas
        self.join_timeout_ms = join_timeout_ms
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.pg_timeout_s = pg_timeout_s
        self.quorum_timeout_s = quorum_timeout_s
        self.step_pause_s = step_pause_s
        self.extra_env = dict(extra_env or {})
        self.launcher = launcher
        # torchrun's agent imports the trainer once and forks its ranks (lightkeeper/forkrank.py)
        self.fork_ranks = fork_ranks and launcher == "torchrun" and ranks_per_group > 1
        # Hosts as network namespaces (lightkeeper/fabric.py): the Lighthouse runs in its
        # control namespace, each group in its host's; None: everything on this machine's own
        self.fabric = fabric
        self.lighthouse: ManagedProcess | None = None
        self.lighthouse_url: str | None = None
        self.groups: dict[int, ReplicaGroupProcess] = {}
        self.spares: dict[int, Spare] = {}
        self._restarts: dict[int, int] = {}

    # --- lifecycle -------------------------------------------------------------------
    def start_lighthouse(self, timeout: float = 30.0) -> str:
        log_path = self.log_dir / "lighthouse.log"
        url_path = self.log_dir / "lighthouse.url"
        url_path.unlink(missing_ok=True)
        cmd = [sys.executable, "-u", "-c", LIGHTHOUSE_SCRIPT, str(self.min_replicas),
               str(self.join_timeout_ms), str(self.heartbeat_timeout_ms), str(url_path),
               self.fabric.ctl_addr if self.fabric else "127.0.0.1"]
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(self.fabric.wrap_ctl(cmd) if self.fabric else cmd,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.lighthouse = ManagedProcess("lighthouse", proc, log_path)

        def address():
            if proc.poll() is not None:
                raise ClusterError(f"Lighthouse exited with {proc.returncode}: "
                                   f"{_read_text(log_path)[-2000:]}")
            return _read_text(url_path).strip() or None

        try:
            self.lighthouse_url = wait_until(address, timeout, what="the Lighthouse to listen")
        except BaseException:  # a Ctrl-C or timeout while it starts: none is left running
            stop_process(proc, grace=1.0)
            raise
        return self.lighthouse_url

    def start_group(self, replica_group: int, faults: list[str] | None = None,
                    extra_args: list[str] | None = None,
                    host: Host | None = None, use_spare: bool = True) -> ReplicaGroupProcess:
        """Start (or restart) one replica group's process(es): its warm spare when it has a
        ready one and no faults or extra arguments are asked for, else a fresh start.
        ``use_spare=False``: a fresh start that leaves the group's spare for a later one.

        ``host``: where it runs: its ranks get ``NODE_NAME=host.node`` and, with ``host.addr``,
        bind their WorkerServers there and meet in the group's store at that address (a warm
        spare takes both from its go file, before the trainer starts)."""
        if self.lighthouse_url is None:
            raise ClusterError("start the Lighthouse first")
        old = self.groups.get(replica_group)
        if old is not None and old.alive():
            raise ClusterError(f"replica group {replica_group} is still running")
        spare = self.spares.pop(replica_group, None) if use_spare else None
        # a spare waiting in a host's namespace serves only a start on that host
        fits = spare is not None and (spare.group.host is None or spare.group.host == host)
        if spare is not None and fits and not faults and not extra_args and spare.ready():
            env, args = self._host_env(host), self._host_args(host)
            if host is not None and host.addr and self.ranks_per_group > 1:
                env["MASTER_ADDR"] = host.addr  # the store listens on every address
            if host is not None and host.netns and self.ranks_per_group > 1:
                # torchrun's agent hosts its store in the namespace the spare started in, which
                # its ranks leave: group rank 0 hosts the group's store on its host instead
                import random

                env.update(MASTER_PORT=str(random.randrange(20000, 30000)),
                           TORCHELASTIC_USE_AGENT_STORE="False")
            tmp = spare.go_file.with_suffix(".tmp")
            place = {"netns": host.netns, "node": host.node} if host and host.netns else {}
            tmp.write_text(json.dumps({"at": time.time(), "env": env, "args": args, **place}))
            os.replace(tmp, spare.go_file)
            spare.group.warm = True
            spare.group.host = host
            self.groups[replica_group] = spare.group
            return spare.group
        if spare is not None:  # not ready (or not wanted): a cold start instead
            for proc in spare.group.processes():
                stop_process(proc, grace=0.0)
        group = self._launch(replica_group, faults, extra_args, host=host)
        self.groups[replica_group] = group
        return group

    @staticmethod
    def _host_env(host: Host | None) -> dict[str, str]:
        if host is None:
            return {}
        # gloo takes its address from the hostname, which a spare that moved into the host's
        # namespace cannot resolve: name the interface instead
        return {"NODE_NAME": host.node, **({"GLOO_SOCKET_IFNAME": "eth0"} if host.netns else {})}

    @staticmethod
    def _host_args(host: Host | None) -> list[str]:
        return ["--worker-host", host.addr] if host is not None and host.addr else []

    def start_spare(self, replica_group: int, host: Host | None = None) -> Spare:
        """Start a warm spare for ``replica_group`` (kept until :meth:`start_group` uses it);
        returns the one already there if it still runs. ``host``: a host with a namespace of
        its own, where the spare waits (it can only start the group there)."""
        if self.lighthouse_url is None:
            raise ClusterError("start the Lighthouse first")
        spare = self.spares.get(replica_group)
        if spare is not None and spare.group.alive():
            return spare
        n = self._restarts.get(replica_group, -1) + 1
        base = self.log_dir / f"replica_group_{replica_group}" / f"spare{n}"
        base.parent.mkdir(parents=True, exist_ok=True)
        go, ready = base.with_suffix(".go"), base.with_suffix(".ready")
        go.unlink(missing_ok=True)
        for old in ready.parent.glob(ready.name + ".*"):
            old.unlink(missing_ok=True)
        group = self._launch(replica_group, None, None, spare_files=(go, ready),
                             host=host if host is not None and host.netns else None)
        spare = self.spares[replica_group] = Spare(group, go, ready, self.ranks_per_group)
        return spare

    def stop_spares(self) -> None:
        for spare in list(self.spares.values()):
            for proc in spare.group.processes():
                stop_process(proc, grace=0.0)
        self.spares.clear()

    def _launch(self, replica_group: int, faults: list[str] | None,
                extra_args: list[str] | None,
                spare_files: tuple[Path, Path] | None = None,
                host: Host | None = None) -> ReplicaGroupProcess:
        n = self._restarts[replica_group] = self._restarts.get(replica_group, -1) + 1
        log_path = self.log_dir / f"replica_group_{replica_group}" / (
            "train.log" if n == 0 else f"train.restart{n}.log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        train_args = [
            "train", "--replica-group", str(replica_group),
            "--num-replica-groups", str(self.num_groups), "--lighthouse", self.lighthouse_url,
            "--steps", str(self.steps), "--job", self.job,
            "--pg-timeout", str(self.pg_timeout_s), "--quorum-timeout", str(self.quorum_timeout_s),
            "--step-pause", str(self.step_pause_s),
        ]
        for f in faults or []:
            train_args += ["--inject", f]
        train_args += extra_args or []
        if spare_files is None:
            train_args += self._host_args(host)
        train_cmd = [sys.executable, "-u", "-m", "lightkeeper.cli", *train_args]
        env = {**os.environ, **self.extra_env, "TORCHFT_LIGHTHOUSE": self.lighthouse_url,
               "REPLICA_GROUP_ID": str(replica_group), "NUM_REPLICA_GROUPS": str(self.num_groups),
               "PYTHONUNBUFFERED": "1", **SAFE_PATH, **self._host_env(host)}
        addr = host.addr if host is not None and host.addr else "127.0.0.1"
        if spare_files is not None or self.fork_ranks:
            if self.fork_ranks:  # the agent's forked ranks run forkrank.py (--run-path)
                train_cmd = [FORKRANK_PATH, *(["--spare", str(spare_files[0]), str(spare_files[1])]
                                              if spare_files is not None else []), *train_args]
            else:
                train_cmd = [sys.executable, "-u", "-c", SPARE_SCRIPT, str(spare_files[0]),
                             str(spare_files[1]), *train_args]
            env["LIGHTKEEPER_SPARE_OWNER"] = str(os.getpid())
            env["PYTHONPATH"] = os.pathsep.join(
                [str(Path(__file__).resolve().parent.parent)]
                + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        rank_procs: dict[int, subprocess.Popen] = {}
        # Append mode: every rank writes whole lines to the one log, none overwrites another's.
        log_path.write_bytes(b"")
        with open(log_path, "ab") as out:
            if self.ranks_per_group == 1:
                proc = subprocess.Popen(self._on(host, train_cmd), stdout=out,
                                        stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
            elif self.launcher == "torchrun":
                # --local-addr: the agent gives its ranks MASTER_ADDR=addr (its store itself
                # listens on every address; torch has no bind address for a TCPStore server)
                cmd = [sys.executable, "-c", TORCHRUN_SCRIPT, "--standalone",
                       f"--local-addr={addr}", f"--nproc-per-node={self.ranks_per_group}",
                       *(["--run-path", "--start-method=fork"] if self.fork_ranks
                         else ["--no-python"]), *train_cmd]
                proc = subprocess.Popen(self._on(host, cmd), stdout=out,
                                        stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
            else:
                rendezvous = {"MASTER_ADDR": addr, "MASTER_PORT": str(free_port(addr)),
                              "WORLD_SIZE": str(self.ranks_per_group)}
                for r in range(self.ranks_per_group):
                    rank_procs[r] = subprocess.Popen(
                        self._on(host, train_cmd), stdout=out, stderr=subprocess.STDOUT,
                        env={**env, **rendezvous, "RANK": str(r), "LOCAL_RANK": str(r)},
                        start_new_session=True)
                proc = rank_procs[0]
        return ReplicaGroupProcess(f"replica_group_{replica_group}", proc, log_path,
                                   replica_group=replica_group, faults=list(faults or []),
                                   rank_procs=rank_procs, host=host)

    def _on(self, host: Host | None, cmd: list[str]) -> list[str]:
        """``cmd`` as run on ``host``: inside its network and UTS namespaces when it has them."""
        if host is None or not host.netns or self.fabric is None:
            return cmd
        return self.fabric.wrap(host.node, cmd)

    def wait_for_workers(self, replica_group: int, timeout: float = 60.0) -> dict[int, str]:
        """Wait until every rank of the group printed its WorkerServer URL; returns them."""
        group = self.groups[replica_group]

        def urls():
            text = group.log()
            found = {int(r): u for r, u in WORKER_URL_RE.findall(text)}
            if len(found) >= self.ranks_per_group:
                return found
            if not group.alive():
                raise ClusterError(f"replica group {replica_group} exited with "
                                   f"{group.proc.returncode}: {text[-3000:]}")
            return None

        try:
            group.worker_urls = wait_until(urls, timeout, what=f"replica group {replica_group}'s "
                                                               "WorkerServers")
        except TimeoutError as e:  # its log says where its ranks are
            raise TimeoutError(f"{e}; its log ends: {group.log()[-3000:]}") from None
        return group.worker_urls

    def start(self, faults: dict[int, list[str]] | None = None, timeout: float = 90.0) -> None:
        self.start_lighthouse()
        for g in range(self.num_groups):
            self.start_group(g, (faults or {}).get(g))
        for g in range(self.num_groups):
            self.wait_for_workers(g, timeout)

    def kill_group(self, replica_group: int) -> None:
        for proc in self.groups[replica_group].processes():
            stop_process(proc, grace=0.0)

    def worker_urls(self) -> list[str]:
        return [u for g in self.groups.values() if g.alive() for u in g.worker_urls.values()]

    def stop(self) -> None:
        """Stop every process, by PID: spares at once; SIGTERM to every group's trees together
        (a SIGTERMed rank waits for a monitor's read: one group's wait is not added to the
        next's), 3 s for them all, SIGKILL to what is left; the Lighthouse last."""
        from .processes import descendants, signal_same, stamped

        self.stop_spares()
        procs = [p for g in self.groups.values() for p in g.processes() if p.poll() is None]
        # the trees as they are now: a child whose parent exits is no longer its descendant
        trees = {p: stamped([p.pid, *descendants(p.pid)]) for p in procs}
        signal_same([pp for tree in trees.values() for pp in tree], signal.SIGTERM)
        end = time.monotonic() + 3.0
        for p in procs:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            stop_process(p, grace=0.0)  # SIGKILL its tree as it is now, and reap it
            signal_same(trees[p], signal.SIGKILL)  # and any of its first tree left orphaned
        if self.lighthouse is not None:
            stop_process(self.lighthouse.proc, grace=3.0)

    def pids(self) -> list[int]:
        procs = [p for g in self.groups.values() for p in g.processes()]
        procs += [p for sp in self.spares.values() for p in sp.group.processes()]
        if self.lighthouse:
            procs.append(self.lighthouse.proc)
        return [p.pid for p in procs]

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
