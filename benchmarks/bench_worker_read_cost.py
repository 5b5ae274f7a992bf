"""What one client reading a rank's WorkerServer back to back costs its training loop.

A rank as docs/worker_server.md has one start: a real torchft ``Manager`` (gloo, one replica
group, a real Lighthouse in another process) served with ``WorkerServer.start(manager)``,
training a Python-bound CPU step (``--work`` loop iterations, ~8 ms). A client process asks
``/metrics``, ``/v1/state``, ``/v1/stacks`` and ``/v1/fr_trace`` in turn, each answer read
before the next request, on one keep-alive connection (a misconfigured scraper, ``watch -n0
curl``, a dashboard of many panels). The run alternates ``--seconds`` windows with the client
reading and stopped (SIGSTOP/SIGCONT), so both conditions share the same process, caches and
machine drift; the rank is pinned to one core, the client and the Lighthouse to the other.
Figures: median steps/s of each condition, their ratio, and requests/s the client got answered.
``--server torch`` serves on torch's ``_WorkerServer`` (``POST /handler/lightkeeper_*``).

    .venv/bin/python benchmarks/bench_worker_read_cost.py [--windows 6] [--seconds 3]
        [--server flask|torch] [--endpoints metrics,state,...] [--clients 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")

LIGHTHOUSE = textwrap.dedent('''
    import sys, time
    from torchft.coordination import LighthouseServer
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    print(lh.address(), flush=True)
    sys.stdin.read()
''')

# argv: base URL, "flask" or "torch", endpoints, connections; counts answers on stdout when its stdin closes
CLIENT = textwrap.dedent('''
    import http.client, sys, threading
    from urllib.parse import urlsplit
    url, kind, names = urlsplit(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
    flask = {"metrics": "/metrics", "state": "/v1/state", "stacks": "/v1/stacks",
             "fr_trace": "/v1/fr_trace", "healthz": "/healthz"}
    paths = [("GET", flask[n]) if kind == "flask" else ("POST", "/handler/lightkeeper_" + n)
             for n in names]
    answered = [0, 0]  # 200s, others (counted without a lock: a few may be lost)
    def loop():
        conn = None
        while True:
            for method, path in paths:
                try:
                    conn = conn or http.client.HTTPConnection(url.hostname, url.port, timeout=10)
                    conn.request(method, path)
                    r = conn.getresponse()
                    r.read()
                    answered[0 if r.status == 200 else 1] += 1
                    if r.getheader("Connection", "").lower() == "close":
                        conn.close(); conn = None
                except OSError:
                    conn = None
    for _ in range(int(sys.argv[4])):
        threading.Thread(target=loop, daemon=True).start()
    sys.stdin.read()
    print(answered[0], answered[1], flush=True)
''')


def python_work(n: int) -> int:
    """A Python-bound piece of a step: holds the GIL the whole time, as a data loader or a
    Python-heavy loop does."""
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=6, help="windows per condition")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds per window")
    ap.add_argument("--work", type=int, default=60_000, help="Python loop iterations per step")
    ap.add_argument("--server", choices=("flask", "torch"), default="flask")
    ap.add_argument("--endpoints", default="metrics,state,stacks,fr_trace",
                    help="what the client asks, in turn (%(default)s)")
    ap.add_argument("--clients", type=int, default=1,
                    help="connections the client reads on at once (%(default)s)")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()

    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo

    from worker_server import WorkerServer

    cores = sorted(os.sched_getaffinity(0))
    rank_cores, other_cores = {cores[0]}, set(cores[1:] or cores)
    lighthouse = subprocess.Popen([sys.executable, "-c", LIGHTHOUSE], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
    client = None
    try:
        os.sched_setaffinity(lighthouse.pid, other_cores)
        os.sched_setaffinity(0, rank_cores)
        lh_url = lighthouse.stdout.readline().strip()
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0",
                          WORLD_SIZE="1", TORCHFT_LIGHTHOUSE=lh_url, REPLICA_GROUP_ID="0")
        torch.set_num_threads(1)
        model = torch.nn.Linear(16, 1)
        manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                          load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                          replica_id="read_cost_0", timeout=timedelta(seconds=10))
        server = WorkerServer.start(manager, replica_group=0, server=args.server)
        optimizer = Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.01))

        def step() -> None:
            optimizer.zero_grad()
            x = torch.randn(8, 16)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            loss.backward()
            python_work(args.work)
            for p in model.parameters():
                manager.allreduce(p.grad).wait()
            optimizer.step()

        for _ in range(50):  # warm up; fills the Flight Recorder and the step history
            step()
        base = server.url.replace("torch+http", "http")
        client = subprocess.Popen([sys.executable, "-c", CLIENT, base, server.server,
                                   args.endpoints, str(args.clients)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        os.sched_setaffinity(client.pid, other_cores)
        os.kill(client.pid, signal.SIGSTOP)
        rates: dict[str, list[float]] = {"quiet": [], "read": []}
        for w in range(2 * args.windows):
            cond = ("quiet", "read")[w % 2] if (w // 2) % 2 == 0 else ("read", "quiet")[w % 2]
            os.kill(client.pid, signal.SIGCONT if cond == "read" else signal.SIGSTOP)
            n, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < args.seconds:
                step()
                n += 1
            rates[cond].append(n / (time.monotonic() - t0))
        os.kill(client.pid, signal.SIGCONT)
        ok, refused = (int(v) for v in client.communicate("", timeout=30)[0].split())
        quiet, read = statistics.median(rates["quiet"]), statistics.median(rates["read"])
        result = {
            "server": server.server, "torch": torch.__version__,
            "steps_per_s_quiet": round(quiet, 1), "steps_per_s_read": round(read, 1),
            "read_over_quiet": round(read / quiet, 3),
            "endpoints": args.endpoints, "clients": args.clients,
            "client_answers_per_s": round(ok / (args.windows * args.seconds), 1),
            "client_non_200": refused,
            "windows": {k: [round(r, 1) for r in v] for k, v in rates.items()},
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "command": "benchmarks/bench_worker_read_cost.py " + " ".join(sys.argv[1:]),
        }
        print(json.dumps(result, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        manager.shutdown(wait=False)
        server.stop()
        del store
    finally:
        for proc in (client, lighthouse):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
