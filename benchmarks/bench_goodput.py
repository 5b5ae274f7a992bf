"""Goodput under faults, side by side in one run: Lightkeeper against torchft alone.

The same job (``--groups`` x ``--ranks-per-group``, the demo's shape: 3 x 2, FSDP inside a
group, gloo on CPU; :class:`lightkeeper.cluster.LocalCluster`: a real Lighthouse and real
ranks) trains for the same ``--duration`` seconds, from the moment every group has committed a
step, under the same fault schedule, four ways one after the other:

- ``fault_free``: no faults (the demo's timeouts);
- ``torchft_defaults``: the faults, torchft alone at torchft's own defaults (process-group and
  quorum timeouts 60 s, Lighthouse ``join_timeout_ms`` 60000, ``heartbeat_timeout_ms`` 5000);
- ``torchft_tuned``: the faults, torchft alone at the short timeouts the demo uses
  (``--tuned-*`` flags; defaults: the demo's values);
- ``lightkeeper``: the faults, the demo's timeouts, ``lightkeeper monitor`` evicting.

The schedule is in wall time after training starts, the same for every faulty run: at
``--slow-at`` seconds the last rank of group 1 is throttled (``slow_compute:delay=...,rank=R``,
from its current step), at ``--hang-at`` the last rank of group 2 hangs inside the group
(``hang:at_step=...,where=group,rank=R``, 3 steps ahead). Both are injected into the running
rank through its token-guarded ``POST /v1/faults``, as the demo does. In every run a supervisor
restarts a group whose processes exited (as Kubernetes would; the demo's supervisor), so a
group evicted by the monitor, or one that torchft let die, comes back the same way in every run:
as the demo does, from a warm spare (one per group, started and imported before the job starts,
used once; ``--cold-restarts``: from scratch).

``lightkeeper monitor`` runs in every run with the demo's flags and the ranks' exit token (so each
run carries the same polling load), with ``--dry-run`` in all but the Lightkeeper run: it detects and keeps its
goodput ledger but never evicts (``--no-monitor-alone``: no monitor in the torchft-alone runs).

Ground truth, read from the ranks themselves, none of it from the ledger
(``benchmarks/goodput_truth.py``):

- committed steps: every ``step=N ... committed=True`` line each rank logs (its own clock,
  millisecond resolution), per group, every incarnation;
- fault onsets: the target rank's ``/v1/state`` ``faults_struck_at`` (polled at 2 Hz);
- the healthy baseline: the mean step (time elapsed / steps committed) before the first
  injection, from 2 s after the measured run began.

Figures per run: committed samples per wall-second (group-steps x ranks per group x batch),
goodput by the ledger's definitions applied to the ground truth (:func:`goodput_from_commits`),
badput split by the fault window it fell in, per fault onset -> job back at >= 90% of healthy
pace (held for a second window, :func:`back_at_pace`) and the replica-seconds it cost, by cause
(:func:`fault_truth`), and, where a monitor ran, its ledger (``GET /v1/goodput``) over the same
window with badput by cause. :func:`reconcile` checks the ledger against the ground truth with
tolerances in seconds and replica-seconds, against what one fault costs. Output: a table,
``--out`` JSON and ``--png`` (committed samples over time).

    .venv/bin/python benchmarks/bench_goodput.py                       # 4 x ~2.5 min
    .venv/bin/python benchmarks/bench_goodput.py --duration 30 --slow-at 8 --hang-at 18 \\
        --runs fault_free,lightkeeper                                  # a quick look
    .venv/bin/python benchmarks/bench_goodput.py --table benchmarks/results/goodput.json

Every process it starts is stopped by PID (Ctrl-C and SIGTERM included). A run that fails to
start is recorded with its error and the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.goodput_truth import (  # noqa: E402
    badput_by_window,
    badput_in_window,
    commits_in,
    fault_truth,
    goodput_from_commits,
    healthy_step_s,
    job_commit_times,
    ledger_window,
    parse_commit_log,
    reconcile,
)

RUNS = ("fault_free", "torchft_defaults", "torchft_tuned", "lightkeeper")


@dataclass(frozen=True)
class Timeouts:
    """torchft's timeouts for one run (LocalCluster's parameters)."""

    pg_timeout_s: float
    quorum_timeout_s: float
    join_timeout_ms: int
    heartbeat_timeout_ms: int


# torchft 0.2.0's own defaults: Manager(timeout=60 s, quorum_timeout=60 s) and
# torchft_lighthouse --join_timeout_ms 60000 --heartbeat_timeout_ms 5000.
TORCHFT_DEFAULTS = Timeouts(60.0, 60.0, 60000, 5000)


def demo_monitor_args(groups: int) -> str:
    """The monitor flags the demo runs with (lightkeeper/demo_processes.py), less its ports and
    files."""
    from lightkeeper.scenario import Scenario

    floor = getattr(Scenario(), "hang_floor_s", None)
    return (f"--interval 0.5 --cooldown 5 --min-replicas {max(1, groups - 1)}"
            + (f" --hang-floor {floor:g}" if floor is not None else ""))


def demo_warm_spares() -> bool:
    """Whether the demo's supervisor restarts a group from a warm spare (LocalCluster)."""
    from lightkeeper.cluster import LocalCluster
    from lightkeeper.scenario import Scenario

    return bool(getattr(Scenario(), "warm_spares", False)) and hasattr(LocalCluster,
                                                                       "start_spare")


