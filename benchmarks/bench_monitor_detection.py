"""Detection latency per fault kind on real multi-rank jobs, false findings on healthy ones, and
what a Lighthouse kill leaves behind of a multi-rank group.

Every scenario is a fresh real job: a Lighthouse and 3 replica groups of ``--ranks`` ranks
(default 2: FSDP2 inside a group over gloo, torchft across), each rank its own process (launched
bare, as on other hosts, unless the scenario says torchrun), ``--step-pause`` seconds of data
loading per step, each group on its own "host" (``NODE_NAME``). The monitor (when used) runs
in-process at its defaults (1 s interval, thresholds in docs/monitor.md) plus the
ranks' exit token. Faults strike replica group 2 (its group rank 1 for rank-level faults) at step
``--at``. Scenarios (``--only a,b``; default: the 3x2 set):

- ``straggler``: ``slow_compute:delay=0.4,rank=1``: first slow step -> confirmed, in steps and s;
- ``straggler_group``: ``slow:delay=0.6`` on every rank of the group;
- ``hang_group``: ``hang:where=group,rank=1`` (the peer blocks inside FSDP's all-gather): onset
  (survivors' last committed step) -> confirmed, -> survivors commit again, and whether the hung
  rank was ended by the monitor (``POST /v1/exit``);
- ``dead_rank``: ``crash:rank=1`` (rank 0 lives on in the commit vote): exit -> confirmed;
- ``mismatch_group``: ``mismatch:where=group,rank=1``: strike -> confirmed, and how attributed;
- ``healthy``: ``--healthy-s`` seconds, no fault: findings (target: none);
- ``healthy_shifted``: the same with group 1's wall clock 0.5 s ahead (libfaketime);
- ``kill_torchrun`` / ``kill_bare`` / ``kill_bare_rank0``: no monitor; group 2's rank 1 (rank 0)
  hangs in-group, then the Lighthouse kill (``POST /replica/{id}/kill``): when each of the group's
  processes ends (60 s watch): what torchft's kill alone leaves behind;
- ``hang_short_monitor``/``hang_short_torchft``/``hang_defaults_monitor``/``hang_defaults_torchft``
  (``hang:at_step`` of the whole group before its cross-group all_reduce, 20 s process group +
  5 s join, or torchft's 60/60/60 s; with the monitor or torchft alone) and ``mismatch``
  (cross-group), as measured for 1-rank groups before (``--ranks 1``).

    .venv/bin/python benchmarks/bench_monitor_detection.py                     # the 3x2 set
    .venv/bin/python benchmarks/bench_monitor_detection.py --only healthy --healthy-s 600
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightkeeper.cluster import LocalCluster  # noqa: E402
from lightkeeper.processes import wait_until  # noqa: E402
from monitor.config import MonitorConfig  # noqa: E402
from monitor.service import Monitor  # noqa: E402
from tests.support.faketime import faketime_env  # noqa: E402
from tests.support.workers import try_state  # noqa: E402

SHORT = dict(pg_timeout_s=20, join_timeout_ms=5000, quorum_timeout_s=60)
DEFAULTS = dict(pg_timeout_s=60, join_timeout_ms=60000, quorum_timeout_s=60)
EXIT_TOKEN = "bench-exit"
G = 2  # the group faults strike


class Run:
    def __init__(self, args, fault: str | None, timeouts: dict, monitor: bool,
                 launcher: str = "bare", shifted: int | None = None) -> None:
        self.args = args
        self.dir = tempfile.mkdtemp(dir=args.workdir)
        self.ranks = args.ranks
        self.cluster = LocalCluster(os.path.join(self.dir, "cluster"), num_groups=3,
                                    ranks_per_group=args.ranks, steps=1_000_000,
                                    step_pause_s=args.step_pause, launcher=launcher,
                                    heartbeat_timeout_ms=5000,
                                    extra_env={"LIGHTKEEPER_EXIT_TOKEN": EXIT_TOKEN}, **timeouts)
        base = dict(self.cluster.extra_env)
        self.monitor = None
        self.cluster.start_lighthouse()
        if monitor:
            self.monitor = Monitor(MonitorConfig(port=0, lighthouse=self.cluster.lighthouse_url,
                                                 state_path=os.path.join(self.dir, "m.sqlite"),
                                                 rank_exit_token=EXIT_TOKEN))
        for g in range(3):
            env = {**base, "NODE_NAME": f"host-g{g}"}
            if g == shifted:
                shift = faketime_env(0.5, os.path.join(self.dir, "shim"))
                if shift is None:
                    raise SystemExit("faketime not found: bin/bootstrap --system installs it")
                env.update(shift)
            self.cluster.extra_env = env
            self.cluster.start_group(g, [fault] if fault and g == G else None)
        for g in range(3):
            self.cluster.wait_for_workers(g, timeout=180)
        if self.monitor:
            for url in self.cluster.worker_urls():
                self.monitor.discovery.register({"url": url})
            self.monitor.start(serve=False)
        self.started = time.time()

    def states(self, groups=(0, 1, 2)) -> dict[int, list[dict]]:
        out = {}
        for g in groups:
            grp = self.cluster.groups.get(g)
            got = [s for s in (try_state(u) for u in (grp.worker_urls.values() if grp else []))
                   if s]
            if got:
                out[g] = got
        return out

    def step(self, g: int) -> int:
        return max((s["step"] for s in self.states((g,)).get(g, [])), default=-1)

    def finding(self, kind: str):
        if not self.monitor:
            return None
        return next((f for f in self.monitor.store.findings() if f["kind"] == kind), None)

    def stop(self) -> None:
        if self.monitor:
            self.monitor.stop()
        self.cluster.stop()


def median_step(run: Run, groups=(0, 1)) -> float:
    vals = [v for ss in run.states(groups).values() for s in ss for v in s["recent_step_seconds"]]
    return round(statistics.median(vals), 3) if vals else None


def survivors_commit_after(run: Run, stalled_step: int, timeout: float) -> tuple[float | None, str]:
    """Unix time the survivors (groups 0, 1) all committed past ``stalled_step``, or the time the
    first of them exited (then the job is broken), or None after ``timeout``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = [x for ss in run.states((0, 1)).values() for x in ss]
        if len(s) == 2 * run.ranks and all(x["step"] > stalled_step for x in s):
            return max(x["last_step_at"] for x in s), "committed"
        exited = [g for g in (0, 1) if not run.cluster.groups[g].alive()]
        if exited:  # a survivor died: the job cannot commit with the zombie any more
            return time.time(), f"survivor group(s) {exited} exited"
        time.sleep(0.1)
    return None, "timeout"


