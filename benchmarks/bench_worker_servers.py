"""What a request costs a rank on each server: Lightkeeper's Flask (waitress) WorkerServer and
torch's own ``_WorkerServer`` carrying Lightkeeper's handlers, side by side in one run.

One rank process serves both at once over the same state: a gloo process group (world size 1)
that ran ``--steps`` all_reduces with the Flight Recorder on (``TORCH_FR_BUFFER_SIZE``), so
``/v1/state`` holds a full step history and ``/v1/fr_trace`` a full buffer; then the rank idles,
so the process's CPU is what serving costs. Each round asks every endpoint below a batch of
requests, one after another, in a rotated order (every endpoint shares the round's drift):

- Flask: ``GET /v1/state``, ``GET /metrics``, ``GET /v1/fr_trace``, ``GET /healthz``;
- torch: ``POST /handler/lightkeeper_state``, ``lightkeeper_metrics``, ``lightkeeper_fr_trace``,
  and torch's own ``ping`` and ``fr_trace_json`` for reference;

each batch on one keep-alive connection (``keepalive``: the client reconnects when the server
closes; torch's closes after 30 requests or 1 s idle) and on a new connection per request
(``fresh``: what the monitor's one poll per rank per second meets on torch's server, whose
keep-alive ends after 1 s). Figures: latency p50/p99 per request (all rounds), and the rank
process's CPU seconds per 1,000 requests (``/proc/<pid>/stat``, median of the rounds, the idle
process's own CPU over the same time subtracted). The rank is pinned to one core, the client to
the other, as a remote monitor would be. Reads are not paced here (the rank's pacing wait is
set to 0): the figures are each request's own cost.

    .venv/bin/python benchmarks/bench_worker_servers.py [--rounds 3] [--requests 500]
        [--fr-requests 20] [--steps 2000] [--json FILE]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RANK = textwrap.dedent('''
    import json, os, sys, time
    import torch
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    from worker_server import RankIdentity, RankState, WorkerServer
    from worker_server import metrics as paced

    # a request's own cost, without the wait that paces back-to-back reads (what that wait
    # buys: bench_worker_read_cost.py)
    paced.MAX_PACE_S = 0.0
    steps = int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    state = RankState(RankIdentity(job="bench", replica_group=0, group_rank=0,
                                   group_world_size=1))
    flask = WorkerServer(state).serve()
    on_torch = WorkerServer(state, tracker=flask.tracker, server="torch").serve()
    grad = torch.ones(1024)
    for step in range(1, steps + 1):  # a training rank's history and Flight Recorder
        state.step_started()
        state.timing.begin_step()
        state.set_phase("allreduce")
        with state.timing.waiting("cross"):
            dist.all_reduce(grad)
        state.timing.end_step(step)
        state.step_finished(step, committed=True, loss=1.0 / step)
    state.set_phase("optimizer")
    print(json.dumps({"flask": flask.url, "torch": on_torch.url, "server": on_torch.server}),
          flush=True)
    sys.stdin.read()  # idle until the benchmark is done
    on_torch.stop()
    flask.stop()
''')

# (name, server, method, path, fr: whether it is a Flight Recorder dump: fewer requests)
ENDPOINTS = (
    ("flask /v1/state", "flask", "GET", "/v1/state", False),
    ("torch lightkeeper_state", "torch", "POST", "/handler/lightkeeper_state", False),
    ("flask /metrics", "flask", "GET", "/metrics", False),
    ("torch lightkeeper_metrics", "torch", "POST", "/handler/lightkeeper_metrics", False),
    ("flask /healthz", "flask", "GET", "/healthz", False),
    ("torch ping", "torch", "POST", "/handler/ping", False),
    ("flask /v1/fr_trace", "flask", "GET", "/v1/fr_trace", True),
    ("torch lightkeeper_fr_trace", "torch", "POST", "/handler/lightkeeper_fr_trace", True),
    ("torch fr_trace_json", "torch", "POST", "/handler/fr_trace_json", True),
)
MODES = ("keepalive", "fresh")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def batch(host: str, port: int, method: str, path: str, n: int, fresh: bool
          ) -> tuple[list[float], int]:
    """``n`` requests; (latencies in seconds, bytes of the last answer)."""
    lat: list[float] = []
    conn = http.client.HTTPConnection(host, port, timeout=30)
    size = 0
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            conn.request(method, path, body=b"" if method == "POST" else None)
            resp = conn.getresponse()
            body = resp.read()
            lat.append(time.perf_counter() - t0)
            if resp.status != 200:
                raise RuntimeError(f"{method} {path}: HTTP {resp.status} {body[:200]!r}")
            size = len(body)
            if fresh:
                conn.close()  # http.client opens a new connection for the next request
    finally:
        conn.close()
    return lat, size


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=500, help="per endpoint, mode and round")
    ap.add_argument("--fr-requests", type=int, default=20,
                    help="per Flight Recorder endpoint, mode and round")
    ap.add_argument("--steps", type=int, default=2000, help="all_reduces before measuring")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    cpus = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": os.environ.get("TORCH_FR_BUFFER_SIZE", "2000")}
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "rank.py"
        script.write_text(RANK)
        rank = subprocess.Popen([sys.executable, str(script), str(ROOT), str(args.steps)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            if len(cpus) >= 2:
                os.sched_setaffinity(rank.pid, {cpus[0]})
                os.sched_setaffinity(0, {cpus[1]})
            first = rank.stdout.readline()
            if not first:
                raise SystemExit(f"the rank exited ({rank.wait()}) before serving")
            urls = json.loads(first)
            if urls["server"] != "torch":
                raise SystemExit("torch's server is not available in this torch")
            results = measure(rank.pid, urls, args)
        finally:
            rank.stdin.close()
            try:
                rank.wait(timeout=30)
            except subprocess.TimeoutExpired:
                rank.kill()
                rank.wait()
    import torch

    out = {"what": "per-request latency and rank CPU, Flask vs torch's _WorkerServer",
           "command": "benchmarks/bench_worker_servers.py " + " ".join(sys.argv[1:]),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip(),
           "torch": torch.__version__, "load_avg": os.getloadavg(), "cpus": len(cpus),
           "steps": args.steps, "rounds": args.rounds, "results": results}
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def measure(pid: int, urls: dict, args) -> list[dict]:
    addr = {}
    for server in ("flask", "torch"):
        host_port = urls[server].split("://", 1)[1]
        host, port = host_port.rsplit(":", 1)
        addr[server] = (host, int(port))
    # warm-up: every endpoint once (imports, first dumps)
    for _, server, method, path, _ in ENDPOINTS:
        batch(*addr[server], method, path, 2, False)
    t0, c0 = time.monotonic(), cpu_seconds(pid)
    time.sleep(3.0)
    idle_rate = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)  # the idle process's CPU/s
    lat: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    size: dict[str, int] = {}
    jobs = [(e, m) for e in ENDPOINTS for m in MODES]
    for r in range(args.rounds):
        for i in range(len(jobs)):
            (name, server, method, path, fr), mode = jobs[(i + r * 5) % len(jobs)]
            n = args.fr_requests if fr else args.requests
            t0, c0 = time.monotonic(), cpu_seconds(pid)
            got, size[name] = batch(*addr[server], method, path, n, mode == "fresh")
            spent = cpu_seconds(pid) - c0 - idle_rate * (time.monotonic() - t0)
            lat.setdefault((name, mode), []).extend(got)
            cpu.setdefault((name, mode), []).append(spent / n * 1000)
    rows = []
    for (name, server, _, path, _), mode in jobs:
        values = lat[name, mode]
        rows.append({"endpoint": name, "server": server, "mode": mode, "path": path,
                     "requests": len(values), "bytes": size[name],
                     "p50_ms": round(percentile(values, 0.5) * 1000, 3),
                     "p99_ms": round(percentile(values, 0.99) * 1000, 3),
                     "cpu_s_per_1000": round(statistics.median(cpu[name, mode]), 3),
                     "cpu_s_per_1000_rounds": [round(v, 3) for v in cpu[name, mode]]})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'endpoint':30} {'mode':10} {'bytes':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'CPU s/1000':>10}")
    for r in rows:
        print(f"{r['endpoint']:30} {r['mode']:10} {r['bytes']:>8} {r['p50_ms']:>8.2f} "
              f"{r['p99_ms']:>8.2f} {r['cpu_s_per_1000']:>10.3f}")


if __name__ == "__main__":
    sys.exit(main())