def demo_timeouts() -> Timeouts:
    """The timeouts the demo runs with (lightkeeper/demo.py, lightkeeper/scenario.py)."""
    from lightkeeper.scenario import Scenario

    sc = Scenario()
    return Timeouts(float(getattr(sc, "pg_timeout_s", 20.0)),
                    float(getattr(sc, "quorum_timeout_s", 60.0)),
                    int(getattr(sc, "join_timeout_ms", 5000)),
                    int(getattr(sc, "heartbeat_timeout_ms", 5000)))


# --------------------------------------------------------------------------------------------
# One run: a job, its supervisor, the schedule, the monitor
class Run:
    def __init__(self, name: str, args: argparse.Namespace, timeouts: Timeouts, faults: bool,
                 monitor: str | None, work: Path) -> None:
        import requests

        from lightkeeper.cluster import LocalCluster

        self.name, self.args, self.timeouts, self.faults = name, args, timeouts, faults
        self.monitor_mode = monitor  # "evict", "dry_run" or None
        self.dir = work / name
        self.token = secrets.token_hex(16)
        # the demo's ranks' token: the monitor ends an evicted group's other ranks and aborts the
        # survivors' collective with a group gone (docs/monitor.md), as it does in the demo
        self.exit_token = secrets.token_hex(16)
        self.cluster = LocalCluster(
            self.dir / "logs", num_groups=args.groups, ranks_per_group=args.ranks_per_group,
            steps=1_000_000, step_pause_s=args.step_pause, pg_timeout_s=timeouts.pg_timeout_s,
            quorum_timeout_s=timeouts.quorum_timeout_s, join_timeout_ms=timeouts.join_timeout_ms,
            heartbeat_timeout_ms=timeouts.heartbeat_timeout_ms,
            extra_env={"LIGHTKEEPER_FAULT_TOKEN": self.token,
                       "LIGHTKEEPER_EXIT_TOKEN": self.exit_token})
        self.http = requests.Session()
        self.monitor_proc: subprocess.Popen | None = None
        self.monitor_url: str | None = None
        self.procs: list[subprocess.Popen] = []
        self.incarnation: dict[int, int] = {}
        self.events: list[dict] = []  # restarts, exits, injections (unix times)
        self.strikes: dict[tuple, dict] = {}
        self.t_start: float | None = None
        self.spares_ready = False

    # --- processes ----------------------------------------------------------------------------
    def start(self) -> None:
        from lightkeeper.processes import wait_until

        self.dir.mkdir(parents=True, exist_ok=True)
        self.cluster.start_lighthouse()
        self.procs.append(self.cluster.lighthouse.proc)
        if self.monitor_mode:
            self.start_monitor()
            self.cluster.extra_env["LIGHTKEEPER_MONITOR"] = self.monitor_url
        # One imported spare per group, as the demo keeps, ready before the job starts: on a
        # cluster spares import elsewhere; here, importing beside a running job would slow it
        # and the ledger would learn that slow start as the job's healthy pace.
        if self.args.warm_spares:
            for g in range(self.args.groups):
                self.procs.extend(self.cluster.start_spare(g).group.processes())
            try:  # a spare not ready by then is not used: that group restarts cold
                self.spares_ready = wait_until(
                    lambda: all(sp.ready() for sp in self.cluster.spares.values()), 120,
                    interval=0.5, what="the warm spares to import")
            except TimeoutError:
                self.spares_ready = False
        for g in range(self.args.groups):
            self.incarnation[g] = 0
            self.procs.extend(self.cluster.start_group(g, use_spare=False).processes())
        for g in range(self.args.groups):
            self.cluster.wait_for_workers(g, timeout=180)
        wait_until(self.all_stepping, 240, interval=0.5, what="every group to commit a step")

    def start_monitor(self) -> None:
        from lightkeeper.processes import start_monitor_process

        out_path, log_path = self.dir / "monitor.out", self.dir / "monitor.log"
        cmd = [sys.executable, "-u", "-m", "lightkeeper.cli", "monitor", "--port", "0",
               "--lighthouse", self.cluster.lighthouse_url,
               "--state", str(self.dir / "monitor.sqlite"),
               "--expected-groups", str(self.args.groups), *shlex.split(self.args.monitor_args)]
        if self.monitor_mode == "dry_run":
            cmd.append("--dry-run")
        self.monitor_proc, self.monitor_url = start_monitor_process(
            cmd, out_path, log_path, env={**os.environ, "LIGHTKEEPER_EXIT_TOKEN": self.exit_token})
        self.procs.append(self.monitor_proc)

    def stop(self) -> None:
        from lightkeeper.processes import stop_process

        for p in reversed(self.procs):
            try:
                stop_process(p, grace=3.0)
            except Exception as e:  # keep stopping the others
                print(f"bench_goodput: could not stop PID {p.pid}: {e}", file=sys.stderr)

    # --- sampling -----------------------------------------------------------------------------
    def state(self, url: str) -> dict | None:
        from lightkeeper.processes import get_json

        return get_json(self.http, url + "/v1/state", 1.0)

    def states(self, g: int) -> list[dict]:
        from lightkeeper.cluster import WORKER_URL_RE

        grp = self.cluster.groups[g]
        if not grp.alive():
            return []
        if len(grp.worker_urls) < self.args.ranks_per_group:
            grp.worker_urls = {int(r): u for r, u in WORKER_URL_RE.findall(grp.log())}
        return [s for s in (self.state(u) for u in grp.worker_urls.values()) if s]

    def all_stepping(self) -> bool:
        return all(len(st) == self.args.ranks_per_group and all(s["step"] >= 1 for s in st)
                   for st in (self.states(g) for g in range(self.args.groups)))

    def tick(self) -> None:
        """Record strikes; restart a group whose processes all exited (the supervisor)."""
        for g in range(self.args.groups):
            for s in self.states(g):
                for spec, at in (s.get("faults_struck_at") or {}).items():
                    key = (g, self.incarnation[g], s.get("group_rank"), spec)
                    self.strikes.setdefault(key, {
                        "replica_group": g, "group_rank": s.get("group_rank"),
                        "incarnation": self.incarnation[g], "spec": spec,
                        "kind": spec.split(":", 1)[0], "at": float(at)})
            grp = self.cluster.groups[g]
            if not grp.alive() and self.incarnation[g] < 5:
                code = grp.proc.returncode
                self.incarnation[g] += 1
                new = self.cluster.start_group(g)
                self.procs.extend(p for p in new.processes() if p not in self.procs)
                self.events.append({"at": time.time(), "event": "restart", "replica_group": g,
                                    "detail": f"exited ({code}); "
                                              + ("warm spare" if getattr(new, "warm", False)
                                                 else "cold start")})

    def monitor_get(self, path: str):
        from lightkeeper.processes import get_json

        return get_json(self.http, self.monitor_url + path, 5.0) if self.monitor_url else None

    # --- faults -------------------------------------------------------------------------------
    def inject(self, g: int, kind: str) -> bool:
        """POST the fault to the last rank of group ``g``, from its current step; True once
        it is armed ahead of the rank (a hang whose step the group passed first is retried)."""
        import requests

        rank = self.args.ranks_per_group - 1
        grp = self.cluster.groups[g]
        url = grp.worker_urls.get(rank)
        s = self.state(url) if url else None
        if s is None:
            return False
        cur = int(s["step"])
        placed = f",rank={rank}" if self.args.ranks_per_group > 1 else ""
        if kind == "slow_compute":
            spec = f"slow_compute:delay={self.args.slow_delay:g},from_step={cur}{placed}"
        else:
            where = ",where=group" if self.args.ranks_per_group > 1 else ""
            spec = f"hang:at_step={cur + 3}{where}{placed}"
        try:
            r = self.http.post(url + "/v1/faults", json={"spec": spec}, timeout=5,
                               headers={"Authorization": f"Bearer {self.token}"})
        except requests.RequestException:
            return False
        if not r.ok:
            return False
        if kind == "hang":
            s = self.state(url)
            if s is None or int(s["step"]) >= cur + 3:
                return False
        self.events.append({"at": time.time(), "event": "inject", "replica_group": g,
                            "detail": spec})
        return True

    # --- the run ------------------------------------------------------------------------------
    def run(self) -> dict:
        self.start()
        self.t_start = time.time()
        ledger0 = self.monitor_get("/v1/goodput?incidents=0&intervals=0")
        end = self.t_start + self.args.duration
        todo = []
        if self.faults:
            todo = [(self.t_start + self.args.slow_at, 1 % self.args.groups, "slow_compute"),
                    (self.t_start + self.args.hang_at, 2 % self.args.groups, "hang")]
        tries: dict[str, int] = {}
        snaps, next_snap = [], 0.0
        while time.time() < end:
            began = time.time()
            if self.monitor_url and began >= next_snap:  # the ledger's totals every 2 s
                next_snap = began + 2.0
                led = self.monitor_get("/v1/goodput?incidents=0&intervals=0")
                if led:
                    snaps.append({"at": led.get("at"), "job": led.get("job"),
                                  "baseline": led.get("baseline")})
            for item in list(todo):
                at, g, kind = item
                if began >= at:
                    tries[kind] = tries.get(kind, 0) + 1
                    if self.inject(g, kind):
                        todo.remove(item)
                    elif tries[kind] >= 20:
                        todo.remove(item)
                        self.events.append({"at": time.time(), "event": "inject_failed",
                                            "replica_group": g, "detail": kind})
            self.tick()
            time.sleep(max(0.0, 0.5 - (time.time() - began)))
        t_end = time.time()
        ledger1 = self.monitor_get("/v1/goodput?incidents=50&intervals=5000")
        findings = self.monitor_get("/v1/findings") or []
        evictions = self.monitor_get("/v1/evictions") or []
        return {"t_start": self.t_start, "t_end": t_end, "ledger_start": ledger0,
                "ledger_end": ledger1, "ledger_snapshots": snaps, "findings": findings, "evictions": evictions,
                "events": self.events, "strikes": list(self.strikes.values()),
                "warm_spares": self.args.warm_spares, "spares_ready": self.spares_ready,
                "commits": self.read_commits(), "load_avg": os.getloadavg()}

    def read_commits(self) -> dict[str, list[list[float]]]:
        """Every group's committed steps, every incarnation, from the ranks' logs."""
        out = {}
        for g in range(self.args.groups):
            series = []
            for path in sorted((self.dir / "logs" / f"replica_group_{g}").glob("train*.log")):
                series += parse_commit_log(path.read_text(errors="replace"))
            out[str(g)] = [[round(t, 3), s] for t, s in sorted(series)]
        return out


