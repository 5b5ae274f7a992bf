"""Cost of the clock-free step timing (worker_server/timing.py) on the training thread.

Every timed collective costs one ``StepTimer.waiting()`` (two ``time.monotonic()`` calls, a
thread-local flag and a float addition); every step one ``end_step()`` (a record appended under a
lock and the histogram listeners). Measured here against an empty ``with`` of the same shape.

    .venv/bin/python benchmarks/bench_step_timer.py [--calls 200000] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

from worker_server import RankIdentity, RankState
from worker_server.metrics import WorkerMetrics


def per_call(fn, calls: int, repeats: int = 5) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` runs of ``calls`` calls."""
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - started) / calls)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200_000)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    state = RankState(RankIdentity())
    WorkerMetrics(state)  # the histograms listen to every step, as in a served rank
    timer = state.timing
    timer.begin_step()
    null = contextlib.nullcontext()

    def baseline():
        with null:
            pass

    def timed_wait():
        with timer.waiting("group"):
            pass

    def nested_wait():  # Manager.allreduce calling wait_quorum
        with timer.waiting("cross"), timer.waiting("cross"):
            pass

    def step_end():
        timer.end_step(1)

    base = per_call(baseline, args.calls)
    rows = [("waiting() around a collective", per_call(timed_wait, args.calls) - base),
            ("nested waiting() (counted once)", per_call(nested_wait, args.calls) - base),
            ("end_step() with histograms", per_call(step_end, args.calls // 10))]
    print(f"{'what':36} {'cost per call':>14}")
    for name, seconds in rows:
        print(f"{name:36} {seconds * 1e6:11.2f} us")
    print(f"\n(an empty `with` costs {base * 1e6:.2f} us here; median of 5 runs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["bench_step_timer.py", *sys.argv[1:]]),
                       "load_avg": os.getloadavg(), "empty_with_us": round(base * 1e6, 3),
                       "us_per_call": {name: round(s * 1e6, 3) for name, s in rows}}, f,
                      indent=1)


if __name__ == "__main__":
    main()
