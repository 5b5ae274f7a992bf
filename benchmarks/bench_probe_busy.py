"""A rank busy in Python against the probe mesh: is its host named as a network fault?

Four real WorkerServers, each in its own process on 127.0.0.1 and named as its own host
(h0..h3); h3's process also runs ``--busy`` Python threads spinning (a training process whose
GIL is held: data loading, a Python-heavy step). No network fault anywhere. Each round asks
every rank ``POST /v1/probe`` for all its peers, as the monitor does, and judges the round with
the monitor's verdict (``monitor.detect.network.place``) twice: with each rank's ``control``
(its transfer from itself) and without it (as before the control existed). Reported: the links'
rates, the controls, and how many rounds named h3 each way.

    .venv/bin/python benchmarks/bench_probe_busy.py --rounds 20 \
        --json benchmarks/results/probe_busy_rank.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from monitor.detect.network import place  # noqa: E402
from monitor.evidence.probes import HostProbe, ProbeRound, link_row  # noqa: E402

TOKEN = "bench-probe-busy"
RANK = """
import sys, threading, time
from worker_server import RankIdentity, RankState, WorkerServer
host, busy = sys.argv[1], int(sys.argv[2])
s = WorkerServer(RankState(RankIdentity(host=host)), exit_token=sys.argv[3]).serve()
print(s.url, flush=True)
def spin():
    while True:
        sum(i * i for i in range(1000))
for _ in range(busy):
    threading.Thread(target=spin, daemon=True).start()
sys.stdin.read()  # until the benchmark closes it
"""


def start(host: str, busy: int) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", RANK, host, str(busy), TOKEN], cwd=ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip()


def one_round(urls: dict[str, str], nbytes: int, timeout_s: float) -> ProbeRound:
    """Every rank asked at once, as the monitor asks them."""
    started = time.time()
    with ThreadPoolExecutor(len(urls)) as ex:
        probes = dict(zip(urls, ex.map(lambda h: ask(h, urls, nbytes, timeout_s), urls),
                              strict=True))
    return ProbeRound(started, time.time(), probes)


def ask(h: str, urls: dict[str, str], nbytes: int, timeout_s: float) -> HostProbe:
    peers = {o: u for o, u in urls.items() if o != h}
    p = HostProbe(h, urls[h], 0, peers)
    r = requests.post(urls[h] + "/v1/probe", json={"peers": list(peers.values()),
                                                   "bytes": nbytes, "timeout_s": timeout_s},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    p.status = r.status_code
    doc = r.json()
    host_of = {u: o for o, u in peers.items()}
    p.results = {host_of[row["peer"]]: link_row(row) for row in doc["results"]}
    p.control = link_row(doc["control"])
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2],
                    help="spinning threads in h3's process, one run each")
    ap.add_argument("--bytes", type=int, default=262144)
    ap.add_argument("--timeout", type=float, default=1.0)
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs = [run(busy, args) for busy in args.busy]
    for r in runs:
        print(json.dumps({k: v for k, v in r.items() if k != "per_round"}))
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "bytes": args.bytes,
                                         "ratio": args.ratio, "runs": runs}, indent=1) + "\n")


def confirmed(named: list[list[str]]) -> int:
    """Rounds that named h3 as the one before did: each would confirm a finding (2 in a row)."""
    return sum("h3" in a and "h3" in b for a, b in zip(named[:-1], named[1:], strict=True))


def run(busy: int, args: argparse.Namespace) -> dict:
    procs, urls = [], {}
    try:
        for i in range(4):
            p, url = start(f"h{i}", busy if i == 3 else 0)
            procs.append(p)
            urls[f"h{i}"] = url
        rows = []
        for _ in range(args.rounds):
            rnd = one_round(urls, args.bytes, args.timeout)
            with_control = place(rnd, args.ratio)
            controls = {h: c["mbit_s"] for h, c in rnd.controls().items()}
            for p in rnd.probes.values():
                p.control = None
            without = place(rnd, args.ratio)
            m = rnd.matrix()
            rows.append({
                "links_from_h3_mbit_s": [m[h]["h3"]["mbit_s"] for h in ("h0", "h1", "h2")],
                "links_others_mbit_s": [m[a][b]["mbit_s"] for a in ("h0", "h1", "h2")
                                        for b in ("h0", "h1", "h2") if a != b],
                "controls_mbit_s": controls,
                "named_with_control": with_control.hosts, "named_without": without.hosts,
                "verdict_with_control": with_control.text})
    finally:
        for p in procs:
            p.stdin.close()
            p.kill()
            p.wait()
    return {"busy_threads": busy, "rounds": args.rounds,
            "h3_named_without_control": sum("h3" in r["named_without"] for r in rows),
            "h3_named_with_control": sum("h3" in r["named_with_control"] for r in rows),
            "h3_confirmed_without_control": confirmed([r["named_without"] for r in rows]),
            "h3_confirmed_with_control": confirmed([r["named_with_control"] for r in rows]),
            "any_named_with_control": sum(bool(r["named_with_control"]) for r in rows),
            "median_link_from_h3_mbit_s": statistics.median(
                x for r in rows for x in r["links_from_h3_mbit_s"] if x),
            "median_link_others_mbit_s": statistics.median(
                x for r in rows for x in r["links_others_mbit_s"] if x),
            "per_round": rows}

if __name__ == "__main__":
    main()