# --------------------------------------------------------------------------------------------
# Analysis of one run's raw record
def analyze(name: str, raw: dict, args: argparse.Namespace, samples_per_group_step: int) -> dict:
    t0, t1 = raw["t_start"], raw["t_end"]
    steps = {int(g): [(t, s) for t, s in series] for g, series in raw["commits"].items()}
    commits = {g: [t for t, _ in series] for g, series in steps.items()}
    wall = t1 - t0
    group_steps = sum(commits_in(times, t0, t1) for times in commits.values())
    # the healthy pace: the ranks' commits before the first injection (the schedule's time
    # where none was made)
    first = min((e["at"] for e in raw["events"] if e["event"] == "inject"),
                default=t0 + min(args.slow_at, args.duration))
    b = healthy_step_s(commits, t0 + 2.0, first)
    out = {"run": name, "wall_s": round(wall, 2), "committed_group_steps": group_steps,
           "samples_per_s": round(group_steps * samples_per_group_step / wall, 2),
           "healthy_step_s": None if b is None else round(b, 4),
           "load_avg_end": [round(x, 2) for x in raw.get("load_avg", [])]}
    first = [s for s in raw["strikes"]]
    strikes = sorted(({"replica_group": s["replica_group"], "kind": s["kind"], "at": s["at"],
                       "spec": s["spec"]} for s in first), key=lambda s: s["at"])
    out["strikes"] = [{**s, "at_s": round(s["at"] - t0, 2)} for s in strikes]
    out["events"] = [{**e, "at_s": round(e["at"] - t0, 2)} for e in raw["events"]]
    out["evictions"] = [{"replica_group": d.get("replica_group"), "decision": d.get("decision"),
                         "at_s": round(d["at"] - t0, 2) if d.get("at") else None,
                         "reason": d.get("reason")} for d in raw["evictions"]]
    out["findings"] = [{"kind": f.get("kind"), "replica_group": f.get("replica_group"),
                        "confirmed_at_s": round(f["confirmed_at"] - t0, 2)
                        if f.get("confirmed_at") else None,
                        "first_seen_s": round(f["first_seen"] - t0, 2)
                        if f.get("first_seen") else None} for f in raw["findings"]]
    if b is None:
        out["error"] = "too few healthy commits for a baseline"
        return out
    evicted, exits = {}, {}
    for d in raw["evictions"]:
        if d.get("decision") == "evict" and d.get("at"):
            evicted.setdefault(d["replica_group"], []).append(d["at"])
    for e in raw["events"]:
        if e["event"] == "restart":
            exits.setdefault(e["replica_group"], []).append(e["at"])
    evicted = {g: sorted(v) for g, v in evicted.items()}
    led = ledger_window(raw.get("ledger_start"), raw.get("ledger_end"))
    # reconciled from the ledger's first answer with a baseline (its startup over) to the end
    ready = next((x for x in raw.get("ledger_snapshots") or []
                  if (x.get("baseline") or {}).get("step_seconds") and x.get("at")), None)
    led_rec = ledger_window(ready, raw.get("ledger_end"))
    window = led_rec or led
    jt = job_commit_times(steps)
    # each fault accounted to the ledger's last answer where there is one: the same span
    t_end = max(t1, window["to"]) if window and window.get("to") else t1
    faults = fault_truth(strikes, commits, jt, b, t_end, args.groups, evicted, exits)
    cuts = [(f["onset"], f["back"] if f["back"] is not None else f["horizon"]) for f in faults]
    gp = goodput_from_commits(commits, t0, t1, b, args.groups, cuts=cuts)
    out["goodput"] = {k: v for k, v in gp.items() if k != "bins"}
    marks = [(s["at"], f"{s['kind']} (group {s['replica_group']})") for s in strikes]
    out["badput_by_fault_s"] = badput_by_window(gp["bins"], args.groups, marks)
    rec = []
    for f in faults:
        # the detector's first evidence: the ledger's onset where no rank reports a strike
        seen = sorted((x["confirmed_at"], x["first_seen"]) for x in raw["findings"]
                      if x.get("first_seen") and x.get("replica_group") == f["replica_group"]
                      and (x.get("confirmed_at") or 0) >= f["onset"])
        rec.append({"fault": f"{f['kind']} (group {f['replica_group']})",
                    "onset_s": round(f["onset"] - t0, 2),
                    "first_seen_after_onset_s": round(seen[0][1] - f["onset"], 2) if seen
                    else None,
                    "evicted_s": _rel(f["evicted"], t0), "out_s": _rel(f["out"], t0),
                    "rejoined_s": _rel(f["rejoined"], t0),
                    "back_at_pace_s": _rel(f["back"], t0), "recovery_s": f["recovery_s"],
                    "until_s": _rel(f["horizon"], t0), "cost_replica_s": f["cost_replica_s"],
                    "cost_by_cause": f["by_cause"]})
    out["recovery"] = rec
    if led:
        end = raw["ledger_end"]
        incidents = end.get("incidents") or []
        out["ledger"] = led
        out["ledger_incidents"] = [
            {"kind": i.get("kind"), "replica_group": i.get("replica_group"),
             "onset_s": _rel(i.get("onset_at"), t0), "onset_source": i.get("onset_source"),
             "detected_s": _rel(i.get("detected_at"), t0),
             "evicted_s": _rel(i.get("evicted_at"), t0),
             "back_to_pace_s": _rel(i.get("back_to_pace_at"), t0),
             "back_to_pace": i.get("back_to_pace"), "settled_pace": i.get("settled_pace"),
             "closed_s": _rel(i.get("closed_at"), t0),
             "recovery_s": i.get("recovery_s"), "cost_replica_s":
                 (i.get("cost") or {}).get("replica_seconds"),
             "cost_by_cause": (i.get("cost") or {}).get("by_cause")} for i in incidents]
        # the ledger's baselines while it ran (its answers every 2 s): shown, not used
        baselines = [x["baseline"]["step_seconds"]
                     for x in (raw.get("ledger_snapshots") or []) + [end]
                     if x.get("at") and (x.get("baseline") or {}).get("step_seconds")]
        intervals = end.get("intervals") or []
        out["ledger_reconciled_window"] = None if led_rec is None else {
            k: v for k, v in led_rec.items() if k not in ("from", "to")} | {
            "from_s": _rel(led_rec["from"], t0), "to_s": _rel(led_rec["to"], t0),
            "badput_in_window_s": badput_in_window(intervals, led_rec["from"], led_rec["to"]),
            "baseline_range_s": [min(baselines), max(baselines)] if baselines else None}
        truth = None
        if window.get("from") and window.get("to") and window["to"] > window["from"]:
            truth = goodput_from_commits(commits, window["from"], window["to"], b, args.groups,
                                         cuts=cuts)
            out["goodput_ledger_window"] = {k: v for k, v in truth.items() if k != "bins"}
        out["reconciliation"] = reconcile(window, truth, faults, incidents, t0)
    out["series"] = {g: [[round(t - t0, 3), s] for t, s in series if t0 - 5 <= t <= t1]
                     for g, series in steps.items()}
    return out


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 2)


