"""How long one monitor sweep takes over N simulated WorkerServers, N side by side in one run.

The simulated ranks (tests/support/monitor_sim.py) run in separate processes, 2,500 per process,
so the monitor's poller does not share their GIL; on a 2-core machine they still share the
cores, so the figures are pessimistic for a monitor on its own host. Per N it reports the
median and worst of several sweeps of the poller alone (``GET /v1/state`` from every rank) and
of the whole monitor sweep (poll + view + detectors + metrics, no Flight Recorder).

    .venv/bin/python benchmarks/bench_monitor_sweep.py --sizes 100,1000,3000,10000
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from monitor.config import MonitorConfig  # noqa: E402
from monitor.poller import Poller  # noqa: E402
from monitor.service import Monitor  # noqa: E402
from tests.support.monitor_sim import raise_fd_limit  # noqa: E402

PER_PROCESS = 2500


def start_sims(n: int, groups: int) -> tuple[list[subprocess.Popen], list[str]]:
    procs, urls = [], []
    for offset in range(0, n, PER_PROCESS):
        k = min(PER_PROCESS, n - offset)
        p = subprocess.Popen([sys.executable, "-m", "tests.support.monitor_sim", "--ranks", str(k),
                              "--groups", str(max(1, groups * k // n)),
                              "--rank-offset", str(offset)],
                             cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(p)
    for p in procs:
        line = p.stdout.readline()
        if not line.startswith("SIM "):
            raise RuntimeError(f"simulator failed: {line!r}")
        urls += line.split()[1:]
    return procs, urls


def stop_sims(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            p.stdin.close()
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def bench(n: int, sweeps: int) -> dict:
    procs, urls = start_sims(n, groups=max(1, n // 8))
    try:
        poller = Poller(timeout_s=5.0, max_concurrency=1024)
        poll_times = []
        try:
            poller.sweep(urls)  # warm up: connect once, as a running monitor has
            for _ in range(sweeps):
                t = time.perf_counter()
                res = poller.sweep(urls)
                poll_times.append(time.perf_counter() - t)
                ok = sum(r.ok for r in res.values())
        finally:
            poller.close()
        with tempfile.TemporaryDirectory() as d:
            mon = Monitor(MonitorConfig(port=0, targets=urls, state_path=os.path.join(d, "s.db"),
                                        poll_timeout_s=5.0))
            try:
                mon.sweep_once()
                full = []
                for _ in range(sweeps):
                    t = time.perf_counter()
                    view = mon.sweep_once()
                    full.append(time.perf_counter() - t)
                up = sum(r.reachable for r in view.ranks.values())
            finally:
                mon.stop()
        return {"ranks": n, "ok": ok, "up": up,
                "poll_median_s": statistics.median(poll_times), "poll_max_s": max(poll_times),
                "sweep_median_s": statistics.median(full), "sweep_max_s": max(full)}
    finally:
        stop_sims(procs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="100,1000,3000,10000")
    p.add_argument("--sweeps", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    raise_fd_limit()
    rows = []
    for n in args.sizes.split(","):
        rows.append(bench(int(n), args.sweeps))
        print(json.dumps(rows[-1]), flush=True)
    print(f"{'ranks':>7} {'answered':>8} {'poll median':>12} {'poll max':>9} "
          f"{'sweep median':>13} {'sweep max':>10}")
    for r in rows:
        print(f"{r['ranks']:>7} {r['ok']:>8} {r['poll_median_s']:>11.3f}s {r['poll_max_s']:>8.3f}s "
              f"{r['sweep_median_s']:>12.3f}s {r['sweep_max_s']:>9.3f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