def culprits(f: dict) -> dict:
    ev = f["evidence"]
    return {"replica_group": f["replica_group"], "ranks": f["ranks"],
            "hosts": sorted(set(ev.get("culprit_hosts") or []))}


def wait_step(run: Run, g: int, step: int, what: str) -> float:
    return wait_until(lambda: run.step(g) >= step and time.time(), 240, interval=0.05, what=what)


def hang(args, fault: str, timeouts: dict, monitor: bool, wait_s: float) -> dict:
    run = Run(args, fault, timeouts, monitor)
    try:
        wait_step(run, 0, args.at, "the hang step")
        # the stall: the survivors wait in their cross-group all_reduce
        wait_until(lambda: all(x["phase"] == "allreduce" for ss in run.states((0, 1)).values()
                               for x in ss), 60, what="survivors waiting")
        s = [x for ss in run.states((0, 1)).values() for x in ss]
        onset = max(x["last_step_at"] for x in s)
        stalled = max(x["step"] for x in s)
        commit_at, how = survivors_commit_after(run, stalled, wait_s)
        f = run.finding("hang")
        t = None if commit_at is None else round(commit_at - onset, 2)
        out = {"onset_to_commit_s" if how == "committed" else "onset_to_outcome_s": t,
               "outcome": how, "median_step_s": median_step(run)}
        if f:
            out["onset_to_confirmed_s"] = round(f["confirmed_at"] - onset, 2)
            out.update(culprits(f), level=f["evidence"].get("level"))
        if run.monitor:
            ev = run.monitor.store.decisions(decision="evict")
            out["evicted"] = [(d["replica_group"], d["status"]) for d in ev]
            out["orphans_told"] = any("told rank(s)" in (d["detail"] or "") for d in ev)
            grp = run.cluster.groups[G]
            wait_until(lambda: not grp.alive(), 30, what="the evicted group gone")
            out["exit_codes"] = {r: p.returncode for r, p in grp.rank_procs.items()}
        return out
    finally:
        run.stop()