# --------------------------------------------------------------------------------------------
# Report
def table(result: dict) -> str:
    runs = result["runs"]
    ff = next((r for r in runs if r["run"] == "fault_free" and "goodput" in r), None)
    lines = ["| run | samples/s | vs fault-free | goodput (ground truth) | vs fault-free | "
             "ledger goodput over its window (ground truth) | ledger badput by "
             "cause, same window (replica-s) | badput by fault window (ground truth, replica-s) "
             "| onset -> back at pace (ground truth) |",
             "|---|---:|---:|---:|---:|---:|---|---|---|"]
    for r in runs:
        if "goodput" not in r:
            lines.append(f"| {r['run']} | {r.get('error', 'failed')} |||||||")
            continue
        g = r["goodput"]["ratio"]
        sps = r["samples_per_s"]
        vs_s = f"{sps / ff['samples_per_s']:.2f}x" if ff else "-"
        vs_g = f"{g / ff['goodput']['ratio']:.2f}x" if ff else "-"
        led = r.get("ledger_reconciled_window") or r.get("ledger")
        lg = f"{led['ratio']:.3f}" if led and led.get("ratio") is not None else "-"
        gt = (r.get("goodput_ledger_window") or {}).get("ratio")
        if gt is not None:
            lg += f" ({gt:.3f})"
        if led and "badput_in_window_s" in led:  # clipped to the window, pending included
            lb = ", ".join(f"{k} {v:.1f}" for k, v in sorted(
                led["badput_in_window_s"].items(), key=lambda kv: -kv[1]) if v >= 0.05) or "-"
        else:
            lb = ", ".join(f"{k} {v:.1f}" for k, v in (led or {}).get("badput_s", {}).items()
                           if v >= 0.05) or "-"
            if led and led.get("pending_s"):
                lb += f", pending {led['pending_s']:.1f}"
        bf = ", ".join(f"{k} {v:.1f}" for k, v in r["badput_by_fault_s"].items()) or "-"
        rc = "; ".join(f"{x['fault']} {x['recovery_s']:.1f}s" if x["recovery_s"] is not None
                       else f"{x['fault']} not before {x['until_s']:.1f}s"
                       if x.get("until_s") is not None else f"{x['fault']} never"
                       for x in r["recovery"]) or "-"
        lines.append(f"| {r['run']} | {sps:.1f} | {vs_s} | {g:.3f} | {vs_g} | {lg} | {lb} | "
                     f"{bf} | {rc} |")
    out = "\n".join(lines)
    out += "\n\n" + vs_fault_free(runs)
    for r in runs:
        checks = r.get("reconciliation")
        if not checks:
            continue
        out += f"\n\nledger vs ground truth, {r['run']}:"
        for c in checks:
            detail = (f"ground truth {c['ground_truth']}, ledger {c['ledger']}, diff "
                      f"{c['diff']} (tolerance {c['tolerance']})" if "diff" in c
                      else c.get("note", ""))
            if "diff" in c and c.get("note"):
                detail += f"; {c['note']}"
            out += f"\n  {'ok  ' if c['ok'] else 'FAIL'} {c['check']}: {detail}"
    return out


