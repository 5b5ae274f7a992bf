"""``lightkeeper demo``: a fault-tolerant job on this machine, faults, detection, eviction, report.

Starts a torchft Lighthouse, ``--groups`` replica groups of ``--ranks-per-group`` ranks (real
processes, gloo on CPU, a WorkerServer on every rank), ``lightkeeper monitor`` and, when the
binary is there, Prometheus with the shipped configuration. Then it plays the scenario
(:mod:`lightkeeper.scenario`): by default healthy -> ``slow_compute`` on one rank of group 1 ->
detected -> evicted -> the demo's supervisor restarts the group (as Kubernetes would) -> it heals
and rejoins -> an in-group ``hang`` on one rank of group 2 -> ... -> healthy end; with
``--inject`` the faults given to the groups at start. Each fault's story (struck, caught,
evicted, back) is followed by a :class:`~lightkeeper.faulttrack.FaultTrack` from what the ranks
and the monitor serve; the scenario ends when every story has ended (each stage has a deadline).
The main loop samples every rank's ``/v1/state`` and the monitor's findings/evictions at ~2 Hz
and records a timeline; at the end (Ctrl-C, SIGTERM and failures included) it writes
``report.json``, ``report.md`` and ``timeline.png`` to ``--report-dir`` and stops every process
it started, by PID. ``--keep-running`` leaves everything up after the scenario until Ctrl-C or
SIGTERM. Each evicted fault's recovery is told stage by stage with its cost from the monitor's
goodput ledger and torchft alone's computed beside it (:mod:`lightkeeper.recovery`); the
supervisor restarts an evicted group from a warm spare (``LocalCluster.start_spare``). Each
group runs on a host of its own (a node name as ``NODE_NAME``, a loopback address for its
ranks' servers) and there are ``--spare-hosts``; the monitor quarantines a bad host and the
supervisor restarts its group on a host that is not quarantined (``HostPool``, reading the
monitor's ``GET /v1/hosts``), or lets it wait when none is free. See docs/demo.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from http_serving import printable

from .faulttrack import Deadlines, FaultTrack, Observation, Strike, finding_culprits
from .recovery import GOODPUT_INCIDENTS, merge_goodput
from .scenario import FaultPlan, Scenario, default_faults, parse_inject, soak_faults

LOCK_NAME = "lightkeeper-demo.lock"
DRAIN_GRACE_S = 5.0  # a group on a quarantined host still running this long after: drained
TICK_S = 0.5
MAX_RESTARTS, MAX_RESTARTS_SOAK = 5, 1000  # per group: a crash loop ends; a soak's do not
SLOW_LINK_MBIT = 20.0  # a live slow_link's rate: the degraded link
SOAK_QUARANTINE_TTL_S = 45.0  # --soak: a quarantined host, repaired, comes back after this
LEDGER_WAIT_S = Scenario.ledger_wait_s  # the default wait for the ledger's back-at-pace verdicts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=int, default=3, help="replica groups (default 3)")
    p.add_argument("--ranks-per-group", type=int, default=2,
                   help="ranks per group (default 2; FSDP inside the group, torchrun)")
    p.add_argument("--steps", type=int, default=None,
                   help="committed steps each group trains; the demo ends when all are done "
                        "(default: unbounded, the scenario decides)")
    p.add_argument("--duration", type=float, default=None,
                   help="stop after this many seconds of training (default: when the scenario "
                        "ends; 60 s with --no-faults)")
    p.add_argument("--inject", action="append", default=[], metavar="GROUP[.RANK]:SPEC",
                   help="give SPEC (as the trainer's --inject, e.g. 1:slow:delay=0.5,"
                        "from_step=40) to GROUP from its start, on every rank or on RANK only "
                        "(1.1:slow_compute:factor=3,from_step=30); repeatable; replaces the "
                        "default scenario")
    p.add_argument("--no-faults", action="store_true", help="run the job healthy")
    p.add_argument("--dry-run", action="store_true",
                   help="the monitor detects and reports but never evicts (nor quarantines)")
    p.add_argument("--report-dir", default=None,
                   help="report and logs (default: a new directory under the system temp dir)")
    p.add_argument("--keep-running", action="store_true",
                   help="after the scenario, leave everything up (Ctrl-C or SIGTERM stops "
                        "it and every process the demo started)")
    p.add_argument("--no-prometheus", action="store_true", help="do not start Prometheus")
    p.add_argument("--spare-hosts", type=int, default=2,
                   help="hosts beyond one per group, for a group whose host is quarantined "
                        "(default 2: each of the default story's two faulty hosts can be "
                        "replaced; docs/demo.md)")
    p.add_argument("--hosts", choices=("auto", "netns", "loopback"), default="auto",
                   help="what a host is: a network namespace of its own on a bridge (netns: "
                        "needs root and iproute2; network faults need it), a loopback address "
                        "(loopback), or netns where it can be built (auto, the default)")
    p.add_argument("--one-host", action="store_true",
                   help="run every group on this machine as it is (no NODE_NAME, 127.0.0.1): "
                        "no other host to move to, so host quarantine is off")
    p.add_argument("--no-quarantine", action="store_true",
                   help="the monitor never quarantines a host (evictions only)")
    p.add_argument("--quarantine-dry-run", action="store_true",
                   help="the monitor decides quarantines and logs them, carries none out")
    p.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                   help="a soak: random faults of every kind, one at a time, for SECONDS of "
                        "training, the monitor restarted half-way; writes soak.json "
                        "(lightkeeper/soak.py, docs/demo.md)")
    p.add_argument("--seed", type=int, default=None,
                   help="the soak's schedule seed (default: a random one, printed)")
    p.add_argument("--cold-restarts", action="store_true",
                   help="restart an evicted group from scratch (default: from a warm spare the "
                        "supervisor started ahead, already imported; docs/demo.md)")
    # stage timings (tests and impatient people); see lightkeeper/scenario.py
    s = Scenario()
    for flag, attr in TIMING_FLAGS:
        p.add_argument(flag, dest=attr, type=float, default=getattr(s, attr),
                       help=argparse.SUPPRESS)
    for flag, attr in LIGHTHOUSE_FLAGS:
        p.add_argument(flag, dest=attr, type=int, default=getattr(s, attr),
                       help=argparse.SUPPRESS)


TIMING_FLAGS = (("--healthy-s", "healthy_s"), ("--end-s", "end_s"),
                ("--ledger-wait", "ledger_wait_s"),
                ("--slow-delay", "slow_delay_s"), ("--strike-timeout", "strike_timeout_s"),
                ("--detect-timeout", "detect_timeout_s"), ("--evict-timeout", "evict_timeout_s"),
                ("--rejoin-timeout", "rejoin_timeout_s"), ("--step-pause", "step_pause_s"),
                ("--hang-floor", "hang_floor_s"), ("--pg-timeout", "pg_timeout_s"))
# the Lighthouse's timeouts (the recovery study, docs/demo.md and docs/lighthouse.md)
LIGHTHOUSE_FLAGS = (("--heartbeat-timeout-ms", "heartbeat_timeout_ms"),
                    ("--join-timeout-ms", "join_timeout_ms"))


def _bad_numbers(args: argparse.Namespace) -> str | None:
    """The first flag whose number cannot run a demo, said with its bound."""
    checks = [("--groups", args.groups, 2), ("--ranks-per-group", args.ranks_per_group, 1),
              ("--steps", args.steps, 1)]
    for flag, value, least in checks:
        if value is not None and value < least:
            return f"{flag} must be >= {least}, got {value}"
    if args.duration is not None and not 0 < args.duration < float("inf"):
        return f"--duration must be a number of seconds > 0, got {args.duration:g}"
    for flag, attr in TIMING_FLAGS + LIGHTHOUSE_FLAGS:
        value = getattr(args, attr)
        if not 0 <= value < float("inf"):  # NaN too
            return f"{flag} must be a number >= 0, got {value:g}"
    return None


def _report_dir(given: str | None) -> Path | None:
    """``--report-dir`` as a path the demo can create or write, or ValueError saying why not;
    nothing is created yet. One that holds a run already is refused: its monitor would reopen
    that run's audit log and quarantines."""
    if given is None:
        return None
    path = Path(given).resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{given}: not a directory")
    held = [n for n in ("report.json", "monitor.sqlite") if (path / n).exists()]
    if held:
        raise ValueError(f"{given}: holds a run already ({', '.join(held)}); give a new or "
                         "empty directory")
    base = next(p for p in (path, *path.parents) if p.exists())
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):  # EROFS too
        raise ValueError(f"{given}: cannot write in {base}")
    return path


