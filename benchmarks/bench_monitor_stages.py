"""Where one monitor sweep's time goes at 100,000 ranks, stage by stage, without HTTP.

The real Monitor (leader polling on, no Lighthouse) over ``--groups`` x ``--group-size``
virtual ranks (tests/support/virtual_ranks.py's documents: states with per-step timings), with
its poller replaced by an in-process one that answers each URL asked with the document a
virtual rank would serve, parsed as the poller would (``json.loads``); Flight Recorder requests
get a 404. What is left is the monitor's own per-sweep work on the answers, split by stage
(schedule, view + verification, Flight Recorder trigger, detectors, host ledger, goodput,
metrics), and the seconds its cyclic garbage collector took; the HTTP side's cost per request
is bench_monitor_sweep.py's poller row. A fake poller because the point is to take the
requests out; the answers are the real documents.

    .venv/bin/python benchmarks/bench_monitor_stages.py --groups 12500 --sweeps 3
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

from benchmarks.bench_monitor_100k import GcClock, save  # noqa: E402
from monitor.config import MonitorConfig  # noqa: E402
from monitor.poller import RankPoll  # noqa: E402
from monitor.service import Monitor  # noqa: E402
from tests.support.virtual_ranks import VirtualRanks  # noqa: E402


class InProcessPoller:
    """Answers like the virtual ranks, without sockets (see the module docstring)."""

    max_idle = 0

    def __init__(self, vr: VirtualRanks, index: dict[str, int]) -> None:
        self.vr, self.index = vr, index
        self.seconds = 0.0

    def sweep(self, urls, path="/v1/state", timeout_s=None, max_bytes=None):
        t = time.perf_counter()
        if path != "/v1/state":
            out = {u: RankPoll(u, False, reason="http_status", error="HTTP 404: b''")
                   for u in urls}
        else:
            out = {u: RankPoll(u, True, data=json.loads(self.vr.state(self.index[u])))
                   for u in urls}
        self.seconds += time.perf_counter() - t
        return out

    def close(self) -> None:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=12_500)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--sweeps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n = args.groups * args.group_size
    vr = VirtualRanks(n, 0, args.group_size, 1.0)
    urls = [f"http://127.0.0.1:1/r/{r}" for r in range(n)]
    poller = InProcessPoller(vr, {u: i for i, u in enumerate(urls)})
    gc_clock = GcClock()
    stages: dict[str, list[float]] = {}
    now: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        mon = Monitor(MonitorConfig(port=0, targets=urls, state_path=os.path.join(d, "m.db"),
                                    leader_polling="on", max_targets=n))
        mon.poller.close()
        mon.poller = poller
        try:
            mon.sweep_once()
            mon.sweep_once()

            def timed(obj, name: str, label: str) -> None:
                f = getattr(obj, name)

                def w(*a, **k):
                    t = time.perf_counter()
                    try:
                        return f(*a, **k)
                    finally:
                        now[label] = now.get(label, 0.0) + time.perf_counter() - t
                setattr(obj, name, w)

            timed(mon.schedule, "plan", "schedule")
            timed(mon.views, "update", "view + verification")
            timed(mon.detectors, "fr_wanted", "Flight Recorder trigger")
            timed(mon.detectors, "update", "detectors")
            timed(mon, "_host_findings", "host ledger")
            timed(mon, "_judge_hosts", "host ledger")
            timed(mon, "_account_goodput", "goodput")
            timed(mon, "_publish_metrics", "metrics")
            row = {"ranks": n, "groups": args.groups, "sweeps": []}
            for _ in range(args.sweeps):
                now.clear()
                poller.seconds = 0.0
                gc_clock.take()
                t, c = time.perf_counter(), time.process_time()
                mon.sweep_once()
                wall, cpu = time.perf_counter() - t, time.process_time() - c
                sweep = {"wall_s": wall, "cpu_s": cpu, "answers_s": poller.seconds,
                         "monitor_s": wall - poller.seconds, "gc_s": gc_clock.take(),
                         "asked": len(mon.schedule.last.urls), **now}
                row["sweeps"].append(sweep)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in sweep.items()}), flush=True)
        finally:
            mon.stop()
    for key in row["sweeps"][0]:
        stages[key] = [s.get(key, 0.0) for s in row["sweeps"]]
    row["median"] = {k: statistics.median(v) for k, v in stages.items()}
    row["load_average"] = os.getloadavg()[0]
    row["cores"] = os.cpu_count()
    print(f"median of {args.sweeps} sweeps at {n} ranks (load average "
          f"{row['load_average']:.1f} on {row['cores']} cores):")
    for k, v in row["median"].items():
        per_group = f"{1e6 * v / args.groups:8.1f} us/group" if k.endswith("_s") or " " in k \
            or k in ("schedule", "detectors", "goodput", "metrics") else ""
        print(f"  {k:>26}: {v:10.3f}  {per_group}")
    return save(row, args.json)


if __name__ == "__main__":
    sys.exit(main())
