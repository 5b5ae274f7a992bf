"""Detection latency per fault kind, and a hang's cost with the monitor vs torchft alone.

Every scenario is a fresh real job (Lighthouse + 3 single-rank replica groups on CPU, 0.1 s step
pause) with one fault injected into replica group 2 at step ``--at``; the monitor (when used)
runs in-process with its defaults (1 s interval, thresholds in the README's Monitor section). Measured side
by side in one run:

- ``straggler`` (``slow:delay=0.6``): steps and seconds from the first slow step to confirmation;
- ``hang`` with the monitor: onset (survivors' last committed step) -> confirmed finding, and
  onset -> survivors commit again; at short timeouts (20 s process group, 5 s join) and at
  torchft's defaults (60 s process group, 60 s quorum, 60 s join);
- ``hang`` with torchft alone, same two settings: onset -> survivors commit again, or the time
  the survivors exit (torchft's defaults: their quorum times out and the job dies);
- ``mismatch``: onset (first failed commit) -> confirmed finding.

    .venv/bin/python benchmarks/bench_monitor_detection.py [--only hang_short_monitor,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightkeeper.cluster import LocalCluster, wait_until  # noqa: E402
from monitor.config import MonitorConfig  # noqa: E402
from monitor.service import Monitor  # noqa: E402
from tests.support.workers import try_state  # noqa: E402

SHORT = dict(pg_timeout_s=20, join_timeout_ms=5000, quorum_timeout_s=60)
DEFAULTS = dict(pg_timeout_s=60, join_timeout_ms=60000, quorum_timeout_s=60)


class Run:
    def __init__(self, workdir: str, fault: str, timeouts: dict, monitor: bool) -> None:
        self.dir = tempfile.mkdtemp(dir=workdir)
        self.cluster = LocalCluster(os.path.join(self.dir, "cluster"), num_groups=3,
                                    steps=100_000, step_pause_s=0.1, **timeouts)
        self.fault = fault
        self.monitor = None
        self.cluster.start_lighthouse()
        if monitor:
            self.monitor = Monitor(MonitorConfig(port=0, lighthouse=self.cluster.lighthouse_url,
                                                 state_path=os.path.join(self.dir, "m.sqlite")))
        for g in range(3):
            self.cluster.start_group(g, [fault] if g == 2 else None)
        for g in range(3):
            self.cluster.wait_for_workers(g, timeout=120)
        if self.monitor:
            for url in self.cluster.worker_urls():
                self.monitor.discovery.register({"url": url})
            self.monitor.start(serve=False)

    def states(self, groups=(0, 1, 2)) -> dict[int, dict]:
        out = {}
        for g in groups:
            grp = self.cluster.groups.get(g)
            for u in (grp.worker_urls.values() if grp else []):
                s = try_state(u)
                if s:
                    out[g] = s
        return out

    def finding(self, kind: str):
        if not self.monitor:
            return None
        for f in self.monitor.store.findings():
            if f["kind"] == kind:
                return f
        return None

    def stop(self) -> None:
        if self.monitor:
            self.monitor.stop()
        self.cluster.stop()


def survivors_commit_after(run: Run, stalled_step: int, timeout: float) -> tuple[float | None, str]:
    """Unix time the survivors (groups 0, 1) both committed past ``stalled_step``, or the time
    the first of them exited (then the job is broken), or None after ``timeout``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = run.states((0, 1))
        if len(s) == 2 and all(x["step"] > stalled_step for x in s.values()):
            return max(x["last_step_at"] for x in s.values()), "committed"
        exited = [g for g in (0, 1) if not run.cluster.groups[g].alive()]
        if exited:  # a survivor died: the job cannot commit with the zombie any more
            return time.time(), f"survivor group(s) {exited} exited"
        time.sleep(0.1)
    return None, "timeout"