# --------------------------------------------------------------------------------------------
class DemoLocked(RuntimeError):
    pass


def acquire_lock():
    """Hold an exclusive lock for this demo's lifetime; DemoLocked names the running one."""
    from monitor.store import LockHeld, pid_lock

    path = Path(tempfile.gettempdir()) / LOCK_NAME
    try:
        return pid_lock(str(path))
    except LockHeld as e:
        raise DemoLocked(f"another lightkeeper demo is running (PID {e.holder}; lock {path}); "
                         "stop it first (Ctrl-C in its terminal, or kill that PID)") from None


class Stop(Exception):
    """The demo's time is up (``--duration``) or every group finished its ``--steps``."""


def _sigterm(*_):
    raise KeyboardInterrupt


# --------------------------------------------------------------------------------------------
class Demo:
    def __init__(self, args: argparse.Namespace, scenario: Scenario, report_dir: Path,
                 fabric=None) -> None:
        from .cluster import LocalCluster

        self.args = args
        self.sc = scenario
        self.dir = report_dir
        self.logs = report_dir / "logs"
        self.token = secrets.token_hex(16)
        self.exit_token = secrets.token_hex(16)
        self.t0_mono = time.monotonic()
        self.t0_unix = time.time()
        self.tty = sys.stdout.isatty()
        self.fabric = fabric
        self.cluster = LocalCluster(
            self.logs, num_groups=args.groups, ranks_per_group=args.ranks_per_group,
            steps=args.steps or 1_000_000, step_pause_s=scenario.step_pause_s,
            pg_timeout_s=scenario.pg_timeout_s, quorum_timeout_s=scenario.quorum_timeout_s,
            join_timeout_ms=scenario.join_timeout_ms,
            heartbeat_timeout_ms=scenario.heartbeat_timeout_ms,
            extra_env={"LIGHTKEEPER_FAULT_TOKEN": self.token,
                       # the monitor tells an evicted group's other ranks to exit (the kill
                       # reaches only its rank 0): the group is gone, and restarted, sooner
                       "LIGHTKEEPER_EXIT_TOKEN": self.exit_token,
                       # the groups share this machine: on a GPU box their ranks would share
                       # GPUs, which NCCL refuses (two ranks of one communicator on a device)
                       "CUDA_VISIBLE_DEVICES": ""},
            fabric=fabric)
        from .cluster import HostPool, loopback_hosts

        # One host per group plus spares, each with a node name and a loopback address of its
        # own; the supervisor places a restarted group off a quarantined host (None: --one-host)
        self.pool: HostPool | None = None if args.one_host else HostPool(
            fabric.hosts if fabric else loopback_hosts(args.groups + args.spare_hosts),
            args.groups)
        self.net_applied: set[int] = set()      # network faults applied (track index)
        self._forwards: dict[tuple, int] = {}    # (addr, port) in the fabric -> 127.0.0.1 port
        self.hosts_view: dict | None = None     # the monitor's newest GET /v1/hosts
        self.quarantines: dict[str, float] = {}  # host -> demo seconds it was quarantined
        self.placements: list[dict] = []         # every group start: where, when, why
        self.waiting: dict[int, float] = {}      # group -> since when it waits for a free host
        self.http = requests.Session()
        self.monitor_proc: subprocess.Popen | None = None
        self.monitor_url: str | None = None
        self.prom = None
        self.prom_note = ""
        self.procs: list[subprocess.Popen] = []
        self.rank_pids: set[int] = set()
        self.samples: list[dict] = []          # one per rank per tick
        self.ticks: list[tuple[float, int]] = []  # (t, job step)
        self.events: list[dict] = []
        self.latest: dict[int, list[dict]] = {}  # group -> latest rank states
        self.findings: list[dict] = []
        self.evictions: list[dict] = []
        self.goodput: dict | None = None  # the newest /v1/goodput, with every incident seen
        self.lighthouse_log: list[dict] = []    # the Lighthouse's /status, each change
        self._lh_reader = None
        self.tracks: list[FaultTrack] = []      # one story per fault, in arming order
        self.strikes: dict[tuple, Strike] = {}  # (group, incarnation, group rank, spec) -> strike
        self.launched_at: dict[int, float] = {}  # group -> demo seconds its first start began
        self.restarts: dict[int, int] = {}      # group -> supervisor restarts (its incarnation)
        self.keeping = False                    # --keep-running: the scenario is over, stay up
        self.train_start_s: float | None = None
        self.stopping = False
        self.deadline: float | None = None     # demo seconds
        self.status = "starting"
        self.interrupted = False
        self.error: str | None = None
        self._last_status_print = 0.0
        self._seen_findings: set = set()
        self._seen_evictions: set = set()
        self._q_seen: set = set()                # (host, quarantined_at) told
        self._log = None
        self.soaking = bool(getattr(args, "soak", None))  # --soak
        self.soak: dict = {"seed": getattr(args, "seed", None),
                           "soak_s": getattr(args, "soak", None), "rss": []}

    @property
    def faults(self) -> list[dict]:
        """The report's ``faults[]``: every story's record."""
        return [tr.record for tr in self.tracks]

    # --- time ---------------------------------------------------------------------------------
    def now(self) -> float:
        return round(time.monotonic() - self.t0_mono, 2)

    def rel(self, unix: float | None) -> float | None:
        return None if unix is None else round(unix - self.t0_unix, 2)

    # --- output -------------------------------------------------------------------------------
    def event(self, kind: str, group: int | None, detail: str) -> None:
        e = {"t": self.now(), "kind": kind, "replica_group": group, "detail": detail}
        self.events.append(e)
        line = printable(f"[{e['t']:7.1f}s] {kind:<12} " + (f"group {group}: " if group is not None
                                                             else "") + detail)
        if self._log:
            self._log.write(line + "\n")
            self._log.flush()
        if not self.tty:
            print(line, flush=True)

    def say(self, text: str) -> None:
        if self._log:
            self._log.write(text + "\n")
            self._log.flush()
        print(text, flush=True)

    def render(self) -> None:
        rows = []
        for g in sorted(self.cluster.groups):
            grp = self.cluster.groups[g]
            st = self.latest.get(g) or []
            if not grp.alive():
                status = f"exited ({grp.proc.returncode})"
            elif not st:
                status = "starting"
            else:
                s = st[0]
                status = ("in quorum" if s["participating"] else "not participating") + \
                    f", {s['phase']}"
                if s.get("faults"):
                    status += f", fault {s['faults'][-1]}"
            step = max((s["step"] for s in st), default=None)
            sec = st[0].get("last_step_seconds") if st else None
            rows.append((g, step, sec, status))
        if self.tty:
            out = ["\x1b[H\x1b[2J", f"lightkeeper demo  t={self.now():6.1f}s  stage: {self.status}",
                   f"report dir: {self.dir}", "",
                   f"{'group':>5}  {'step':>6}  {'step time':>9}  status"]
            for g, step, sec, status in rows:
                out.append(f"{g:>5}  {'-' if step is None else step:>6}  "
                           f"{'-' if sec is None else f'{sec:.2f}s':>9}  {status}")
            out += [""] + [f"fault {tr.index}: {tr.describe()}" for tr in self.tracks]
            out += ["", "events:"]
            for e in self.events[-10:]:
                out.append(f"  [{e['t']:6.1f}s] {e['kind']:<11} "
                           + (f"group {e['replica_group']}: " if e["replica_group"] is not None
                              else "") + e["detail"])
            # the first line clears the screen; the rest hold the ranks' and monitor's text
            sys.stdout.write("\n".join([out[0], *map(printable, out[1:])]) + "\n")
            sys.stdout.flush()
        elif time.monotonic() - self._last_status_print >= 5.0:
            self._last_status_print = time.monotonic()
            parts = [f"g{g} step {'-' if step is None else step}"
                     + (f" {sec:.2f}s" if sec is not None else "") + f" {status}"
                     for g, step, sec, status in rows]
            print(printable(f"[{self.now():7.1f}s] status       {self.status} | "
                            + " | ".join(parts)), flush=True)

    # --- start --------------------------------------------------------------------------------
    def start(self) -> None:
        from .cluster import ClusterError, wait_until

        self.logs.mkdir(parents=True, exist_ok=True)
        self._log = open(self.dir / "demo.log", "a")
        try:
            self.cluster.start_lighthouse()  # stops its process itself if it fails to start
        finally:  # a Ctrl-C as it returns: the Lighthouse is stopped with the rest
            if self.cluster.lighthouse is not None:
                self.procs.append(self.cluster.lighthouse.proc)
        self.event("lighthouse", None, self.cluster.lighthouse_url)
        self.start_monitor()
        self.cluster.extra_env["LIGHTKEEPER_MONITOR"] = self.monitor_url
        specs: dict[int, list[str]] = {}
        from trainer.faults import NETWORK_KINDS

        for plan in self.sc.faults:  # a network fault is the host's: strike_hosts applies it
            if plan.at_start and plan.kind not in NETWORK_KINDS:
                specs.setdefault(plan.replica_group, []).append(plan.spec)
        for g in range(self.args.groups):
            self.launched_at[g] = self.now()
            host = self.pool.place(g) if self.pool else None
            self.placements.append(self._placement(g, host, "first start"))
            self.procs.extend(self.cluster.start_group(g, specs.get(g), host=host).processes())
        self.refill_spares(wait=False)
        for g in range(self.args.groups):
            try:
                self.cluster.wait_for_workers(g, timeout=120)
            except TimeoutError as e:
                raise ClusterError(str(e)) from None
        for g, grp in sorted(self.cluster.groups.items()):
            self.event("started", g, "WorkerServers " + ", ".join(grp.worker_urls.values()))
        self.start_prometheus()
        self.status = "waiting for the first quorum"
        wait_until(lambda: self.tick() or self.all_stepping(), 180, interval=0.0,
                   what="every group to commit a step")
        self.refill_spares(wait=True)  # a spare importing torch would slow the healthy baseline
        self.train_start_s = self.now()
        self.event("training", None, f"all {self.args.groups} groups committing steps")

    def start_monitor(self, port: int = 0) -> None:
        from .cluster import start_monitor_process

        log_path = self.logs / "monitor.log"
        out_path = self.logs / "monitor.out"
        cmd = [sys.executable, "-u", "-m", "lightkeeper.cli", "monitor", "--port", str(port),
               "--lighthouse", self.cluster.lighthouse_url,
               "--state", str(self.dir / "monitor.sqlite"), "--job", self.cluster.job,
               "--sd-out", str(self.dir / "prometheus" / "file_sd" / "lightkeeper.json"),
               "--interval", "0.5", "--cooldown", "5", "--hang-floor", f"{self.sc.hang_floor_s:g}",
               "--expected-groups", str(self.args.groups),
               "--lighthouse-heartbeat-timeout-ms", str(self.sc.heartbeat_timeout_ms),
               "--lighthouse-join-timeout-ms", str(self.sc.join_timeout_ms),
               "--orphan-grace", "1",  # the exit token: in its environment, not argv
               "--min-replicas", str(max(1, self.args.groups - 1))]
        if self.fabric:  # on the bridge: the ranks register from their hosts
            from .fabric import CIDR

            cmd += ["--bind", self.fabric.ctl_addr, "--allow-targets", CIDR]
        cmd += self.quarantine_args()
        if self.args.dry_run:
            cmd.append("--dry-run")
        (self.dir / "prometheus" / "file_sd").mkdir(parents=True, exist_ok=True)
        self.monitor_proc, self.monitor_url = start_monitor_process(
            cmd, out_path, log_path, env={**os.environ, "LIGHTKEEPER_EXIT_TOKEN": self.exit_token})
        self.procs.append(self.monitor_proc)
        self.event("monitor", None, self.user_url(self.monitor_url)
                   + (" (dry run)" if self.args.dry_run else ""))

    def quarantine_args(self) -> list[str]:
        """The monitor's host-quarantine flags (docs/demo.md, "Hosts"). Off with --one-host
        (every rank on one machine: quarantining it would end the demo) or --no-quarantine.
        The cap is the number of spare hosts: each quarantine moves a group to a spare, and
        one more would leave a group waiting; the default 10% of 3-5 hosts is 1, which would
        hold the second of two faulty hosts."""
        from monitor.config import QUARANTINE_AFTER

        a = self.args
        if a.one_host or a.no_quarantine:  # every kind that counts by default, off
            return ["--quarantine-after", ",".join(f"{k}=0" for k in QUARANTINE_AFTER)]
        out = ["--max-quarantined", str(max(1, a.spare_hosts))]
        if self.soaking:  # a repaired host returns once its quarantine expires
            out += ["--quarantine-ttl", f"{SOAK_QUARANTINE_TTL_S:g}"]
        if a.quarantine_dry_run or a.dry_run:  # --dry-run acts on nothing, hosts included
            out.append("--quarantine-dry-run")
        return out

    def _placement(self, g: int, host, why: str) -> dict:
        return {"replica_group": g, "at_s": self.now(), "node": host.node if host else None,
                "addr": host.addr if host else None, "why": why}

    def start_prometheus(self) -> None:
        from dashboards.promconfig import prometheus_config

        from . import prometheus

        if self.args.no_prometheus:
            self.prom_note = "not started (--no-prometheus)"
            return
        if prometheus.binary() is None:
            self.prom_note = f"not started: {prometheus.INSTALL_HINT}"
            self.event("prometheus", None, self.prom_note)
            return
        rules = Path(__file__).resolve().parent.parent / "dashboards" / "prometheus" / "rules.yml"
        cfg = prometheus_config(
            file_sd_files=[str(self.dir / "prometheus" / "file_sd" / "*.json")],
            monitor_targets=[self.monitor_url.split("://", 1)[1]],
            rule_files=[str(rules)] if rules.exists() else [], scrape_interval="2s")
        try:
            self.prom = prometheus.start(cfg, self.dir / "prometheus")
        except prometheus.PrometheusError as e:
            self.prom_note = f"failed to start: {str(e).splitlines()[0]}"
            self.event("prometheus", None, self.prom_note)
            return
        self.procs.append(self.prom.proc)
        self.prom_note = f"{self.user_url(self.prom.url)} (config {self.prom.config_path})"
        self.event("prometheus", None, self.prom_note)

    # --- sampling -----------------------------------------------------------------------------
    def user_url(self, url: str | None) -> str | None:
        """``url`` as a user on this machine reaches it: on a fabric, through a forward from
        127.0.0.1 into the job's network (its addresses exist only in its namespaces)."""
        if not url or self.fabric is None:
            return url
        import urllib.parse

        from .fabric import FabricError

        u = urllib.parse.urlsplit(url)
        if (u.hostname, u.port) not in self._forwards:
            try:
                self._forwards[(u.hostname, u.port)] = self.fabric.forward(u.port,
                                                                           addr=u.hostname)
            except FabricError:  # the final report, once the fabric is gone
                return url
        return u._replace(netloc=f"127.0.0.1:{self._forwards[(u.hostname, u.port)]}").geturl()

    def state(self, url: str) -> dict | None:
        from .cluster import get_json

        return get_json(self.http, url + "/v1/state", 1.0)

    def monitor_get(self, path: str) -> list | None:
        from .cluster import get_json

        return None if self.monitor_url is None else get_json(self.http, self.monitor_url + path,
                                                              2.0)

    def tick(self) -> None:
        """One sampling round (~TICK_S): ranks, monitor, supervisor, live view, deadline."""
        from .cluster import WORKER_URL_RE

        started = time.monotonic()
        t = self.now()
        job_step = -1
        for g, grp in sorted(self.cluster.groups.items()):
            if grp.alive() and len(grp.worker_urls) < self.args.ranks_per_group:
                grp.worker_urls = {int(r): u for r, u in WORKER_URL_RE.findall(grp.log())}
            states = [s for s in (self.state(u) for u in grp.worker_urls.values())
                      if s] if grp.alive() else []
            self.latest[g] = states
            incarnation = self.restarts.get(g, 0)
            for s in states:
                for spec, at in (s.get("faults_struck_at") or {}).items():
                    key = (g, incarnation, s["group_rank"], spec)
                    if key not in self.strikes:
                        self.strikes[key] = Strike(g, incarnation, s["group_rank"], s["rank"],
                                                   printable(str(s.get("host") or "?")), spec,
                                                   float(at))
                self.rank_pids.add(int(s["pid"]))
                job_step = max(job_step, s["step"])
                self.samples.append({
                    "t": t, "replica_group": g, "rank": s["rank"], "step": s["step"],
                    "participating": s["participating"],
                    "num_participants": s["num_participants"], "phase": s["phase"],
                    "last_step_seconds": s["last_step_seconds"],
                    "last_step_at_s": self.rel(s["last_step_at"]),
                    "quorum_id": s.get("quorum_id"),
                    "replica_id": s["replica_id"], "faults": list(s.get("faults") or []),
                    "host": s.get("host"), "worker_url": s.get("worker_url")})
        self.ticks.append((t, job_step))
        self.poll_lighthouse(t)
        self.poll_monitor()
        self.supervise()
        self.strike_hosts()
        if self.soaking:
            from .soak import repair_hosts

            repair_hosts(self)
        self.follow_stories()
        self.render()
        why = self.run_over(t)
        if why:
            raise Stop(why)
        time.sleep(max(0.0, TICK_S - (time.monotonic() - started)))

    def run_over(self, t: float) -> str | None:
        """Why the run ends at ``t``: its ``--duration`` of training is up, or every group
        trained its ``--steps`` and exited 0; None while it goes on (always, once it keeps
        running: then only Ctrl-C or SIGTERM ends it)."""
        if self.keeping:
            return None
        if self.deadline is not None and self.train_start_s is not None \
                and t >= self.train_start_s + self.deadline:
            return f"--duration {self.deadline:g}s reached"
        if self.args.steps and self.cluster.groups and all(
                not g.alive() and g.proc.returncode == 0 for g in self.cluster.groups.values()):
            return f"every group trained {self.args.steps} steps"
        return None

    def poll_lighthouse(self, t: float) -> None:
        """The Lighthouse's own view (``/status``): its newest quorum and which heartbeats it
        counts as stale; one entry in ``lighthouse_log`` per change."""
        from monitor.evidence.lighthouse_status import LighthouseReader

        if self.cluster.lighthouse_url is None:
            return
        if self._lh_reader is None:
            self._lh_reader = LighthouseReader(self.cluster.lighthouse_url, timeout_s=1.0)
        st, _err = self._lh_reader.read()
        if st is None:
            return
        entry = {"quorum_id": st.quorum_id, "members": sorted(st.members),
                 "heartbeating": sorted(r for r in st.heartbeats if r not in st.stale),
                 "stale": sorted(st.stale)}
        if not self.lighthouse_log or any(self.lighthouse_log[-1][k] != v
                                          for k, v in entry.items()):
            self.lighthouse_log.append({"t": t, **entry})

    def poll_goodput(self) -> None:
        g = self.monitor_get(f"/v1/goodput?incidents={GOODPUT_INCIDENTS}&intervals=0")
        if isinstance(g, dict):
            self.goodput = merge_goodput(self.goodput, g)

    def poll_hosts(self) -> None:
        """The monitor's host ledger (``GET /v1/hosts``): one event per host quarantined,
        with the time the monitor quarantined it."""
        body = self.monitor_get("/v1/hosts")
        if not isinstance(body, dict) or not isinstance(body.get("hosts"), list):
            return
        self.hosts_view = body
        for h in body["hosts"]:
            name = h.get("host")
            if h.get("state") != "quarantined" or (name, h.get("quarantined_at")) in self._q_seen:
                continue
            self._q_seen.add((name, h.get("quarantined_at")))  # again after a release: told
            at = self.rel(h.get("quarantined_at")) if h.get("quarantined_at") else self.now()
            self.quarantines[name] = at
            self.event("quarantined", None, f"host {name} quarantined at {at:.1f}s "
                                            f"({h.get('reason') or h.get('kind')})")

    def poll_monitor(self) -> None:
        self.poll_goodput()
        self.poll_hosts()
        findings = self.monitor_get("/v1/findings")
        if findings is not None:
            self.findings = findings
            for f in findings:
                key = (f["kind"], f["replica_group"], f.get("replica_id"), f.get("first_seen"))
                if key not in self._seen_findings and f.get("confirmed_at"):
                    self._seen_findings.add(key)
                    culprits, hosts = finding_culprits(f)
                    named = [f"ranks {f['ranks']}" if f.get("ranks") else None,
                             f"culprit ranks {culprits}" if culprits else None]
                    named = ", ".join(n for n in named if n) or "job-wide"  # job_stall names none
                    self.event("detected", f["replica_group"],
                               f"{f['kind']} ({named}"
                               + (f" on {', '.join(dict.fromkeys(hosts))}" if hosts else "")
                               + f") at {self.rel(f['confirmed_at']):.1f}s")
        evictions = self.monitor_get("/v1/evictions")
        if evictions is not None:
            self.evictions = evictions
            for d in evictions:
                key = (d.get("id"), d["replica_group"], d.get("at"), d["decision"])
                if key not in self._seen_evictions:
                    self._seen_evictions.add(key)
                    kind = {"evict": "evicted", "abort": "survivors_released"}.get(
                        d["decision"], "held")
                    self.event(kind, d["replica_group"], f"{d['decision']} ({d['reason']})")

    def supervise(self) -> None:
        """Restart any group whose process exited (evicted, crashed), as a scheduler would."""
        if self.stopping:
            return
        self.drain_quarantined()
        refreshed = False
        for g, grp in sorted(self.cluster.groups.items()):
            if grp.alive() or (self.args.steps and grp.proc.returncode == 0):
                continue
            if not refreshed:  # the monitor may have quarantined the host this very sweep
                self.poll_hosts()
                refreshed = True
            n = self.restarts.get(g, 0)
            if n >= (MAX_RESTARTS_SOAK if self.soaking else MAX_RESTARTS):
                continue
            old = self.pool.host_of(g) if self.pool else None
            # the monitor's quarantine list, as a scheduler reads a node's taint; before the
            # monitor ever answered, nothing is known to be quarantined
            bad = set((self.hosts_view or {}).get("quarantined") or [])
            host = self.pool.place(g, bad) if self.pool else None
            if self.pool and host is None:
                if g not in self.waiting:
                    self.waiting[g] = self.now()
                    self.event("waiting", g, f"host {old.node if old else '?'} is quarantined "
                                             "and no other host is free: the group waits")
                continue
            waited = self.waiting.pop(g, None)
            self.restarts[g] = n + 1
            code = grp.proc.returncode
            moved = host is not None and old is not None and host.node != old.node
            why = (f"{old.node} quarantined" if moved else "same host") if host else "restart"
            self.placements.append(self._placement(g, host, why))
            new = self.cluster.start_group(g, host=host)
            self.procs.extend(p for p in new.processes() if p not in self.procs)
            where = "" if host is None else (
                f" on {host}" + (f", spare host ({old.node} quarantined)" if moved else ""))
            self.event("restarted", g, f"process exited ({code}); supervisor restarted it"
                                       f"{where} (restart {n + 1}, "
                                       + ("warm spare" if new.warm else "cold start")
                                       + (f", after waiting {self.now() - waited:.1f}s for a "
                                          "free host" if waited is not None else "") + ")")

    def strike_hosts(self) -> None:
        """Apply each armed network fault to its group's host once the group reaches the
        fault's step (the fault models the host, so it strikes every rank on it, then)."""
        from trainer.faults import parse_fault

        for tr in self.tracks:
            f = parse_fault(tr.record["spec"])
            g = tr.group
            if not f.network or tr.index in self.net_applied or tr.done \
                    or self.restarts.get(g, 0) != tr.incarnation \
                    or self.group_step(g) < tr.trigger_step or not self.pool:
                continue
            self.net_applied.add(tr.index)
            host = self.pool.host_of(g)
            if f.kind == "slow_link":
                act = self.fabric.rate_limit(host.node, f.mbit)
            elif f.kind == "partition":
                act = self.fabric.partition(host.node)
            else:
                act = self.fabric.disconnect(host.node)
            if not act.ok:
                tr.fail("injection failed", f"{f.spec} on {host.node}: {act.error}")
                self.event("error", g, f"could not apply {f.spec} to {host.node}: {act.error}")
                continue
            ranks = {s["group_rank"]: s["rank"] for s in self.latest.get(g) or []}
            for r in range(self.args.ranks_per_group):
                self.strikes[(g, tr.incarnation, r, f.spec)] = Strike(
                    g, tr.incarnation, r, ranks.get(r, g * self.args.ranks_per_group + r),
                    host.node, f.spec, act.at)
            self.event("network", g, f"{host.node}: {act.detail}")

    def drain_quarantined(self) -> None:
        """Stop the processes of a group whose host the monitor quarantined, as a scheduler
        evicts the pods of a tainted node (NoExecute): a host off the network never hears
        the Lighthouse's kill, and its group must still move. The supervisor restarts it."""
        from .cluster import stop_process

        bad = set((self.hosts_view or {}).get("quarantined") or [])
        for g, grp in sorted(self.cluster.groups.items()):
            host = self.pool.host_of(g) if self.pool else None
            if host is None or host.node not in bad or not grp.alive():
                continue
            # as a NoExecute taint's toleration: an evicted group exits by itself first
            if self.now() - self.quarantines.get(host.node, self.now()) < DRAIN_GRACE_S:
                continue
            for proc in grp.processes():
                stop_process(proc, grace=0.0)
            self.event("drained", g, f"host {host.node} quarantined: its processes stopped, "
                                     "as a scheduler evicts a tainted node's pods")

    def refill_spares(self, wait: bool, timeout: float = 90.0) -> None:
        """Give every group a warm spare (unless --cold-restarts): with the job at its start
        and once the scenario is over (--keep-running), never while it is measured: a group
        restarted twice in one scenario starts cold the second time. With ``wait``, tick until
        they have all imported (at most ``timeout`` s: a spare not ready then is not used)."""
        if not self.sc.warm_spares or self.stopping:
            return
        for g in range(self.args.groups):
            had = g in self.cluster.spares and self.cluster.spares[g].group.alive()
            spare = self.cluster.start_spare(g)
            if not had:
                self.procs.extend(spare.group.processes())
                self.event("spare", g, "warm spare started (imports, then waits)")
        if wait:
            self.wait(lambda: all(sp.ready() for sp in self.cluster.spares.values()), timeout)

    # --- predicates ---------------------------------------------------------------------------
    def all_stepping(self) -> bool:
        return len(self.cluster.groups) == self.args.groups and all(
            len(self.latest.get(g) or []) == self.args.ranks_per_group
            and all(s["step"] >= 1 for s in self.latest[g]) for g in self.cluster.groups)

    def group_step(self, g: int) -> int:
        return max((s["step"] for s in self.latest.get(g) or []), default=-1)

    def job_step(self) -> int:
        return max((self.group_step(g) for g in self.cluster.groups), default=-1)

    def wait(self, pred, timeout: float) -> bool:
        """Tick until ``pred()`` or ``timeout`` seconds; raises Stop at the demo's deadline."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.tick()
            if pred():
                return True
        return False

    # --- stories ------------------------------------------------------------------------------
    def observation(self) -> Observation:
        groups = self.cluster.groups
        return Observation(
            t=self.now(), t0_unix=self.t0_unix, groups=self.args.groups,
            ranks_per_group=self.args.ranks_per_group, states=self.latest,
            incarnation={g: self.restarts.get(g, 0) for g in groups},
            alive={g: grp.alive() for g, grp in groups.items()},
            finished={g: not grp.alive() and grp.proc.returncode == 0
                      for g, grp in groups.items()},
            strikes=list(self.strikes.values()), findings=self.findings,
            evictions=self.evictions,
            restarts=[(e["replica_group"], e["t"]) for e in self.events
                      if e["kind"] == "restarted"],
            samples=self.samples, quarantines=dict(self.quarantines),
            placements=list(self.placements))

    def follow_stories(self) -> None:
        if not self.tracks:
            return
        obs = self.observation()
        for tr in self.tracks:
            tr.note_hosts(obs)
        open_tracks = [tr for tr in self.tracks if not tr.done]
        for tr in open_tracks:
            for kind, detail in tr.update(obs):
                self.event(kind, tr.group, detail)
            tr.note_hosts(obs)
        still = [f"fault {tr.index}: {tr.describe()}" for tr in open_tracks if not tr.done]
        if still:
            self.status = "; ".join(still)

    def deadlines(self) -> Deadlines:
        sc = self.sc
        return Deadlines(strike_s=sc.strike_timeout_s, detect_s=sc.detect_timeout_s,
                         evict_s=sc.evict_timeout_s, rejoin_s=sc.rejoin_timeout_s)

    def arm(self, spec: str, g: int, given: str, armed_at_s: float) -> FaultTrack:
        """Start following ``spec`` in group ``g`` (already given to it, or just injected)."""
        from trainer.faults import parse_fault

        f = parse_fault(spec)
        tr = FaultTrack(
            len(self.tracks) + 1, replica_group=g, group_rank=f.rank, spec=f.spec, kind=f.kind,
            trigger_step=f.from_step if f.kind in ("slow", "slow_compute", "slow_link")
            else f.at_step,
            given=given, armed_at_s=armed_at_s, counting_from_s=self.now(),
            incarnation=self.restarts.get(g, 0), step_at_arming=self.group_step(g),
            ranks_per_group=self.args.ranks_per_group, deadlines=self.deadlines())
        self.tracks.append(tr)
        return tr

    def story_over(self) -> bool:
        return all(tr.done for tr in self.tracks)

    def ledger_settled(self) -> bool:
        """Every evicted fault's incident in the monitor's ledger has its back-at-pace time."""
        from .recovery import ledger_incident

        for f in self.faults:
            if f["evicted_at_s"] is None:
                continue
            inc = ledger_incident(f, self.goodput, self.t0_unix)
            if inc is None or inc.get("back_to_pace_at") is None:
                return False
        return True

    def run_scenario(self) -> None:
        plans = self.sc.faults
        if not plans:
            self.status = "healthy"
            while True:
                self.tick()
        for plan in plans:
            if plan.at_start:
                tr = self.arm(plan.spec, plan.replica_group, "start",
                              self.launched_at[plan.replica_group])
                self.event("armed", plan.replica_group,
                           f"{plan.spec} (given at start; strikes from step {tr.trigger_step})")
        live = [plan for plan in plans if not plan.at_start]
        if live:
            self.status = f"healthy ({self.sc.healthy_s:g}s)"
            self.wait(lambda: False, self.sc.healthy_s)
        for plan in live:  # one at a time: the next once the last one's story is over
            self.status = "following the faults"
            self.wait(self.story_over, float("inf"))
            # and the monitor's ledger saw the job back at pace: each fault measured alone
            self.wait(self.ledger_settled, self.sc.ledger_wait_s)
            if self.soaking and not self.soak_turn():
                break
            # No refill of a used spare here: its import would slow the job that is being
            # measured (on this machine a spare shares the cores; a real one waits elsewhere).
            self.inject_live(plan)
        self.status = "following the faults"
        self.wait(self.story_over, float("inf"))  # every stage of every story has a deadline
        self.event("story", None, "every fault's story is over: " + "; ".join(
            f"{tr.index}: {tr.record['outcome']}" for tr in self.tracks))
        self.status = f"healthy end ({self.sc.end_s:g}s)"
        self.wait(lambda: False, self.sc.end_s)
        # The ledger says a job is back at pace once a whole pace window (20 steps, 3 s at
        # least) after the eviction was at pace: give it that long to say so (at most
        # --ledger-wait, 30 s).
        self.status = "waiting for the monitor's ledger to see the job back at pace"
        self.wait(self.ledger_settled, self.sc.ledger_wait_s)

    def soak_turn(self) -> bool:
        """Between two of a soak's faults: False once its time is up; the monitor restarted
        once, half-way; the spares refilled (a soak restarts groups many times)."""
        from .soak import restart_monitor, rss_kb

        trained = self.now() - (self.train_start_s or 0.0)
        if trained >= self.args.soak:
            return False
        if "restart" not in self.soak and trained >= self.args.soak / 2:
            self.soak["rss"].append({"life": 1, "end_kb": rss_kb(self.monitor_proc.pid)})
            self.soak["restart"] = restart_monitor(self)
            self.soak["rss"].append({"life": 2, "start_kb": rss_kb(self.monitor_proc.pid)})
        self.refill_spares(wait=True)
        return True

    # --- live injection -----------------------------------------------------------------------
    def post_fault(self, urls: list[str], spec: str) -> bool:
        ok = bool(urls)
        for url in urls:
            try:
                r = self.http.post(url + "/v1/faults", json={"spec": spec}, timeout=5,
                                   headers={"Authorization": f"Bearer {self.token}"})
                ok = ok and r.ok
            except requests.RequestException:
                ok = False
        return ok

    def fresh_step(self, g: int) -> int:
        steps = [s["step"] for s in (self.state(u) for u in
                                     self.cluster.groups[g].worker_urls.values()) if s]
        return max(steps, default=self.group_step(g))

    def live_spec(self, plan: FaultPlan, step: int) -> str:
        """The spec of a default fault, from the group's current ``step``."""
        rank = "" if plan.group_rank is None else f",rank={plan.group_rank}"
        at = step + self.sc.hang_in_steps
        if plan.kind in ("slow", "slow_compute"):
            return f"{plan.kind}:delay={self.sc.slow_delay_s:g},from_step={step}{rank}"
        if plan.kind == "slow_link":
            return f"slow_link:mbit={SLOW_LINK_MBIT:g},from_step={at}"
        if plan.kind in ("partition", "host_offline", "crash"):  # no where= in their grammar
            return f"{plan.kind}:at_step={at}{rank}"
        where = ",where=group" if self.args.ranks_per_group > 1 else ""
        return f"{plan.kind}:at_step={at}{where}{rank}"

    def inject_live(self, plan: FaultPlan) -> None:
        """Inject a default fault into the running target rank (every rank: group-wide); a
        network fault is armed for a step ahead and applied to the group's host then."""
        from trainer.faults import NETWORK_KINDS

        g = plan.replica_group
        self.wait(lambda: self.group_step(g) >= 1 and len(self.latest.get(g) or [])
                  == self.args.ranks_per_group, self.sc.rejoin_timeout_s)
        if plan.kind in NETWORK_KINDS:
            spec = self.live_spec(plan, self.fresh_step(g))
            self.arm(spec, g, "live", self.now())
            self.event("injected", g, f"{spec} (on host {self.pool.host_of(g).node})")
            return
        urls = self.cluster.groups[g].worker_urls
        targets = [urls[plan.group_rank]] if plan.group_rank in urls else list(urls.values())
        ok, spec, given_at = False, "", self.now()
        for _attempt in range(3):  # the step read may be stale on a busy box: check, retry
            cur = self.fresh_step(g)
            spec = self.live_spec(plan, cur)
            # injected when the POST goes out: a fault from the current step strikes while
            # the answer (and the step check after it) is on its way on a busy box
            given_at = self.now()
            ok = self.post_fault(targets, spec) and (
                plan.kind in ("slow", "slow_compute")
                or self.fresh_step(g) < cur + self.sc.hang_in_steps)
            if ok:
                break
        tr = self.arm(spec, g, "live", given_at)
        if not ok:
            tr.fail("injection failed", f"POST /v1/faults {spec} to {', '.join(targets)} failed, "
                                        "or the group passed the step first (3 tries)")
            self.event("error", g, f"could not inject {spec}")
            return
        self.event("injected", g, spec + ("" if plan.group_rank is None
                                          else f" (rank {plan.group_rank} only)"))

    # --- stop & report ------------------------------------------------------------------------
    def stop(self, grace: float = 3.0) -> None:
        """Stop every process the demo started and their descendants, by PID: SIGTERM to all at
        once, ``grace`` seconds for all of them together, then SIGKILL whatever is left."""
        from .cluster import descendants, signal_same, stamped, stop_process

        self.stopping = True
        self.status = "stopping"
        running = [p for p in reversed(self.procs) if p.poll() is None]
        # the trees as they are now: a child whose parent exits is no longer its descendant.
        # With start times: a PID that exits during the grace may be another process's after
        trees = {p: stamped([p.pid, *descendants(p.pid)]) for p in running}
        signal_same([pp for tree in trees.values() for pp in tree], signal.SIGTERM)
        end = time.monotonic() + grace
        for p in running:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in reversed(self.procs):
            try:
                stop_process(p, grace=0.0)  # SIGKILL the rest of its tree and reap it
                signal_same(trees.get(p, [])[1:], signal.SIGKILL)
            except Exception as e:  # keep stopping the others
                self.say(f"lightkeeper demo: could not stop PID {p.pid}: {e}")
        if self._log:
            self._log.close()
            self._log = None

    def pids(self) -> list[int]:
        return sorted({p.pid for p in self.procs} | self.rank_pids)

    def report(self) -> dict:
        from .report import build_report

        return build_report(self)


