"""The detectors at 100,000 ranks, stage by stage, on a virtual clock.

A real Monitor (leader polling on, no Lighthouse) over ``--groups`` x ``--group-size`` virtual
ranks (tests/support/virtual_ranks.py's /v1/state documents, answered in process as
bench_monitor_stages.py does: no HTTP), swept on one virtual clock that moves ``--sweep-s`` a
sweep (1 s: a leader polled each sweep serves one new step's row). Every figure is thread CPU
(``time.thread_time``) per stage, less the stages it calls, median over the sweeps after the
first two, per group. No Flight Recorder dumps (the analysis engine is not the detectors'
per-group cost). To compare two revisions, run this in each one's checkout.

    .venv/bin/python benchmarks/bench_detectors.py --groups 12500 --sweeps 12
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import types
from operator import attrgetter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_monitor_100k import save  # noqa: E402
from benchmarks.bench_monitor_stages import InProcessPoller  # noqa: E402
from monitor.config import MonitorConfig  # noqa: E402
from monitor.service import Monitor  # noqa: E402
from tests.support import virtual_ranks  # noqa: E402

# (object under the Monitor's detectors, method, stage)
STAGES = [("", "fr_wanted", "Flight Recorder trigger"), ("", "update", "detectors"),
          ("straggler", "answers", "det: fold rows"), ("straggler", "judge", "det: straggler"),
          ("liveness", "dead", "det: dead"), ("hang", "judge", "det: hang"),
          ("liveness", "stuck_starting", "det: stuck"),
          ("", "_note_commit_failures", "det: commit counts"),
          ("findings", "resolve_gone", "det: resolve gone")]


def timed(det, spent: dict[str, float]) -> None:
    """Wrap each stage of ``det`` to add its thread CPU, less the stages it calls, to ``spent``."""
    stack: list[list[float]] = []
    for path, name, label in STAGES:
        obj = attrgetter(path)(det) if path else det
        f = getattr(obj, name)

        def w(*a, _f=f, _label=label, **k):
            stack.append([time.thread_time(), 0.0])
            try:
                return _f(*a, **k)
            finally:
                began, children = stack.pop()
                took = time.thread_time() - began
                spent[_label] = spent.get(_label, 0.0) + took - children
                if stack:
                    stack[-1][1] += took
        setattr(obj, name, w)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=12_500)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--sweeps", type=int, default=12)
    ap.add_argument("--sweep-s", type=float, default=1.0,
                    help="virtual seconds a sweep (the virtual ranks step every 1 s)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n = args.groups * args.group_size
    clock = [1_800_000_000.0]  # the monitor's and the virtual ranks' clock, moved by hand
    virtual_ranks.time = types.SimpleNamespace(monotonic=lambda: clock[0])
    vr = virtual_ranks.VirtualRanks(n, 0, args.group_size, 1.0, epoch=clock[0] - 100.0)
    urls = [f"http://127.0.0.1:1/r/{r}" for r in range(n)]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        mon = Monitor(MonitorConfig(port=0, targets=urls, leader_polling="on",
                                    state_path=os.path.join(d, "m.db"), max_targets=n),
                      clock=lambda: clock[0])
        mon.polling.poller.close()
        mon.polling.poller = InProcessPoller(vr, {u: i for i, u in enumerate(urls)})
        spent: dict[str, float] = {}
        timed(mon.detectors, spent)
        try:
            for sweep in range(args.sweeps):
                spent.clear()
                mon.sweep_once()
                clock[0] += args.sweep_s
                rows.append({"sweep": sweep, "asked": len(mon.schedule.last.urls),
                             "stages": dict(spent)})
                print(f"sweep {sweep}: {sum(spent.values()):.4f} s, "
                      f"{rows[-1]['asked']} ranks asked", flush=True)
        finally:
            mon.stop()
    measured, g = rows[2:] or rows, args.groups
    out = {"groups": g, "ranks": n, "sweeps": args.sweeps, "sweep_s": args.sweep_s,
           "clock": "thread CPU (time.thread_time)", "load_average": os.getloadavg(),
           "cores": os.cpu_count(), "stages_us_per_group": {}}
    print(f"detectors at {n} ranks, median of {len(measured)} sweeps, us/group of thread CPU")
    for _, _, label in STAGES:
        us = 1e6 * statistics.median(r["stages"].get(label, 0.0) for r in measured) / g
        out["stages_us_per_group"][label] = us
        print(f"  {label:>26}: {us:7.1f}")
    return save(out, args.json)


if __name__ == "__main__":
    sys.exit(main())