def hang(workdir: str, at: int, timeouts: dict, monitor: bool, wait_s: float) -> dict:
    run = Run(workdir, f"hang:at_step={at}", timeouts, monitor)
    try:
        wait_until(lambda: (run.states((0,)).get(0) or {}).get("step", 0) >= at, 180,
                   what="the hang step")
        # the stall: survivors are at step `at` and wait in the all_reduce
        wait_until(lambda: all(s["phase"] == "allreduce" for s in run.states((0, 1)).values()),
                   30, what="survivors waiting")
        s = run.states((0, 1))
        onset = max(x["last_step_at"] for x in s.values())
        stalled = max(x["step"] for x in s.values())
        commit_at, how = survivors_commit_after(run, stalled, wait_s)
        f = run.finding("hang")
        t = None if commit_at is None else round(commit_at - onset, 2)
        out = {"onset_to_commit_s" if how == "committed" else "onset_to_outcome_s": t,
               "outcome": how}
        if f:
            out["onset_to_confirmed_s"] = round(f["confirmed_at"] - onset, 2)
            out["median_step_s"] = f["evidence"].get("median_step_s")
        if run.monitor:
            ev = run.monitor.store.decisions(evictions_only=True)
            out["evicted"] = [(d["replica_group"], d["status"]) for d in ev]
        return out
    finally:
        run.stop()


def straggler(workdir: str, at: int) -> dict:
    run = Run(workdir, f"slow:delay=0.6,from_step={at}", SHORT, True)
    try:
        onset = wait_until(lambda: (run.states((2,)).get(2) or {}).get("step", 0) >= at
                           and time.time(), 180, interval=0.05, what="the slow steps")
        f = wait_until(lambda: run.finding("straggler"), 120, what="the straggler finding")
        step = f["evidence"]["phases"]["2"]["step"]
        return {"onset_to_confirmed_s": round(f["confirmed_at"] - onset, 2),
                "steps_after_onset": step - at, "median_lag_s": f["evidence"]["median_lag_s"]}
    finally:
        run.stop()


def mismatch(workdir: str, at: int) -> dict:
    run = Run(workdir, f"mismatch:at_step={at}", SHORT, True)
    try:
        def failed():
            s = run.states()
            return any(x["commit_failures"] > 0 for x in s.values()) and time.time()

        onset = wait_until(failed, 180, interval=0.05, what="the mismatched step")
        f = wait_until(lambda: run.finding("mismatch"), 60, what="the mismatch finding")
        return {"onset_to_confirmed_s": round(f["confirmed_at"] - onset, 2),
                "replica_group": f["replica_group"],
                "attributed_by": f["evidence"].get("attributed_by")}
    finally:
        run.stop()


SCENARIOS = {
    "straggler": lambda w, a: straggler(w, a),
    "mismatch": lambda w, a: mismatch(w, a),
    "hang_short_monitor": lambda w, a: hang(w, a, SHORT, True, 60),
    "hang_short_torchft": lambda w, a: hang(w, a, SHORT, False, 90),
    "hang_defaults_monitor": lambda w, a: hang(w, a, DEFAULTS, True, 90),
    "hang_defaults_torchft": lambda w, a: hang(w, a, DEFAULTS, False, 200),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(SCENARIOS))
    p.add_argument("--at", type=int, default=30, help="step at which the fault starts (30)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="lk-bench-detect-")
    results: dict[str, list[dict]] = {}
    for name in args.only.split(","):
        for _ in range(args.repeat):
            t = time.time()
            r = SCENARIOS[name](workdir, args.at)
            r["wall_s"] = round(time.time() - t, 1)
            results.setdefault(name, []).append(r)
            print(f"{name:>24}: {json.dumps(r)}", flush=True)
    summary = {}
    for name, rows in results.items():
        for key in ("onset_to_confirmed_s", "onset_to_commit_s", "steps_after_onset"):
            vals = [r[key] for r in rows if r.get(key) is not None]
            if vals:
                summary[f"{name}.{key}.median"] = statistics.median(vals)
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