# --------------------------------------------------------------------------------------------
def missing_trainer_packages() -> list[str]:
    """The packages the demo's ranks import that this environment lacks (found, not imported)."""
    import importlib.util

    return [name for name in ("torch", "torchft") if importlib.util.find_spec(name) is None]


def run(args: argparse.Namespace) -> int:
    bad = _bad_numbers(args)
    if bad:
        print(f"lightkeeper demo: {bad}", file=sys.stderr)
        return 2
    if not 0 <= args.spare_hosts or args.groups + args.spare_hosts > 250:
        print("lightkeeper demo: --spare-hosts must be >= 0, and --groups plus --spare-hosts "
              "at most 250 (one loopback address each: 127.0.0.2..127.0.0.251)", file=sys.stderr)
        return 2
    try:  # every placement is checked before anything starts
        plans = [parse_inject(v, args.groups, args.ranks_per_group) for v in args.inject]
    except ValueError as e:
        print(f"lightkeeper demo: {e}", file=sys.stderr)
        return 2
    if args.no_faults and plans:
        print("lightkeeper demo: --no-faults and --inject exclude each other", file=sys.stderr)
        return 2
    for given, flag, other in ((args.seed is not None and args.soak is None, "--seed",
                                "needs --soak (it seeds the soak's schedule)"),
                               (args.one_host and args.hosts == "netns", "--one-host",
                                "and --hosts netns exclude each other")):
        if given:
            print(f"lightkeeper demo: {flag} {other}", file=sys.stderr)
            return 2
    if args.soak is not None and (not args.soak > 0 or plans or args.no_faults):
        print("lightkeeper demo: --soak takes seconds > 0 and draws its own faults (no "
              "--inject, no --no-faults)", file=sys.stderr)
        return 2
    try:  # before the lock and the hosts: a run never starts without a place for its report
        report_dir = _report_dir(args.report_dir)
    except ValueError as e:
        print(f"lightkeeper demo: --report-dir {e}", file=sys.stderr)
        return 2
    missing = missing_trainer_packages()
    if missing:  # a core install (monitor, analyze, dashboards) has neither
        print(f"lightkeeper demo: needs {' and '.join(missing)} to train; install them with "
              "pip install 'lightkeeper[trainer]' (docs/install.md)", file=sys.stderr)
        return 2
    # From here a SIGTERM is a Ctrl-C: the default action would leave the namespaces being
    # built, and every process started, behind
    old_term = signal.signal(signal.SIGTERM, _sigterm)
    try:
        return _run(args, plans, report_dir, old_term)
    finally:
        signal.signal(signal.SIGTERM, old_term)


