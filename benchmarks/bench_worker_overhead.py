"""WorkerServer overhead: step time while the server is polled 10 times a second vs not polled.

One real job (a Lighthouse and ``--groups`` single-rank replica groups training the real
trainer), measured in alternating windows within one run, so both conditions share the same
processes, warm caches and machine load. Conditions, cycled window by window:

- ``idle``: nobody touches the servers;
- ``polled``: every rank's ``/v1/state`` and ``/metrics`` at ``--rate`` Hz (what the monitor
  and Prometheus read each sweep/scrape, 10x more often than their defaults);
- ``fr``: ``/v1/fr_trace`` at ``--fr-rate`` Hz. A Flight Recorder dump is torch's own work
  (~100 ms for a full 2000-entry buffer on this CPU), which is why the monitor fetches dumps
  every ``--fr-interval`` seconds or on suspicion, not every sweep. Each window's mean step time
is steps trained / wall time, read from the rank's own step counter at the window's edges.

    .venv/bin/python benchmarks/bench_worker_overhead.py [--windows 20] [--window-seconds 4]

Prints a table per window and the overhead as a ratio of medians (target: <= 1%). The job is
pinned to one core and the poller to another, as a remote monitor would be.
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

from lightkeeper.cluster import LocalCluster, wait_until  # noqa: E402

CONDITIONS = {"polled": ("/v1/state", "/metrics"), "fr": ("/v1/fr_trace",), "idle": ()}


def poll_loop(urls: list[str], endpoints, rate_hz: float, stop: threading.Event,
              counter: list[int]) -> None:
    session = requests.Session()
    period = 1.0 / rate_hz
    next_at = time.monotonic()
    while not stop.is_set():
        for url in urls:
            for ep in endpoints:
                try:
                    session.get(url + ep, timeout=2)
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
    ap.add_argument("--window-seconds", type=float, default=4.0)
    ap.add_argument("--rate", type=float, default=10.0, help="polls per second per endpoint")
    ap.add_argument("--fr-rate", type=float, default=1.0, help="Flight Recorder dumps per second")
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C so the job's processes are stopped by the context manager.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    # The job runs on CPU 0 and the poller (standing in for a remote monitor/Prometheus) on
    # CPU 1, so the step time shows the server side of the polling, not the client's CPU use.
    cpus = sorted(os.sched_getaffinity(0))
    pinned = len(cpus) >= 2
    if pinned:
        os.sched_setaffinity(0, {cpus[0]})
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(
        tmp, num_groups=args.groups, steps=10**9, pg_timeout_s=30
    ) as cluster:
        cluster.start()
        if pinned:
            os.sched_setaffinity(0, {cpus[1]})  # this thread and the pollers it starts
        urls = cluster.worker_urls()
        wait_until(lambda: all(requests.get(u + "/v1/state", timeout=2).json()["step"] >= 20
                               for u in urls), 120, what="warm-up steps")
        results: dict[str, list[float]] = {c: [] for c in CONDITIONS}
        cpu_share: dict[str, list[float]] = {c: [] for c in CONDITIONS}
        print(f"{'window':>6} {'condition':>9} {'steps':>6} {'s/step':>9} {'requests':>9}")
        order = list(CONDITIONS)
        for i in range(len(order) * args.windows):
            condition = order[i % len(order)]
            stop, counter = threading.Event(), [0, 0]
            poller = None
            if CONDITIONS[condition]:
                rate = args.fr_rate if condition == "fr" else args.rate
                poller = threading.Thread(target=poll_loop,
                                          args=(urls, CONDITIONS[condition], rate, stop, counter))
            start_cpu = server_cpu_seconds(urls)
            start_steps, t0 = committed_steps(urls), time.monotonic()
            if poller:
                poller.start()
            time.sleep(args.window_seconds)  # the measured window itself, not a synchronization
            steps, t1 = committed_steps(urls), time.monotonic()
            cpu_share[condition].append((server_cpu_seconds(urls) - start_cpu) / (t1 - t0) / len(urls))
            stop.set()
            if poller:
                poller.join()
            per_step = (t1 - t0) / max(1, (steps - start_steps) / len(urls))
            results[condition].append(per_step)
            print(f"{i:>6} {condition:>9} {(steps - start_steps) // len(urls):>6} "
                  f"{per_step * 1000:>7.2f}ms {counter[0]:>9}")
        med = {c: statistics.median(v) for c, v in results.items()}
        # The server's own CPU time is what it takes from training (the training thread needs
        # the GIL those requests hold), measured per request: a bound that machine noise does
        # not blur the way it blurs step times.
        for cond, shares in cpu_share.items():
            print(f"{cond}: WorkerServer CPU {statistics.median(shares) * 100:.2f}% of one core "
                  f"(per rank, median of {len(shares)} windows)")
        # Short windows cycled idle/polled/fr cancel the machine's slow drift; each cycle's
        # ratio to its own idle window is one paired sample.
        for cond in ("polled", "fr"):
            ratios = sorted(p / i - 1 for p, i in zip(results[cond], results["idle"], strict=True))
            q = statistics.quantiles(ratios, n=4)
            print(f"{cond}: paired overhead median {statistics.median(ratios) * 100:+.2f}% "
                  f"(interquartile {q[0] * 100:+.2f}% .. {q[2] * 100:+.2f}%, n={len(ratios)})")
        print("\nmedian step time: " + ", ".join(f"{c} {v * 1000:.2f} ms" for c, v in med.items()))
        print(f"overhead of /v1/state + /metrics at {args.rate:g} Hz: "
              f"{(med['polled'] / med['idle'] - 1) * 100:+.2f}%  (target <= +1%)")
        print(f"overhead of /v1/fr_trace at {args.fr_rate:g} Hz: "
              f"{(med['fr'] / med['idle'] - 1) * 100:+.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
