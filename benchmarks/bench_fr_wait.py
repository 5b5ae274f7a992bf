"""How long until a host gone dark is evicted when a Flight Recorder fetch would hold the sweep,
two scenarios, each A/B alternating in one run:

- ``dark_mid_dump``: the host goes dark while the monitor fetches one of its ranks' dumps; the
  sweep's wait for dumps fixed at ``--fr-timeout`` (what the monitor did before
  monitor/poll/fr_bound.py; here FLOOR_S raised to the timeout) vs the bound as it ships.
- ``wedged``: another group's rank has a wedged dump (its state answers, its dumps never do;
  asked three times, the last for the whole timeout); the host goes dark 5.5-8.5 s after that
  third fetch began. Asked at every look (REST_S set to 0: what the monitor did before it rested
  such a rank) vs rested as it ships.

A real Monitor (defaults but ``--fr-interval 1``, so that a look comes each second, and ``dead``
evicted) against a real torchft Lighthouse that simulated groups join (tests/support/
monitor_sim.py, 3 groups of 2 ranks, heartbeat timeout 1 s). Each run waits for a look that
every rank answered, makes one rank of group 0 leave its next dump unanswered, and once that
fetch is in flight takes group 0's host dark (every request read, none answered, heartbeats
stopped). Reported: seconds from then to the kill the Lighthouse receives.

    .venv/bin/python benchmarks/bench_fr_wait.py --repeat 5 --json benchmarks/results/fr_wait.json
    .venv/bin/python benchmarks/bench_fr_wait.py --scenario wedged --repeat 5 --json ...
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightkeeper.processes import wait_until  # noqa: E402
from monitor.config import DetectorConfig, MonitorConfig, RailsConfig  # noqa: E402
from monitor.poll import fr_bound  # noqa: E402
from monitor.service import Monitor  # noqa: E402
from tests.support.monitor_sim import SimJob  # noqa: E402

FR_TIMEOUT_S = 5.0  # the flag's default


MODES = {"dark_mid_dump": ("fixed", "bounded"), "wedged": ("asked", "rested")}


def one_run(scenario: str, mode: str, tmp: str, rng: random.Random) -> dict:
    floor, rest = fr_bound.FLOOR_S, fr_bound.REST_S
    if mode == "fixed":
        fr_bound.FLOOR_S = FR_TIMEOUT_S  # every fetch waits the whole timeout
    elif mode == "asked":
        fr_bound.REST_S = 0.0  # a wedged dump is asked at every look
    job = SimJob(3, ranks_per_group=2, heartbeat_timeout_ms=1000)
    job.serve_dumps()
    mon = Monitor(MonitorConfig(
        port=0, state_path=os.path.join(tmp, "state.sqlite"),
        sd_out=os.path.join(tmp, "targets.json"), job="bench", lighthouse=job.url,
        targets=job.sim.urls, fr_timeout_s=FR_TIMEOUT_S,
        detectors=DetectorConfig(fr_interval_s=1.0),
        rails=RailsConfig(min_replicas=1, cooldown_s=0, evict_kinds=("dead",)))).start()
    try:
        if scenario == "dark_mid_dump":
            dark = job.dark_mid_dump(0)
        else:
            wait_until(lambda: all(r.fr_answered for r in job.sim.ranks), 30,
                       what="a Flight Recorder look at every rank")
            wedged = job.sim.group(1)[0]
            wedged.set_mode("fr_silent")
            wait_until(lambda: wedged.fr_held >= 3, 60, what="the third fetch of the wedged dump")
            time.sleep(rng.uniform(5.5, 8.5))  # places the fault, not a synchronization
            dark = time.monotonic()
            job.go_dark(0)
        wait_until(lambda: job.replica_ids[0] in job.kills, 60, what="the eviction")
        return {"evicted_after_s": round(time.monotonic() - dark, 2),
                "kills": len(job.kills)}
    finally:
        mon.stop()
        job.stop()
        fr_bound.FLOOR_S, fr_bound.REST_S = floor, rest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=list(MODES), default="dark_mid_dump")
    ap.add_argument("--repeat", type=int, default=5, help="pairs of runs (%(default)s)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows, modes, rng = [], MODES[args.scenario], random.Random(0)
    with tempfile.TemporaryDirectory(prefix="lk-fr-wait-") as tmp:
        for i in range(args.repeat):
            for mode in modes:
                d = os.path.join(tmp, f"{mode}{i}")
                os.makedirs(d)
                row = {"mode": mode, "run": i, **one_run(args.scenario, mode, d, rng)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    summary = {m: statistics.median(r["evicted_after_s"] for r in rows if r["mode"] == m)
               for m in modes}
    print(f"{args.scenario}: evicted after, median: "
          + ", ".join(f"{m} {v} s" for m, v in summary.items()))
    if args.json:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"command": "benchmarks/bench_fr_wait.py " + " ".join(sys.argv[1:]),
                       "scenario": args.scenario, "commit": commit, "load_avg": os.getloadavg(),
                       "median_evicted_after_s": summary, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
