"""WorkerServer overhead: step time while the servers are read vs not read, side by side.

One real job (a Lighthouse and ``--groups`` single-rank replica groups training the real
trainer), measured in short windows cycled through the conditions within one run, so every
condition shares the same processes, warm caches and machine drift:

- ``idle``: nobody touches the servers;
- ``polled``: every rank's ``/v1/state`` 10 times a second (the monitor's poll; its default
  is once a second);
- ``scraped``: ``/metrics`` once a second (Prometheus' default is every 15 s);
- ``fr``: ``/v1/fr_trace`` every 5 s. A full Flight Recorder dump is torch's own work
  (~50-100 ms for a 2000-entry buffer on this CPU, under the GIL), which is why the monitor
  fetches dumps every ``--fr-interval`` (15 s) or on suspicion, not every sweep.

Two figures per condition: the WorkerServer's own CPU (``lightkeeper_worker_server_cpu_seconds_total``,
measured per request: what it takes from the training thread, which needs the GIL those requests
hold), and the step-time overhead as paired ratios to the idle window of the same cycle. The job
is pinned to one core and the poller to the other, as a remote monitor would be.

    .venv/bin/python benchmarks/bench_worker_overhead.py [--windows 20] [--window-seconds 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightkeeper.cluster import LocalCluster  # noqa: E402
from lightkeeper.processes import wait_until  # noqa: E402

# condition -> (endpoints, requests per second to each)
CONDITIONS: dict[str, tuple[tuple[str, ...], float]] = {
    "idle": ((), 0.0),
    "polled": (("/v1/state",), 10.0),
    "scraped": (("/metrics",), 1.0),
    "fr": (("/v1/fr_trace",), 0.2),
}


def poll_loop(urls: list[str], endpoints, rate_hz: float, stop: threading.Event,
              counter: list[int]) -> None:
    session = requests.Session()
    period = 1.0 / rate_hz
    next_at = time.monotonic()
    while not stop.is_set():
        for url in urls:
            for ep in endpoints:
                try:
                    session.get(url + ep, timeout=5)
                    counter[0] += 1
                except requests.RequestException:
                    counter[1] += 1
        next_at += period
        stop.wait(max(0.0, next_at - time.monotonic()))


def committed_steps(urls: list[str]) -> int:
    return sum(requests.get(u + "/v1/state", timeout=2).json()["commits"] for u in urls)


def server_cpu_seconds(urls: list[str]) -> float:
    """The WorkerServers' own CPU accounting (lightkeeper_worker_server_cpu_seconds_total)."""
    total = 0.0
    for u in urls:
        for line in requests.get(u + "/metrics", timeout=2).text.splitlines():
            if line.startswith("lightkeeper_worker_server_cpu_seconds_total{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--windows", type=int, default=20, help="windows per condition")
    ap.add_argument("--window-seconds", type=float, default=5.0)
    args = ap.parse_args()
    if args.windows < 2:
        ap.error("--windows must be at least 2 (a spread needs two)")
    # SIGTERM unwinds like Ctrl-C so the job's processes are stopped by the context manager.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    cpus = sorted(os.sched_getaffinity(0))
    pinned = len(cpus) >= 2
    if pinned:
        os.sched_setaffinity(0, {cpus[0]})  # the job's processes inherit this
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(
        tmp, num_groups=args.groups, steps=10**9, pg_timeout_s=30
    ) as cluster:
        cluster.start()
        if pinned:
            os.sched_setaffinity(0, {cpus[1]})  # this thread and the pollers it starts
        urls = cluster.worker_urls()
        wait_until(lambda: all(requests.get(u + "/v1/state", timeout=2).json()["step"] >= 20
                               for u in urls), 120, what="warm-up steps")
        step_s: dict[str, list[float]] = {c: [] for c in CONDITIONS}
        cpu_share: dict[str, list[float]] = {c: [] for c in CONDITIONS}
        print(f"{'window':>6} {'condition':>9} {'steps':>6} {'s/step':>9} {'server CPU':>10} "
              f"{'requests':>9}")
        order = list(CONDITIONS)
        for i in range(len(order) * args.windows):
            condition = order[i % len(order)]
            endpoints, rate = CONDITIONS[condition]
            stop, counter = threading.Event(), [0, 0]
            poller = (threading.Thread(target=poll_loop,
                                       args=(urls, endpoints, rate, stop, counter))
                      if endpoints else None)
            cpu0 = server_cpu_seconds(urls)
            steps0, t0 = committed_steps(urls), time.monotonic()
            if poller:
                poller.start()
            time.sleep(args.window_seconds)  # the measured window itself, not a synchronization
            steps1, t1 = committed_steps(urls), time.monotonic()
            stop.set()
            if poller:
                poller.join()
            share = (server_cpu_seconds(urls) - cpu0) / (t1 - t0) / len(urls)
            per_step = (t1 - t0) / max(1, (steps1 - steps0) / len(urls))
            step_s[condition].append(per_step)
            cpu_share[condition].append(share)
            print(f"{i:>6} {condition:>9} {(steps1 - steps0) // len(urls):>6} "
                  f"{per_step * 1000:>7.2f}ms {share * 100:>9.2f}% {counter[0]:>9}")

        print("\nmedian step time: " + ", ".join(
            f"{c} {statistics.median(v) * 1000:.2f} ms" for c, v in step_s.items()))
        for cond, (endpoints, rate) in CONDITIONS.items():
            if not endpoints:
                continue
            # Each cycle's ratio to its own idle window is one paired sample.
            ratios = sorted(p / i - 1 for p, i in zip(step_s[cond], step_s["idle"], strict=True))
            q = statistics.quantiles(ratios, n=4)
            print(f"{cond:>8} ({endpoints[0]} at {rate:g}/s): server CPU "
                  f"{statistics.median(cpu_share[cond]) * 100:.2f}% of a core; step time "
                  f"{statistics.median(ratios) * 100:+.2f}% (interquartile {q[0] * 100:+.2f}% "
                  f".. {q[2] * 100:+.2f}%, n={len(ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
