"""How long one monitor sweep takes over N simulated WorkerServers, N side by side in one run.

The simulated ranks (tests/support/monitor_sim.py) run in separate processes, 2,500 per process,
so the monitor's poller does not share their GIL; on a 2-core machine they still share the
cores, so the figures are pessimistic for a monitor on its own host. Per N it reports the
median and worst of several sweeps of the poller alone (``GET /v1/state`` from every rank), of
the whole monitor sweep over every rank (poll + view + detectors + metrics; ``--leader-polling
off``) and of the whole monitor sweep with leader polling (``on``: every group's rank 0 each
sweep, the others every ``--member-interval``; docs/scaling.md), side by side in one run, and the
monitor process's peak RSS. The simulated groups have 8 ranks, all healthy.

    .venv/bin/python benchmarks/bench_monitor_sweep.py --sizes 100,1000,3000,10000
    .venv/bin/python benchmarks/bench_monitor_sweep.py --sizes 10000 --profile /tmp/sweep
        # cProfile of the whole sweeps, both threads: /tmp/sweep.{loop,poller}.pstats
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from monitor.config import MonitorConfig  # noqa: E402
from monitor.poll.poller import Poller  # noqa: E402
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


def rss_mib() -> tuple[float, float]:
    """(current, peak) resident memory of this process, MiB."""
    cur = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
    return cur, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def monitor_sweeps(urls: list[str], sweeps: int, mode: str, d: str, profile: str | None,
                   gc_freeze: int | None = None) -> tuple[list[float], list[float], int, int]:
    """(sweep seconds, the monitor process's CPU seconds per sweep (all its threads),
    reachable ranks, URLs polled in the last sweep)."""
    mon = Monitor(MonitorConfig(port=0, targets=urls, state_path=os.path.join(d, f"{mode}.db"),
                                sd_out=os.path.join(d, f"{mode}_sd.json"),  # as the CLI does
                                poll_timeout_s=5.0, leader_polling=mode,
                                max_targets=max(10_000, len(urls)),
                                **({} if gc_freeze is None else
                                   {"gc_freeze_min_targets": gc_freeze})))
    try:
        mon.sweep_once()  # warm up: connect once, as a running monitor has
        mon.sweep_once()  # (leader polling plans from the previous sweep's view)
        profs = None
        if profile:
            profs = cProfile.Profile(), cProfile.Profile()
            asyncio.run_coroutine_threadsafe(_enable(profs[1]), mon.polling.poller._loop).result()
            profs[0].enable()
        full, cpu = [], []
        for _ in range(sweeps):
            t, c = time.perf_counter(), time.process_time()
            view = mon.sweep_once()
            full.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        if profs:
            profs[0].disable()
            asyncio.run_coroutine_threadsafe(_disable(profs[1]), mon.polling.poller._loop).result()
            profs[0].dump_stats(f"{profile}.{mode}.loop.pstats")
            profs[1].dump_stats(f"{profile}.{mode}.poller.pstats")
        up = sum(r.reachable for r in view.ranks.values())
        return full, cpu, up, len(mon.schedule.last.urls)
    finally:
        mon.stop()


async def _enable(p: cProfile.Profile) -> None:
    p.enable()


async def _disable(p: cProfile.Profile) -> None:
    p.disable()


def bench(n: int, sweeps: int, modes: list[str], profile: str | None,
          gc_freeze: int | None = None) -> dict:
    procs, urls = start_sims(n, groups=max(1, n // 8))
    try:
        poller = Poller(timeout_s=5.0, max_concurrency=1024, max_idle=n + 1024)
        poll_times, poll_cpu = [], []
        try:
            poller.sweep(urls)  # warm up: connect once, as a running monitor has
            for _ in range(sweeps):
                t, c = time.perf_counter(), time.process_time()
                res = poller.sweep(urls)
                poll_times.append(time.perf_counter() - t)
                poll_cpu.append(time.process_time() - c)
                ok = sum(r.ok for r in res.values())
        finally:
            poller.close()
        row = {"ranks": n, "ok": ok, "poll_median_s": statistics.median(poll_times),
               "poll_max_s": max(poll_times), "poll_cpu_median_s": statistics.median(poll_cpu),
               "load_average_before": os.getloadavg()[0]}
        with tempfile.TemporaryDirectory() as d:
            for mode in modes:
                full, cpu, up, asked = monitor_sweeps(urls, sweeps, mode, d, profile, gc_freeze)
                key = "sweep" if mode == "off" else "leader"
                row.update({f"{key}_median_s": statistics.median(full),
                            f"{key}_max_s": max(full), f"{key}_up": up,
                            f"{key}_cpu_median_s": statistics.median(cpu),
                            f"{key}_cpu_max_s": max(cpu), f"{key}_polled": asked})
        row["rss_mib"], row["peak_rss_mib"] = rss_mib()
        return row
    finally:
        stop_sims(procs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="100,1000,3000,10000")
    p.add_argument("--sweeps", type=int, default=5)
    p.add_argument("--modes", default="off,on",
                   help="leader polling modes to measure: off (every rank), on (leaders)")
    p.add_argument("--profile", default=None,
                   help="write cProfile stats of the monitor's sweeps to PREFIX.<mode>.*.pstats")
    p.add_argument("--gc-freeze-min-targets", type=int, default=None,
                   help="the monitor's gc_freeze_min_targets (default: its config's)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    raise_fd_limit()
    modes = args.modes.split(",")
    rows = []
    for n in args.sizes.split(","):
        rows.append(bench(int(n), args.sweeps, modes, args.profile, args.gc_freeze_min_targets))
        print(json.dumps(rows[-1]), flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'ranks':>7} {'answered':>8} {'poll median':>12} {'poll max':>9} "
          f"{'sweep median':>13} {'sweep max':>10} {'leader median':>14} {'leader max':>11} "
          f"{'peak RSS':>9}   (CPU: the monitor process's own seconds per sweep)")
    nan = float("nan")
    for r in rows:
        print(f"{r['ranks']:>7} {r['ok']:>8} {r['poll_median_s']:>11.3f}s {r['poll_max_s']:>8.3f}s "
              f"{r.get('sweep_median_s', nan):>12.3f}s {r.get('sweep_max_s', nan):>9.3f}s "
              f"{r.get('leader_median_s', nan):>13.3f}s {r.get('leader_max_s', nan):>10.3f}s "
              f"{r['peak_rss_mib']:>7.0f}MiB")
        print(f"{'':>7} {'CPU':>8} {r['poll_cpu_median_s']:>11.3f}s {'':>9} "
              f"{r.get('sweep_cpu_median_s', nan):>12.3f}s {r.get('sweep_cpu_max_s', nan):>9.3f}s "
              f"{r.get('leader_cpu_median_s', nan):>13.3f}s {r.get('leader_cpu_max_s', nan):>10.3f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
