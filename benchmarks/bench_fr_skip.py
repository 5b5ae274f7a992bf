"""The hang's confirming sweep at 100,000 virtual ranks: its Flight Recorder stage with the
leaders' fetch skipped (monitor/polling.py, ``Polling.fr_dumps``: the drilled group's hang is
confirmed inside it from its own dumps) and with it made (as before), side by side.

bench_monitor_100k.py's job (``--procs`` virtual-rank processes, the real monitor, leader
polling on, members every 30 s) is swept until the hang planted in a non-leader rank is
confirmed. On that sweep's evidence view and clock, ``fr_dumps`` and the detectors' analysis
of what it returns (``normalize_dumps`` + the engine) are then run ``--pairs`` times each way,
alternating (skip, full; full, skip; ...): wall seconds, the sweep thread's CPU, the poller
process's CPU (the requests), the dumps returned. The same view and answers each time, so the
difference is the leaders' fetch and its analysis alone; the load average is printed with it.

    .venv/bin/python benchmarks/bench_fr_skip.py --groups 12500 --group-size 8 --pairs 5
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

from benchmarks.bench_monitor_100k import PollerCpu, save, start, stop, tell  # noqa: E402
from monitor.analysis import normalize_dumps  # noqa: E402
from monitor.config import MonitorConfig  # noqa: E402
from monitor.service import Monitor  # noqa: E402
from tests.support.monitor_sim import raise_fd_limit  # noqa: E402


def confirming_sweep(mon: Monitor, procs: list, victim: int) -> float:
    """Plant the hang and sweep (1 s interval) until it is confirmed; seconds after onset."""
    tell(procs, f"hang {victim}")
    onset = time.perf_counter()
    while time.perf_counter() - onset < 120:
        t = time.perf_counter()
        mon.sweep_once()
        if any(f.kind == "hang" for f in mon.detectors.open_findings()):
            return time.perf_counter() - onset
        time.sleep(max(0.0, 1.0 - (time.perf_counter() - t)))
    raise RuntimeError("the hang was not confirmed in 120 s")


def measure(mon: Monitor, skip: bool) -> dict:
    """One Flight Recorder stage of the confirming sweep, then the analysis of its dumps."""
    view, now = mon.evidence, mon.view.at
    if skip:
        mon.detectors.__dict__.pop("in_group_hangs", None)
    else:  # as before this round: the leaders' dumps are always fetched
        mon.detectors.in_group_hangs = lambda *a, **k: set()
    pollers = PollerCpu(mon)
    child, cpu, wall = pollers.read()[0], time.thread_time(), time.perf_counter()
    dumps = mon.polling.fr_dumps(view, now)
    fetched = {"fetch_wall_s": time.perf_counter() - wall, "fetch_cpu_s": time.thread_time() - cpu,
               "child_cpu_s": pollers.read()[0] - child}
    cpu, wall = time.thread_time(), time.perf_counter()
    traces, _ = normalize_dumps(dumps)
    mon.detectors.analyzer(traces)
    fetched.update(analysis_wall_s=time.perf_counter() - wall,
                   analysis_cpu_s=time.thread_time() - cpu, dumps=len(dumps),
                   leaders_skipped=mon.polling.fr_leaders_skipped)
    return fetched


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=12_500)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    raise_fd_limit()
    n = args.groups * args.group_size
    procs, urls = start(n, args.procs, args.group_size, 1.0)
    row: dict = {"ranks": n, "groups": args.groups, "load_average_start": os.getloadavg()[0]}
    try:
        with tempfile.TemporaryDirectory() as d:
            mon = Monitor(MonitorConfig(port=0, targets=urls, state_path=os.path.join(d, "m.db"),
                                        poll_timeout_s=10.0, leader_polling="on",
                                        member_interval_s=30.0, max_targets=n))
            try:
                mon.sweep_once()
                for _ in range(3):  # leader sweeps
                    t = time.perf_counter()
                    mon.sweep_once()
                    time.sleep(max(0.0, 1.0 - (time.perf_counter() - t)))
                g = args.groups // 2
                row["confirmed_after_s"] = confirming_sweep(mon, procs, g * args.group_size + 3)
                row["drilled"] = dict(mon.sweep_plan.drilled)
                runs: dict[str, list] = {"skip": [], "full": []}
                for i in range(args.pairs):  # alternating order
                    for mode in (("skip", "full") if i % 2 == 0 else ("full", "skip")):
                        runs[mode].append(measure(mon, mode == "skip"))
                row["runs"] = runs
                row["median"] = {mode: {k: statistics.median(r[k] for r in rs)
                                        for k in rs[0] if k != "leaders_skipped"}
                                 for mode, rs in runs.items()}
            finally:
                mon.stop()
    finally:
        stop(procs)
    row["load_average"] = os.getloadavg()[0]
    print(json.dumps({k: v for k, v in row.items() if k != "runs"}, indent=1))
    return save(row, args.json)


if __name__ == "__main__":
    sys.exit(main())