def straggler(args, fault: str, rank: int | None) -> dict:
    run = Run(args, fault, SHORT, True)
    try:
        onset = wait_step(run, G, args.at, "the slow steps")
        f = wait_until(lambda: run.finding("straggler"), 120, what="the straggler finding")
        phases = f["evidence"]["phases"]
        probe = str(rank) if rank is not None else next(iter(phases))
        return {"onset_to_confirmed_s": round(f["confirmed_at"] - onset, 2),
                "steps_after_onset": phases[probe]["step"] - args.at,
                "median_lag_s": f["evidence"]["median_lag_s"],
                "median_step_s": f["evidence"]["median_step_s"], **culprits(f),
                "verdict": f["evidence"]["in_group"]["verdict"]}
    finally:
        run.stop()


def dead_rank(args) -> dict:
    run = Run(args, f"crash:at_step={args.at},rank=1", SHORT, True)
    try:
        grp = run.cluster.groups[G]
        died = wait_until(lambda: grp.rank_procs[1].poll() is not None and time.time(), 240,
                          interval=0.02, what="the rank to crash")
        f = wait_until(lambda: run.finding("dead_rank"), 60, what="the dead_rank finding")
        med = median_step(run)
        return {"exit_to_confirmed_s": round(f["confirmed_at"] - died, 2), "median_step_s": med,
                "target_s": max(5.0, 5 * (med or 0)), **culprits(f)}
    finally:
        run.stop()


def mismatch(args, fault: str) -> dict:
    run = Run(args, fault, SHORT, True)
    try:
        def struck():
            for ss in run.states((G,)).values():
                for s in ss:
                    if s.get("faults_struck_at"):
                        return time.time()
            return None

        onset = wait_until(struck, 240, interval=0.05, what="the mismatched step")
        f = wait_until(lambda: run.finding("mismatch"), 60, what="the mismatch finding")
        return {"strike_to_confirmed_s": round(f["confirmed_at"] - onset, 2), **culprits(f),
                "attributed_by": f["evidence"].get("attributed_by")}
    finally:
        run.stop()


def healthy(args, shifted: int | None) -> dict:
    run = Run(args, None, SHORT, True, shifted=shifted)
    try:
        wait_until(lambda: all(x["num_participants"] == 3 and x["commits"] > 5
                               for ss in run.states().values() for x in ss)
                   and len(run.states()) == 3, 120, what="3 groups training")
        t0, s0 = time.time(), run.step(0)
        while time.time() - t0 < args.healthy_s:
            time.sleep(1.0)
            if not all(run.cluster.groups[g].alive() for g in range(3)):
                break
        findings = run.monitor.store.findings()
        return {"seconds": round(time.time() - t0, 1), "steps": run.step(0) - s0,
                "median_step_s": median_step(run, (0, 1, 2)), "findings": len(findings),
                "kinds": sorted({f["kind"] for f in findings}),
                "evictions": len(run.monitor.store.decisions(decision="evict")),
                "shifted_group": shifted}
    finally:
        run.stop()


