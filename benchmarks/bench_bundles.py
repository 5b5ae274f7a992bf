"""What an incident bundle adds to a kill: the time from the eviction decision to the kill
request sent, with and without the bundle, with healthy and with unresponsive ranks.

The monitor side is the real code (``monitor.act.bundles.Bundles.capture``, then
``monitor.act.actions.Lighthouse.kill``); the ranks are simulated WorkerServers
(tests/support/monitor_sim.py) serving a Flight Recorder dump of ``--entries`` entries (JSON,
made once by tests/support/frgen.py) and their stacks; the Lighthouse is a local HTTP server
answering the kill with 500, as torchft 0.2.0 does. Scenarios, each ``--repeat`` times:

- ``no bundle``: the kill alone;
- ``healthy``: every rank answers;
- ``culprit silent``: the culprit group's ranks accept the connection and never answer (a
  hung or SIGSTOPped process);
- ``all silent``: no rank answers.

    .venv/bin/python benchmarks/bench_bundles.py --json benchmarks/results/bundles_kill_latency.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from monitor.act.actions import Lighthouse  # noqa: E402
from monitor.act.bundles import Bundles  # noqa: E402
from monitor.config import BundleConfig, MonitorConfig  # noqa: E402
from monitor.evidence.rank import RankView  # noqa: E402
from monitor.store import Store  # noqa: E402
from tests.support.frgen import FRJob  # noqa: E402
from tests.support.monitor_sim import SimRanks  # noqa: E402
from tests.support.views import scratch_view  # noqa: E402


class _Kill(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        body = b"Manager exited"
        self.send_response(500)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def dumps(world: int, entries: int) -> dict[int, bytes]:
    job = FRJob(world, flavour="gloo")
    job.repeat(entries, [("0", "all_reduce", [[1024]])])
    return {r: json.dumps(d).encode() for r, d in job.dumps().items()}


def run(groups: int, per_group: int, entries: int, repeat: int, timeout_s: float) -> list[dict]:
    n = groups * per_group
    sim = SimRanks.start(n, groups)
    kill_srv = ThreadingHTTPServer(("127.0.0.1", 0), _Kill)
    threading.Thread(target=kill_srv.serve_forever, daemon=True).start()
    lh = Lighthouse(f"http://127.0.0.1:{kill_srv.server_address[1]}", 5.0)
    tmp = tempfile.TemporaryDirectory()
    store = Store(os.path.join(tmp.name, "state.sqlite"))
    cfg = MonitorConfig(state_path=os.path.join(tmp.name, "state.sqlite"), job="bench",
                        bundles=BundleConfig(timeout_s=timeout_s, total_bytes=1 << 40,
                                             max_bytes=1 << 30))
    bundles = Bundles(cfg, store)
    rows = []
    try:
        fr = dumps(n, entries)
        for r in sim.ranks:
            r.fr = fr[r.state["rank"]]
        view = scratch_view(time.time(), {r.url: RankView(r.url, True, dict(r.state))
                                         for r in sim.ranks})
        culprit_group = groups - 1
        culprits = [r.state["rank"] for r in sim.ranks
                    if r.state["replica_group"] == culprit_group]
        # the culprit group's own incarnation: ranks of another one are never asked
        finding = {"kind": "hang", "replica_group": culprit_group, "ranks": culprits,
                   "replica_id": sim.group(culprit_group)[0].state["replica_id"],
                   "evidence": {}}
        silent = {"no bundle": [], "healthy": [], "culprit silent": sim.group(culprit_group),
                  "all silent": sim.ranks}
        bundles.capture("evict", view, view, finding, None, None, [])  # warm the poller
        for scenario, quiet in silent.items():
            for r in quiet:
                r.set_mode("slow", delay=3600)
            times, sizes, complete = [], [], []
            for _ in range(repeat):
                t0 = time.perf_counter()
                got = None
                if scenario != "no bundle":
                    got = bundles.capture("evict", view, view, finding, None, {"id": 0}, [])
                lh.kill("replica")
                times.append(time.perf_counter() - t0)
                if got:
                    complete.append(got["ranks_complete"])
                    sizes.append(os.path.getsize(bundles.store.path(got["id"])))
            for r in quiet:
                r.set_mode("ok")
                r.drop_connections()
            rows.append({"ranks": n, "groups": groups, "entries": entries, "scenario": scenario,
                         "timeout_s": timeout_s, "repeat": repeat,
                         "decision_to_kill_s_median": round(statistics.median(times), 4),
                         "decision_to_kill_s_max": round(max(times), 4),
                         "ranks_complete": complete[-1] if complete else None,
                         "bundle_bytes": sizes[-1] if sizes else None,
                         "dump_bytes_per_rank": len(fr[0])})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        bundles.close()
        store.close()
        tmp.cleanup()
        kill_srv.shutdown()
        lh.close()
        sim.stop()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["3x2", "16x2"],
                   help="groups x ranks per group (%(default)s)")
    p.add_argument("--entries", type=int, default=2000, help="Flight Recorder entries per rank")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--timeout", type=float, default=BundleConfig().timeout_s,
                   help="--bundle-timeout (%(default)s)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    rows = []
    for shape in args.shapes:
        g, k = (int(x) for x in shape.split("x"))
        rows += run(g, k, args.entries, args.repeat, args.timeout)
    print("\n| ranks | scenario | decision to kill, median / max (s) | ranks complete | bundle |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        size = f"{r['bundle_bytes'] / 1e6:.2f} MB" if r["bundle_bytes"] else "-"
        print(f"| {r['ranks']} | {r['scenario']} | {r['decision_to_kill_s_median']:.3f} / "
              f"{r['decision_to_kill_s_max']:.3f} | {r['ranks_complete'] if r['ranks_complete'] is not None else '-'} "
              f"| {size} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["benchmarks/bench_bundles.py", *sys.argv[1:]]),
                       "loadavg": os.getloadavg(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
