"""The detectors at 100,000 ranks: this tree's against a git revision's, side by side in one
process, on the very same views.

Two real Monitors (leader polling on, no Lighthouse) over the same ``--groups`` x
``--group-size`` virtual ranks (tests/support/virtual_ranks.py's /v1/state documents,
answered in process as bench_monitor_stages.py does: no HTTP), one with this tree's
``monitor/detect/detectors.py``, one with ``--baseline``'s (taken out of git, imported against this
tree's view), swept in turns on one virtual clock that moves ``--sweep-s`` a sweep (1 s: the
issue-17 target, where a leader polled each sweep serves one new step's row; the stages
bench runs on the wall clock, so its sweeps see as many new steps as its sweeps take
seconds, several on a loaded box). Each monitor parses its own answers, so each detector
reaches fresh documents as in a real monitor (what reaching them costs is most of the
detectors' time: two detectors on one view measured the first one's misses). Which monitor
sweeps first alternates. Each sweep asserts both said the same (findings, lags, open
findings), so the figures are of two implementations of one verdict.

    .venv/bin/python benchmarks/bench_detectors.py --groups 12500 --sweeps 12 --baseline e1d5fb6

Every figure is thread CPU (``time.thread_time``) per stage, the stages of
bench_monitor_stages.py's ``--split`` (a stage less the stages it calls), median over the
sweeps after the first two, per group; and the ratio of the sums. No Flight Recorder dumps
(the virtual ranks' are not fetched: the analysis engine is not the detectors' per-group
cost).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_monitor_100k import save  # noqa: E402
from benchmarks.bench_monitor_stages import InProcessPoller  # noqa: E402
from benchmarks.bench_poller import baseline_module  # noqa: E402
from monitor import detectors as this_tree  # noqa: E402
from monitor.config import MonitorConfig  # noqa: E402
from monitor.service import Monitor  # noqa: E402
from tests.support import virtual_ranks  # noqa: E402

# (method, stage): bench_monitor_stages.py's detector rows
STAGES = [("fr_wanted", "Flight Recorder trigger"), ("update", "detectors"),
          ("_collect_steps", "det: fold rows"), ("_straggler", "det: straggler rest"),
          ("_dead", "det: dead"), ("_hang", "det: hang"), ("_stuck_starting", "det: stuck"),
          ("_commit_counts", "det: commit counts"), ("_resolve_gone", "det: resolve gone")]


class Timed:
    """One Detectors instance with its stages timed (thread CPU, less the stages called)."""

    def __init__(self, det) -> None:
        self.det, self.now, self.stack = det, {}, []
        for name, label in STAGES:
            if hasattr(det, name):
                setattr(det, name, self._wrap(getattr(det, name), label))

    def _wrap(self, f, label: str):
        def w(*a, **k):
            self.stack.append([time.thread_time(), 0.0])
            try:
                return f(*a, **k)
            finally:
                began, children = self.stack.pop()
                spent = time.thread_time() - began
                self.now[label] = self.now.get(label, 0.0) + spent - children
                if self.stack:
                    self.stack[-1][1] += spent
        return w


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=12_500)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--sweeps", type=int, default=12)
    ap.add_argument("--sweep-s", type=float, default=1.0,
                    help="virtual seconds a sweep (the virtual ranks step every 1 s)")
    ap.add_argument("--baseline", default="e1d5fb6", help="git revision to compare with")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n = args.groups * args.group_size
    clock = [1_800_000_000.0]  # the monitor's and the virtual ranks' clock, moved by hand
    virtual_ranks.time = types.SimpleNamespace(monotonic=lambda: clock[0])
    vr = virtual_ranks.VirtualRanks(n, 0, args.group_size, 1.0, epoch=clock[0] - 100.0)
    urls = [f"http://127.0.0.1:1/r/{r}" for r in range(n)]
    index = {u: i for i, u in enumerate(urls)}
    # imported as a module of this tree's package (its relative imports: this tree's view)
    base = baseline_module(args.baseline, "monitor/detect/detectors.py", "monitor.baseline_detectors")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        monitors, timed = [], []
        for i, module in enumerate((this_tree, base)):
            mon = Monitor(MonitorConfig(port=0, targets=urls, leader_polling="on",
                                        state_path=os.path.join(d, f"m{i}.db"), max_targets=n),
                          clock=lambda: clock[0])
            mon.polling.poller.close()
            mon.polling.poller = InProcessPoller(vr, index)
            mon.detectors = module.Detectors(mon.detectors.cfg, clock=lambda: clock[0])
            monitors.append(mon)
            timed.append(Timed(mon.detectors))
        this, was = timed
        try:
            for sweep in range(args.sweeps):
                this.now, was.now = {}, {}
                for mon in monitors if sweep % 2 == 0 else monitors[::-1]:
                    mon.sweep_once()
                a, b = (m.detectors for m in monitors)
                assert a.last_lags == b.last_lags, "the lags differ"
                assert [f.to_dict() for f in a.open_findings()] == \
                    [f.to_dict() for f in b.open_findings()], "the open findings differ"
                assert monitors[0].schedule.last.urls == monitors[1].schedule.last.urls
                clock[0] += args.sweep_s
                row = {"sweep": sweep, "asked": len(monitors[0].schedule.last.urls),
                       "this": this.now, "baseline": was.now}
                rows.append(row)
                print(json.dumps({"sweep": sweep, "asked": row["asked"],
                                  "this_s": round(sum(this.now.values()), 4),
                                  "baseline_s": round(sum(was.now.values()), 4)}), flush=True)
        finally:
            for mon in monitors:
                mon.stop()
    measured = rows[2:] or rows
    out = {"groups": args.groups, "ranks": n, "sweeps": args.sweeps, "sweep_s": args.sweep_s,
           "baseline": args.baseline, "clock": "thread CPU (time.thread_time)",
           "asked_median": statistics.median(r["asked"] for r in measured), "stages": {}}
    g = args.groups
    print(f"detectors at {n} ranks, median of {len(measured)} sweeps, us/group of thread CPU "
          f"(this tree | {args.baseline}); load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores, ~{out['asked_median']:.0f} ranks asked a sweep")
    for _, label in STAGES:
        this = statistics.median(r["this"].get(label, 0.0) for r in measured)
        was = statistics.median(r["baseline"].get(label, 0.0) for r in measured)
        out["stages"][label] = {"this_us_per_group": 1e6 * this / g,
                                "baseline_us_per_group": 1e6 * was / g}
        print(f"  {label:>26}: {1e6 * this / g:7.1f} | {1e6 * was / g:7.1f}")
    this = statistics.median(sum(r["this"].values()) for r in measured)
    was = statistics.median(sum(r["baseline"].values()) for r in measured)
    ratios = [sum(r["this"].values()) / sum(r["baseline"].values()) for r in measured]
    out.update(this_us_per_group=1e6 * this / g, baseline_us_per_group=1e6 * was / g,
               ratio_median=statistics.median(ratios), ratios=ratios,
               load_average=os.getloadavg(), cores=os.cpu_count())
    print(f"  {'all':>26}: {1e6 * this / g:7.1f} | {1e6 * was / g:7.1f}   this/baseline per "
          f"sweep: median {out['ratio_median']:.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    return save(out, args.json)


if __name__ == "__main__":
    sys.exit(main())
