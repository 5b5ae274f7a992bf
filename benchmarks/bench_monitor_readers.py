"""What reading the monitor costs its sweeps: a real monitor process over 10,000 virtual ranks,
its endpoints' cost per request, and its sweep durations with N overview tabs open.

The monitor (monitor.service.Monitor with its loop and HTTP server, as ``lightkeeper monitor``
runs it; the sweep's wall time printed by the process) runs in its own process from each tree
given, alternating, over the same virtual ranks (tests/support/virtual_ranks.py, groups of 8,
one process, all healthy; no Lighthouse), with the CLI's defaults (interval 1 s, leader polling
from 2,000 targets). Per tree it reports:

- per endpoint, the client's seconds for the first request after a sweep ended (``cold``:
  the answer built for that sweep) and for a second one right after it (``warm``), and bytes;
- per N readers (threads of this process, not the monitor's): each an open browser tab on
  ``/``, loading it, then again after the page's own ``<meta http-equiv="refresh">``; the
  sweeps' median and worst wall time while they read, and the tabs' load times.

    .venv/bin/python benchmarks/bench_monitor_readers.py --base e16db3b^ --this 19d744c \\
        --pairs 2 --json benchmarks/results/monitor_readers_10k_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ["/", "/v1/cluster", "/v1/ranks", "/v1/findings", "/v1/hosts", "/metrics"]

CHILD = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from monitor.config import MonitorConfig
from monitor.service import Monitor
urls = open(sys.argv[2]).read().split()
mon = Monitor(MonitorConfig(port=0, targets=urls, state_path=os.path.join(sys.argv[3], "m.db"),
                            sd_out=os.path.join(sys.argv[3], "sd.json"),
                            max_targets=len(urls)))
sweep = mon.sweep_once
def timed():
    t = time.perf_counter()
    view = sweep()
    print("SWEEP", time.monotonic(), time.perf_counter() - t, flush=True)
    return view
mon.sweep_once = timed
mon.start()
print("URL", mon.url, flush=True)
sys.stdin.read()
mon.stop()
"""


def get(url: str) -> tuple[float, bytes]:
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as r:
        body = r.read()
    return time.perf_counter() - t, body


class MonitorProcess:
    def __init__(self, tree: str, urls_file: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="lk-readers-")
        self.p = subprocess.Popen([sys.executable, "-c", CHILD, tree, urls_file, self.dir],
                                  cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        line = self.p.stdout.readline()
        if not line.startswith("URL "):
            raise RuntimeError(f"monitor failed: {line!r}")
        self.url = line.split()[1]
        self.sweeps: list[tuple[float, float]] = []  # (monotonic end, seconds)
        self.cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            if line.startswith("SWEEP "):
                _, at, s = line.split()
                with self.cv:
                    self.sweeps.append((float(at), float(s)))
                    self.cv.notify_all()

    def next_sweep(self, timeout: float = 60.0) -> None:
        with self.cv:
            n = len(self.sweeps)
            if not self.cv.wait_for(lambda: len(self.sweeps) > n, timeout):
                raise RuntimeError("no sweep ended")

    def stop(self) -> None:
        self.p.stdin.close()
        try:
            self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        subprocess.run(["rm", "-rf", self.dir], check=False)


def tab(url: str, stop: threading.Event, loads: list[float]) -> None:
    """A browser tab on the overview: load, wait the page's refresh, load again."""
    stop.wait(random.uniform(0, 1.0))
    while not stop.is_set():
        s, body = get(url + "/")
        loads.append(s)
        m = re.search(rb'http-equiv="refresh" content="(\d+)"', body)
        stop.wait(int(m.group(1)) if m else 1)


def measure(tree: str, urls_file: str, repeats: int, readers: list[int], seconds: float) -> dict:
    mon = MonitorProcess(tree, urls_file)
    try:
        for _ in range(4):  # warm up: every rank polled once, leaders planned
            mon.next_sweep()
        row: dict = {"tree": tree, "endpoints": {}, "readers": {}}
        for path in PATHS:
            cold, warm = [], []
            for _ in range(repeats):
                mon.next_sweep()
                s, body = get(mon.url + path)
                cold.append(s)
                warm.append(get(mon.url + path)[0])
            row["endpoints"][path] = {"cold_median_s": statistics.median(cold),
                                      "cold_max_s": max(cold),
                                      "warm_median_s": statistics.median(warm),
                                      "bytes": len(body)}
        for n in readers:
            stop, loads = threading.Event(), []
            threads = [threading.Thread(target=tab, args=(mon.url, stop, loads), daemon=True)
                       for _ in range(n)]
            for t in threads:
                t.start()
            t0 = time.monotonic()
            stop.wait(seconds)
            t1 = time.monotonic()
            stop.set()
            for t in threads:
                t.join()
            mon.next_sweep(timeout=300)  # the sweeps that started while the tabs read
            sw = [s for at, s in mon.sweeps if at >= t0 + 2 and at - s <= t1]
            row["readers"][str(n)] = {
                "sweeps": len(sw), "sweep_median_s": statistics.median(sw), "sweep_max_s": max(sw),
                "page_loads": len(loads),
                "load_median_s": statistics.median(loads) if loads else None,
                "load_max_s": max(loads) if loads else None}
        return row
    finally:
        mon.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the git revision to compare with (exported "
                   "to a temporary directory)")
    p.add_argument("--this", default=None, help="the revision to measure (default: the "
                   "working tree)")
    p.add_argument("--ranks", type=int, default=10_000)
    p.add_argument("--pairs", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5, help="requests per endpoint")
    p.add_argument("--readers", default="0,1,3,10")
    p.add_argument("--seconds", type=float, default=20.0, help="per reader count")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.seconds <= 2.0:
        p.error("--seconds must be over 2 (the first 2 s of each reader count are not counted)")
    sys.path.insert(0, ROOT)
    from tests.support.monitor_sim import raise_fd_limit
    raise_fd_limit()
    out = {"what": "monitor endpoints' cost and sweeps under N overview tabs, base vs this tree",
           "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
           "ranks": args.ranks, "cores": os.cpu_count(), "runs": []}
    trees = {}
    for name, rev in (("base", args.base), ("this", args.this)):
        out[f"commit_{name}"] = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short=12", rev or "HEAD"],
            capture_output=True, text=True).stdout.strip() + ("" if rev else " + working tree")
        trees[name] = ROOT
        if rev:
            trees[name] = tempfile.mkdtemp(prefix=f"lk-{name}-")
            subprocess.run(f"git -C {ROOT} archive {rev} | tar -x -C {trees[name]}", shell=True,
                           check=True)
    vr = subprocess.Popen([sys.executable, "-m", "tests.support.virtual_ranks", "--ranks",
                           str(args.ranks), "--group-size", "8", "--step-s", "1.0"],
                          cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    urls_file = os.path.join(tempfile.mkdtemp(prefix="lk-urls-"), "urls.txt")
    try:
        port = int(vr.stdout.readline().split()[1])
        with open(urls_file, "w") as f:
            f.write("\n".join(f"http://127.0.0.1:{port}/r/{r}" for r in range(args.ranks)))
        readers = [int(n) for n in args.readers.split(",")]
        for _ in range(args.pairs):
            for name, tree in trees.items():
                row = {"which": name, "load_average_before": os.getloadavg()[0],
                       **measure(tree, urls_file, args.repeats, readers, args.seconds)}
                out["runs"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        vr.stdin.close()
        vr.wait(timeout=30)
        for d in [os.path.dirname(urls_file), *trees.values()]:
            if d != ROOT:
                subprocess.run(["rm", "-rf", d], check=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