def kill(args, launcher: str, hung_rank: int = 1) -> dict:
    """torchft's kill alone on a multi-rank group one of whose ranks hangs in-group (its peer
    blocks inside FSDP's all-gather)."""
    run = Run(args, f"hang:at_step={args.at},where=group,rank={hung_rank}", SHORT, False,
              launcher=launcher)
    try:
        wait_step(run, G, args.at, "the hang step")
        time.sleep(2.0)  # the peer is blocked inside FSDP's all-gather
        states = run.states((G,))[G]
        rid = next(s["replica_id"] for s in states if s["replica_id"])
        pids = {s["group_rank"]: s["pid"] for s in states}
        grp = run.cluster.groups[G]
        t = time.time()
        r = requests.post(f"{run.cluster.lighthouse_url}/replica/{rid}/kill", timeout=10)
        gone: dict = {}
        while time.time() - t < 60 and len(gone) < len(pids) + 1:
            for gr, pid in pids.items():
                if gr not in gone and not _alive(pid):
                    gone[gr] = round(time.time() - t, 2)
            if "launcher" not in gone and not grp.alive():
                gone["launcher"] = round(time.time() - t, 2)
            time.sleep(0.05)
        return {"launcher": launcher, "hung_group_rank": hung_rank,
                "kill_http_status": r.status_code,
                "rank_gone_after_s": {str(k): gone.get(k) for k in pids},
                "group_processes_gone_after_s": gone.get("launcher"),
                "left_running_after_60s": [gr for gr in pids if gr not in gone]}
    finally:
        run.stop()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


SCENARIOS = {
    "straggler": lambda a: straggler(a, f"slow_compute:delay=0.4,from_step={a.at},rank=1",
                                     G * a.ranks + 1),
    "straggler_group": lambda a: straggler(a, f"slow:delay=0.6,from_step={a.at}", None),
    "hang_group": lambda a: hang(a, f"hang:at_step={a.at},where=group,rank=1", SHORT, True, 60),
    "dead_rank": lambda a: dead_rank(a),
    "mismatch_group": lambda a: mismatch(a, f"mismatch:at_step={a.at},where=group,rank=1"),
    "healthy": lambda a: healthy(a, None),
    "healthy_shifted": lambda a: healthy(a, 1),
    "kill_torchrun": lambda a: kill(a, "torchrun"),
    "kill_bare": lambda a: kill(a, "bare"),
    "kill_bare_rank0": lambda a: kill(a, "bare", hung_rank=0),
    "mismatch": lambda a: mismatch(a, f"mismatch:at_step={a.at}"),
    "hang_short_monitor": lambda a: hang(a, f"hang:at_step={a.at}", SHORT, True, 60),
    "hang_short_torchft": lambda a: hang(a, f"hang:at_step={a.at}", SHORT, False, 90),
    "hang_defaults_monitor": lambda a: hang(a, f"hang:at_step={a.at}", DEFAULTS, True, 90),
    "hang_defaults_torchft": lambda a: hang(a, f"hang:at_step={a.at}", DEFAULTS, False, 200),
}
DEFAULT_SET = ("straggler,straggler_group,hang_group,dead_rank,mismatch_group,healthy,"
               "healthy_shifted,kill_torchrun,kill_bare,kill_bare_rank0")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=DEFAULT_SET, help=f"comma separated, of {', '.join(SCENARIOS)}")
    p.add_argument("--ranks", type=int, default=2, help="ranks per replica group (2)")
    p.add_argument("--at", type=int, default=30, help="step at which the fault starts (30)")
    p.add_argument("--step-pause", type=float, default=0.1, help="seconds per step (0.1)")
    p.add_argument("--healthy-s", type=float, default=120.0,
                   help="seconds the healthy scenarios run (120; the target is stated for 600)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    unknown = [n for n in args.only.split(",") if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(unknown)}")
    if args.ranks < 2 and any(n in args.only.split(",") for n in (
            "straggler", "hang_group", "dead_rank", "mismatch_group", "kill_torchrun",
            "kill_bare", "kill_bare_rank0")):
        p.error("rank-level scenarios need --ranks 2 or more")
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="lk-bench-detect-")
    results: dict[str, list[dict]] = {}
    for name in args.only.split(","):
        for _ in range(args.repeat):
            t = time.time()
            r = SCENARIOS[name](args)
            r["wall_s"] = round(time.time() - t, 1)
            results.setdefault(name, []).append(r)
            print(f"{name:>22}: {json.dumps(r)}", flush=True)
    summary = {}
    for name, rows in results.items():
        for key in ("onset_to_confirmed_s", "onset_to_commit_s", "steps_after_onset",
                    "exit_to_confirmed_s", "strike_to_confirmed_s", "findings"):
            vals = [r[key] for r in rows if r.get(key) is not None]
            if vals:
                summary[f"{name}.{key}.median"] = statistics.median(vals)
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