def vs_fault_free(runs: list[dict]) -> str:
    """Each faulty run's goodput over the fault-free run's, three ways (the load on a shared
    machine moves the healthy pace within and between runs, and each way judges that drift
    differently), and what its faults cost by the ledger's incidents."""
    ff = next((r for r in runs if r["run"] == "fault_free" and "goodput" in r), None)

    def recomputed(r: dict) -> float | None:
        return (r.get("goodput_ledger_window") or {}).get("ratio")

    def ledger(r: dict) -> float | None:
        led = r.get("ledger_reconciled_window") or r.get("ledger") or {}
        return led.get("ratio")

    lines = ["vs fault-free (goodput / fault-free goodput): ground truth | ground truth over "
             "the ledger's window | ledger; faults' cost (ledger incidents, replica-s / "
             "expected; ground truth)"]
    for r in runs:
        if r["run"] == "fault_free" or "goodput" not in r:
            continue
        parts = []
        for f in (lambda x: (x.get("goodput") or {}).get("ratio"), recomputed, ledger):
            a, b = f(r), f(ff) if ff else None
            parts.append(f"{a / b:.3f}x" if a is not None and b else "-")
        incs = r.get("ledger_incidents") or []
        cost = sum(i.get("cost_replica_s") or 0.0 for i in incs)
        exp = (r.get("ledger_reconciled_window") or {}).get("expected_s")
        each = ", ".join(f"{i['kind']} {i.get('cost_replica_s') or 0.0:.1f}" for i in incs)
        share = f" = {cost / exp:.3f}" if exp else ""
        truth = ", ".join(f"{x['fault']} {x['cost_replica_s']:.1f}"
                          for x in r.get("recovery") or [] if "cost_replica_s" in x)
        lines.append(f"  {r['run']}: {' | '.join(parts)}; faults {cost:.1f}{share} ({each})"
                     + (f"; ground truth: {truth}" if truth else ""))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> str | None:
    """Committed samples over time, one line per run; faults and evictions marked."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no PNG"
    per = result["settings"]["samples_per_group_step"]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    colors = {"fault_free": "tab:green", "torchft_defaults": "tab:red",
              "torchft_tuned": "tab:orange", "lightkeeper": "tab:blue",
              "lightkeeper_cold": "tab:purple"}
    for r in result["runs"]:
        if "series" not in r:
            continue
        events = sorted((t, 1) for series in r["series"].values() for t, _ in series if t >= 0)
        xs, ys, n = [0.0], [0], 0
        for t, k in events:
            n += k
            xs.append(t)
            ys.append(n * per)
        xs.append(r["wall_s"])
        ys.append(n * per)
        ax.step(xs, ys, where="post", color=colors.get(r["run"]),
                ls="--" if r["run"] not in RUNS else "-", label=(
            f"{r['run']}: {r['samples_per_s']:.0f} samples/s, goodput {r['goodput']['ratio']:.2f}"
            if "goodput" in r else r["run"]))
        if r["run"] == "lightkeeper":
            for e in r["evictions"]:
                if e["decision"] == "evict" and e["at_s"] is not None:
                    ax.axvline(e["at_s"], color="tab:blue", ls=":", lw=1)
    strikes = next((r["strikes"] for r in result["runs"] if r["run"] == "lightkeeper"
                    and r.get("strikes")), None) or next(
        (r["strikes"] for r in result["runs"] if r.get("strikes")), [])
    for s in strikes:
        ax.axvline(s["at_s"], color="grey", ls="--", lw=1)
        ax.text(s["at_s"], ax.get_ylim()[1] * 0.97, f" {s['kind']}\n group {s['replica_group']}",
                va="top", fontsize=8, color="grey")
    ax.set_xlabel("seconds since training started")
    ax.set_ylabel("committed samples (all replica groups)")
    st = result["settings"]
    ax.set_title(f"{st['groups']} groups x {st['ranks_per_group']} ranks, same fault schedule "
                 f"(dashed: strikes in the Lightkeeper run; dotted: its evictions)", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    tuned = demo_timeouts()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of training (120)")
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--ranks-per-group", type=int, default=2)
    p.add_argument("--step-pause", type=float, default=0.1, help="trainer --step-pause (the "
                   "demo's 0.1)")
    p.add_argument("--slow-at", type=float, default=40.0,
                   help="seconds after training starts: throttle the last rank of group 1 (40; "
                        "after the ledger's startup, which lasts ~W + 5 s)")
    p.add_argument("--slow-delay", type=float, default=0.6, help="slow_compute delay= (0.6)")
    p.add_argument("--hang-at", type=float, default=75.0,
                   help="seconds after training starts: hang the last rank of group 2 (75)")
    demo = "the demo's value, now"  # lightkeeper/scenario.py
    p.add_argument("--tuned-pg-timeout", type=float, default=tuned.pg_timeout_s,
                   help=f"s, every run but torchft_defaults ({demo} {tuned.pg_timeout_s:g})")
    p.add_argument("--tuned-quorum-timeout", type=float, default=tuned.quorum_timeout_s,
                   help=f"s ({demo} {tuned.quorum_timeout_s:g})")
    p.add_argument("--tuned-join-timeout-ms", type=int, default=tuned.join_timeout_ms,
                   help=f"Lighthouse join_timeout_ms ({demo} {tuned.join_timeout_ms})")
    p.add_argument("--tuned-heartbeat-timeout-ms", type=int, default=tuned.heartbeat_timeout_ms,
                   help=f"Lighthouse heartbeat_timeout_ms ({demo} {tuned.heartbeat_timeout_ms})")
    p.add_argument("--monitor-args", default=None,
                   help=f"lightkeeper monitor flags (default: the demo's, now "
                        f"'{demo_monitor_args(3)}' for 3 groups)")
    p.add_argument("--cold-restarts", dest="warm_spares", action="store_false",
                   default=demo_warm_spares(),
                   help="the supervisor restarts a group from scratch in every run (default: "
                        "as the demo, from a warm spare started before training is measured)")
    p.add_argument("--no-monitor-alone", action="store_true",
                   help="no monitor at all in the fault-free and torchft-alone runs")
    p.add_argument("--work-dir", default=None, help="logs (default: a new temp dir)")
    p.add_argument("--out", default=None, help="write the JSON here")
    p.add_argument("--png", default=None, help="write the committed-samples plot here")
    p.add_argument("--table", default=None, metavar="JSON", help="print an earlier run's table")
    args = p.parse_args(argv)
    if args.table:
        result = json.loads(Path(args.table).read_text())
        print(table(result))
        if args.png:
            note = plot(result, Path(args.png))
            print(note or f"plot: {args.png}")
        return 0
    if args.monitor_args is None:
        args.monitor_args = demo_monitor_args(args.groups)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    bad = [n for n in names if n not in RUNS]
    if bad or not names:
        p.error(f"--runs: unknown {bad}; choose from {', '.join(RUNS)}")
    if args.groups < 3 or args.ranks_per_group < 1:
        p.error("--groups must be >= 3 (the faults strike groups 1 and 2), --ranks-per-group >= 1")
    if not 0 < args.slow_at < args.hang_at < args.duration:
        p.error("need 0 < --slow-at < --hang-at < --duration")
    from trainer.config import ModelConfig

    per = args.ranks_per_group * ModelConfig().batch_size
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-goodput-"))
    settings = {k: v for k, v in vars(args).items() if k not in ("table",)}
    settings["samples_per_group_step"] = per
    settings["torchft_defaults"] = asdict(TORCHFT_DEFAULTS)
    tuned = Timeouts(args.tuned_pg_timeout, args.tuned_quorum_timeout,
                     args.tuned_join_timeout_ms, args.tuned_heartbeat_timeout_ms)
    settings["tuned"] = asdict(tuned)
    settings["cpus"] = os.cpu_count()
    result = {"settings": settings, "runs": [], "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "load_avg_start": [round(x, 2) for x in os.getloadavg()]}
    print(f"bench_goodput: runs {', '.join(names)}; logs in {work}", flush=True)

    def _term(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _term)
    try:
        for name in names:
            alone = None if args.no_monitor_alone else "dry_run"
            spec = {"fault_free": (tuned, False, alone),
                    "torchft_defaults": (TORCHFT_DEFAULTS, True, alone),
                    "torchft_tuned": (tuned, True, alone),
                    "lightkeeper": (tuned, True, "evict")}[name]
            run = Run(name, args, *spec, work)
            began = time.time()
            print(f"[{time.strftime('%H:%M:%S')}] {name}: starting", flush=True)
            try:
                raw = run.run()
            except Exception as e:  # record it, the other runs still go
                result["runs"].append({"run": name, "error": f"{type(e).__name__}: {e}"})
                print(f"{name}: failed: {e}", file=sys.stderr, flush=True)
                continue
            finally:
                run.stop()
            (work / name / "raw.json").write_text(json.dumps(raw))
            res = analyze(name, raw, args, per)
            res["timeouts"] = asdict(spec[0])
            res["monitor"] = spec[2]
            res["run_wall_s"] = round(time.time() - began, 1)
            result["runs"].append(res)
            print(f"[{time.strftime('%H:%M:%S')}] {name}: {res.get('samples_per_s')} samples/s, "
                  f"goodput {(res.get('goodput') or {}).get('ratio')}", flush=True)
    except KeyboardInterrupt:
        print("bench_goodput: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(table(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, separators=(",", ":")))
        print(f"json: {args.out}")
    if args.png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        note = plot(result, Path(args.png))
        print(note or f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