def _run(args: argparse.Namespace, plans: list, report_dir: Path | None, old_term) -> int:
    from .cluster import ClusterError
    from .report import write_report

    fabric, hosts_note = None, None
    if not args.one_host and args.hosts != "loopback":
        try:
            fabric, hosts_note = build_fabric(args.groups + args.spare_hosts)
        except KeyboardInterrupt:  # what was made of the hosts is removed already
            print("\nlightkeeper demo: interrupted while building the hosts; nothing started",
                  file=sys.stderr)
            return 130
        if fabric is None and args.hosts == "netns":
            print(f"lightkeeper demo: --hosts netns: {hosts_note}", file=sys.stderr)
            return 2
    if args.soak:
        if args.seed is None:
            args.seed = secrets.randbelow(2**31)
        plans = soak_faults(args.seed, args.groups, args.ranks_per_group,
                            network=fabric is not None)
        print(f"lightkeeper demo: soak of {args.soak:g}s, seed {args.seed} (--seed "
              f"{args.seed} repeats the schedule)", flush=True)
    faults = [] if args.no_faults else plans or default_faults(
        args.groups, args.ranks_per_group, network=fabric is not None)
    sc = Scenario(faults=faults, healthy_s=args.healthy_s, end_s=args.end_s,
                  ledger_wait_s=args.ledger_wait_s,
                  slow_delay_s=args.slow_delay_s, strike_timeout_s=args.strike_timeout_s,
                  detect_timeout_s=args.detect_timeout_s,
                  evict_timeout_s=args.evict_timeout_s, rejoin_timeout_s=args.rejoin_timeout_s,
                  step_pause_s=args.step_pause_s, hang_floor_s=args.hang_floor_s,
                  pg_timeout_s=args.pg_timeout_s, heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                  join_timeout_ms=args.join_timeout_ms,
                  # nothing is evicted with --no-faults or --dry-run: no restart to be ready for
                  warm_spares=not (args.cold_restarts or args.no_faults or args.dry_run))
    try:
        lock = acquire_lock()
    except DemoLocked as e:
        print(f"lightkeeper demo: {e}", file=sys.stderr)
        if fabric:
            fabric.close()
        return 1
    from trainer.faults import NETWORK_KINDS

    network = [p.spec for p in faults if p.kind in NETWORK_KINDS]
    if network and fabric is None:
        print(f"lightkeeper demo: {network[0]} is a network fault: it needs hosts that are "
              f"network namespaces (--hosts netns; {hosts_note or 'not with --one-host'})",
              file=sys.stderr)
        os.close(lock)
        return 2
    try:
        report_dir = report_dir or Path(tempfile.mkdtemp(prefix="lightkeeper-demo-")).resolve()
        report_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"lightkeeper demo: --report-dir {report_dir}: {e.strerror or e}", file=sys.stderr)
        if fabric:
            fabric.close()
        os.close(lock)
        return 2
    demo = Demo(args, sc, report_dir, fabric)
    inside = fabric.entered() if fabric else contextlib.nullcontext()
    inside.__enter__()  # the demo's own requests reach the job's network
    demo.deadline = args.duration if args.duration is not None else (
        60.0 if not faults and not args.steps else None)
    code = 0
    try:
        print(f"lightkeeper demo: {args.groups} replica groups x {args.ranks_per_group} rank(s); "
              f"report and logs in {report_dir}", flush=True)
        if hosts_note:
            print(f"lightkeeper demo: {hosts_note}", flush=True)
        elif fabric:
            print(f"lightkeeper demo: hosts are network namespaces "
                  f"({', '.join(f'{h.node} {h.addr}' for h in fabric.hosts)}; the Lighthouse "
                  f"and monitor on {fabric.ctl_addr})", flush=True)
        try:
            demo.start()
            if args.soak:
                from .soak import rss_kb

                demo.soak["rss"].append({"life": 1, "start_kb": rss_kb(demo.monitor_proc.pid)})
            demo.run_scenario()
        except Stop as e:
            demo.event("stop", None, str(e))
        if args.keep_running:
            demo.keeping = True  # from here only Ctrl-C or SIGTERM ends it
            demo.refill_spares(wait=False)  # an eviction by hand restarts warm too
            write_report(demo, report_dir, final=False)
            print_keep_running(demo)
            while True:
                demo.tick()
    except Stop:
        pass
    except KeyboardInterrupt:
        if demo.keeping:  # the way --keep-running ends: the scenario itself completed
            print("\nlightkeeper demo: stopping everything", flush=True)
        else:
            demo.interrupted = True
            code = 130
            print("\nlightkeeper demo: interrupted; stopping everything", flush=True)
    except (ClusterError, TimeoutError, OSError) as e:
        demo.error = str(e)
        code = 1
        print(f"lightkeeper demo: {e}", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # a second Ctrl-C would lose the report: everything is being stopped already
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for tr in demo.tracks:
                tr.stop(demo.now())
            if demo.monitor_url and demo.monitor_proc and demo.monitor_proc.poll() is None:
                demo.poll_goodput()  # the ledger's last word, before the monitor stops
                if args.soak:
                    from .soak import rss_kb

                    demo.soak["rss"].append({"life": 1 + ("restart" in demo.soak),
                                             "end_kb": rss_kb(demo.monitor_proc.pid)})
            demo.stop()
        finally:
            inside.__exit__(None, None, None)
            if fabric:
                fabric.close()  # after its processes: nothing is left inside
            signal.signal(signal.SIGTERM, old_term)
            os.close(lock)
    summary = write_report(demo, report_dir, final=True)
    print(summary, flush=True)
    if args.soak:
        import json

        from . import soak

        out = soak.summary(json.loads((report_dir / "report.json").read_text()), demo.soak,
                           demo.samples)
        out["command"] = " ".join(["lightkeeper", *sys.argv[1:]])
        (report_dir / "soak.json").write_text(json.dumps(out, indent=1))
        print(soak.table(out), flush=True)
    print(f"report: {report_dir / 'report.md'}  json: {report_dir / 'report.json'}  "
          f"timeline: {report_dir / 'timeline.png'}", flush=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if code == 0 and demo.faults and any(f["outcome"] != "recovered" for f in demo.faults) \
            and not args.dry_run:
        print("lightkeeper demo: not every fault went the whole way; see the table",
              file=sys.stderr)
    return code


def build_fabric(hosts: int):
    """(a fabric of ``hosts`` namespaced hosts, None) or (None, the one line that says why not
    and that loopback addresses stand in)."""
    from .fabric import Fabric, FabricError

    why = Fabric.unavailable()
    if why is None:
        Fabric.sweep_stale()  # what a killed earlier run left
        try:
            return Fabric.create([f"node-{i}" for i in range(hosts)]), None
        except FabricError as e:
            why = str(e).splitlines()[0]
    return None, f"hosts are loopback addresses, not network namespaces ({why})"


def print_keep_running(demo: Demo) -> None:
    lines = ["", f"the cluster keeps running (Ctrl-C or SIGTERM to PID {os.getpid()} stops it); "
                 f"report so far in {demo.dir}. Try:",
             f"  curl {demo.user_url(demo.monitor_url)}/v1/cluster",
             f"  curl {demo.user_url(demo.monitor_url)}/v1/findings",
             f"  curl {demo.user_url(demo.monitor_url)}/v1/evictions",
             f"  open {demo.user_url(demo.monitor_url)}/   (monitor overview)",
             f"  Lighthouse status: {demo.user_url(demo.cluster.lighthouse_url)}/status"]
    for g, grp in sorted(demo.cluster.groups.items()):
        for r, u in sorted(grp.worker_urls.items()):
            lines.append(f"  curl {demo.user_url(u)}/v1/state      # group {g} rank {r}")
    if demo.fabric:
        lines.append(f"  (hosts are network namespaces {demo.fabric.ctl_ns} and "
                     f"{', '.join(h.netns for h in demo.fabric.hosts)}: these URLs are forwards "
                     "into them; `ip netns exec <ns> ...` reaches the rest)")
    lines.append(f"  Prometheus: {demo.prom_note or 'not started'}")
    lines.append("  Grafana: import the dashboards from dashboards/generated/ with that Prometheus "
                 "as data source (see docs/dashboards.md or `lightkeeper dashboards --help`)")
    demo.say("\n".join(lines))
