"""Network faults on namespaced hosts, side by side in one run: torchft alone against Lightkeeper.

Each case runs ``lightkeeper demo --hosts netns`` twice with the same fault given at start to
one group's host (or to every host): once with ``--dry-run`` (the monitor watches and acts on
nothing: no eviction, no abort, no quarantine; what torchft alone does), once as the demo runs
(Lightkeeper acting). Needs root and iproute2 (the demo's fabric).

Ground truth from the ranks, not the monitor: every rank's ``/v1/state`` as the demo sampled it
(``timeline.json``). The job's pace is the number of distinct committed steps of the groups that
trained, per second; *healthy* is its median over 3 s windows before the onset (the fault's
strike on the ranks, or the step it was given at). *Back at pace*: the first moment after the
onset from which the next 3 s hold at least 90% of the healthy pace. Detection: the monitor's
first finding naming the host (``network``, ``dead``) or the job (``job_slow``/``job_stall``).
Beside them, the monitor's own ledger for the fault (``ledger``: its recovery, cost and onset).

    .venv/bin/python benchmarks/bench_network.py --json benchmarks/results/network_faults.json
    .venv/bin/python benchmarks/bench_network.py --cases partition --modes lightkeeper
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # name -> demo --inject flags (at step AT, filled in)
    "slow_link": ["0:slow_link:mbit=20,from_step={at}"],
    "partition": ["0:partition:at_step={at}"],
    "host_offline": ["0:host_offline:at_step={at}"],
    "uniform_slow": [f"{g}:slow_link:mbit=20,from_step={{at}}" for g in range(3)],
    "healthy": [],
}
MODES = ("torchft_alone", "lightkeeper")
WINDOW_S, PACE = 3.0, 0.9


def job_steps(samples: list[dict]) -> list[tuple[float, int]]:
    """(t, the highest step any rank reported by t), in time order."""
    out, top = [], -1
    for s in sorted(samples, key=lambda s: s["t"]):
        if isinstance(s.get("step"), int) and s["step"] > top:
            top = s["step"]
            out.append((s["t"], top))
    return out


def steps_between(series: list[tuple[float, int]], a: float, b: float) -> int:
    before = [s for t, s in series if t <= a]
    upto = [s for t, s in series if t <= b]
    return (upto[-1] if upto else 0) - (before[-1] if before else 0)


def healthy_pace(series, start: float, onset: float) -> float | None:
    rates = [steps_between(series, t, t + WINDOW_S) / WINDOW_S
             for t in frange(start, onset - WINDOW_S, 0.5)]
    return statistics.median(rates) if rates else None


def back_at_pace(series, onset: float, pace: float, end: float) -> float | None:
    for t in frange(onset, end - WINDOW_S, 0.1):
        if steps_between(series, t, t + WINDOW_S) >= PACE * pace * WINDOW_S:
            return t
    return None


def frange(a: float, b: float, step: float):
    while a <= b:
        yield a
        a += step


def run_case(case: str, mode: str, at: int, duration: float, workdir: Path) -> dict:
    report_dir = workdir / f"{case}-{mode}"
    cmd = [str(ROOT / ".venv" / "bin" / "lightkeeper"), "demo", "--hosts", "netns",
           "--no-prometheus", "--report-dir", str(report_dir), "--duration", f"{duration:g}"]
    for spec in CASES[case]:
        cmd += ["--inject", spec.format(at=at)]
    if not CASES[case]:
        cmd.append("--no-faults")
    if mode == "torchft_alone":
        # its story ends at "detected, not evicted": train on to --duration, for torchft's own
        # recovery (after its process-group timeout) to fall inside the run
        cmd += ["--dry-run", "--end-s", f"{duration:g}"]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 300)
    out = {"case": case, "mode": mode, "command": " ".join(cmd[1:]), "rc": proc.returncode,
           "wall_s": round(time.time() - t0, 1)}
    try:
        report = json.loads((report_dir / "report.json").read_text())
        samples = json.loads((report_dir / "timeline.json").read_text())["samples"]
    except (OSError, ValueError) as e:
        return {**out, "error": f"no report: {e}; {proc.stderr[-500:]}"}
    series = job_steps(samples)
    start = report.get("training_started_at_s") or 0.0
    faults = report["faults"]
    struck = [f["struck_at_s"] for f in faults if f.get("struck_at_s") is not None]
    onset = min(struck) if struck else None
    end = series[-1][0] if series else 0.0
    out.update(training_started_at_s=start, onset_s=onset, end_s=end)
    ref = onset if onset is not None else end
    pace = healthy_pace(series, start + 2.0, ref)
    out["healthy_steps_per_s"] = None if pace is None else round(pace, 2)
    if onset is not None and pace:
        back = back_at_pace(series, onset, pace, end)
        out["back_at_pace_s"] = None if back is None else round(back - onset, 2)
        after = steps_between(series, onset, end) / max(1e-9, end - onset)
        out["pace_after_onset_x"] = round(after / pace, 2)
    det = [d for d in report["detections"] if onset is None or d["at_s"] >= onset - 1]
    out["findings"] = [{"kind": d["kind"], "replica_group": d["replica_group"],
                        "culprit_hosts": d.get("culprit_hosts"),
                        "after_onset_s": None if onset is None else round(d["at_s"] - onset, 2)}
                       for d in det]
    named = [d for d in out["findings"] if d["culprit_hosts"] and "node-0" in d["culprit_hosts"]]
    out["host_named_after_s"] = named[0]["after_onset_s"] if named else None
    out["host_named_after_steps"] = (steps_between(series, onset, onset + named[0]["after_onset_s"])
                                     if named and onset is not None else None)
    out["evictions"] = [e["replica_group"] for e in report["evictions"]
                        if e["decision"] == "evict"]
    out["aborts"] = sum(1 for e in report["evictions"]  # held under --dry-run: not sent
                        if e["decision"] == "abort" and e.get("status") != "dry_run")
    out["quarantined"] = report["hosts"].get("quarantined")
    # the monitor's ledger for the same fault: its recovery beside the ranks' back_at_pace_s
    cost = next((f["cost"] for f in faults if f.get("cost")), None) or {}
    out["ledger"] = {k: cost.get(k) for k in ("recovery_s", "replica_seconds", "by_cause",
                                              "onset_s")}
    if cost.get("onset_s") is not None and onset is not None:
        out["ledger"]["onset_after_s"] = round(cost["onset_s"] - onset, 2)
    # a report is written also when the demo fails; a fault that never struck measured nothing
    if proc.returncode != 0:
        out["error"] = f"the demo failed (status {proc.returncode}): {proc.stderr[-500:]}"
    elif CASES[case] and onset is None:
        out["error"] = "the fault never struck: " + "; ".join(
            f"{f.get('outcome')} ({f.get('note')})" for f in faults)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--at-step", type=int, default=60, help="the fault's step (%(default)s)")
    ap.add_argument("--duration", type=float, default=45.0,
                    help="seconds of training each run (%(default)s)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--keep", help="keep every run's report and logs under this directory")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each case and mode")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_network: needs root (network namespaces)", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="lk-bench-net-") as d:
        for case, mode, n in ((c, m, n) for c in args.cases.split(",")
                              for n in range(args.repeat) for m in args.modes.split(",")):
            work = Path(args.keep or d) / f"run{n}"
            work.mkdir(parents=True, exist_ok=True)
            row = run_case(case, mode, args.at_step, args.duration, work)
            rows.append(row)
            print(json.dumps({k: row.get(k) for k in (
                "case", "mode", "rc", "healthy_steps_per_s", "back_at_pace_s",
                "pace_after_onset_x", "host_named_after_s", "host_named_after_steps",
                "evictions", "aborts", "quarantined", "ledger")} | (
                    {"error": row["error"]} if "error" in row else {})), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True).stdout.strip(),
            "load_avg": os.getloadavg(), "rows": rows}, indent=1))
    failed = [f"{r['case']}/{r['mode']}" for r in rows if "error" in r]
    if failed:  # a row of nulls is no measurement
        print(f"bench_network: no figures for {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
