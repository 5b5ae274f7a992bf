"""The running demo (:class:`Demo`): its state, its clock, what it prints and its loop.

One :meth:`Demo.tick` (~2 Hz) reads every rank and the monitor, lets the supervisor act, applies
the network faults that are due, follows every fault's story, redraws the live view and ends the
run at its deadline. The parts live one per module, each a mixin over the one shared state below
(the report, the soak and the tests read it as ``demo.<name>``):

- :mod:`lightkeeper.demo_processes`: the processes the demo starts and stops;
- :mod:`lightkeeper.demo_sampling`: what the ranks, the Lighthouse and the monitor serve;
- :mod:`lightkeeper.demo_supervisor`: the supervisor, playing Kubernetes;
- :mod:`lightkeeper.demo_stories`: the scenario, its faults injected and their stories followed.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import requests

from http_serving import printable

from .demo_processes import Processes
from .demo_sampling import Sampling, TreeCpu
from .demo_stories import Stories
from .demo_supervisor import Supervisor
from .faulttrack import FaultTrack, Strike
from .scenario import Scenario

TICK_S = 0.5


class Stop(Exception):
    """The demo's time is up (``--duration``) or every group finished its ``--steps``."""


class Demo(Processes, Sampling, Supervisor, Stories):
    def __init__(self, args: argparse.Namespace, scenario: Scenario, report_dir: Path,
                 fabric=None) -> None:
        from .cluster import LocalCluster

        self.args = args
        self.sc = scenario
        self.dir = report_dir
        self.logs = report_dir / "logs"
        self.token = secrets.token_hex(16)
        self.exit_token = secrets.token_hex(16)
        # the monitor's admin token (a release, an eviction by hand: the user's, in a file) and
        # the ranks' own to register with (the admin one alone would refuse them)
        self.admin_token = secrets.token_hex(16)
        self.register_token = secrets.token_hex(16)
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
                       "LIGHTKEEPER_REGISTER_TOKEN": self.register_token,
                       # the groups share this machine: on a GPU box their ranks would share
                       # GPUs, which NCCL refuses (two ranks of one communicator on a device)
                       "CUDA_VISIBLE_DEVICES": ""},
            fabric=fabric,
            # torchrun's agent imports the trainer once and forks its ranks: 6 ranks and 6
            # spare ranks importing torch at once on 2 cores are most of the start-up
            fork_ranks=True)
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
        self.cpu = TreeCpu(os.getpid())         # the demo's processes and every one they start
        self.cpu_ticks: list[tuple[float, float, float]] = []  # (t, machine busy s, the tree's)
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

    # --- the loop -----------------------------------------------------------------------------
    def tick(self) -> None:
        """One sampling round (~TICK_S): ranks, monitor, supervisor, live view, deadline."""
        started = time.monotonic()
        t = self.now()
        self.sample_cpu(t)
        self.sample_ranks(t)
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

    def wait(self, pred, timeout: float) -> bool:
        """Tick until ``pred()`` or ``timeout`` seconds; raises Stop at the demo's deadline."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.tick()
            if pred():
                return True
        return False

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

    def report(self) -> dict:
        from .report import build_report

        return build_report(self)
