"""Cost of the goodput ledger (monitor/goodput/) per monitor sweep, and the size of what it saves.

Synthetic sweeps of N replica groups x R ranks (every group committing at a steady pace, one group
leaving the quorum at sweep 30 so capacity is being lost), one per simulated second, through a
real ``ClusterView``. Timed: ``GoodputLedger.update`` (the view built beforehand, as the monitor
builds it anyway), ``snapshot`` + ``json.dumps`` (what the store writes), and ``to_json``
(``GET /v1/goodput``). Medians over the last sweeps.

    .venv/bin/python benchmarks/bench_goodput_ledger.py [--groups 100,1000] [--ranks 8] \
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from monitor.evidence.view import RankView  # noqa: E402
from monitor.goodput import GoodputLedger  # noqa: E402
from tests.support.views import scratch_view  # noqa: E402

STEP_S = 0.2


def ranks_of(groups: int, per_group: int) -> dict[str, RankView]:
    out = {}
    for g in range(groups):
        for gr in range(per_group):
            url = f"http://10.0.{g // 250}.{g % 250}:{9000 + gr}"
            out[url] = RankView(url, True, {
                "replica_group": g, "rank": g * per_group + gr, "group_rank": gr,
                "group_world_size": per_group, "step": 0, "quorum_id": 1, "phase": "forward",
                "phase_since": 0.0, "participating": True, "replica_id": f"replica_group_{g}:a",
                "commits": 0, "faults_struck_at": {}})
    return out


def run(groups: int, per_group: int, sweeps: int = 60) -> dict[str, float]:
    ranks = ranks_of(groups, per_group)
    led = GoodputLedger()
    t, updates, saves, sizes = 1_700_000_000.0, [], [], []
    per_sweep = round(1.0 / STEP_S)
    for i in range(sweeps):
        t += 1.0
        for r in ranks.values():
            if i >= 30 and r.state["replica_group"] == 0:
                r.state["participating"] = False  # out of the quorum: capacity lost
                continue
            r.state["step"] += per_sweep
            r.state["commits"] += per_sweep
            r.state["last_step_at"] = t - 0.02  # the job's pace is dated from the commits
        # each sweep's answers are new objects, as polls are: the ledger reads a rank whose
        # RankView is the last sweep's as not asked this sweep (leader polling)
        fresh = {u: RankView(u, True, dict(r.state)) for u, r in ranks.items()}
        view = scratch_view(t, ranks=fresh)
        t0 = time.perf_counter()
        led.update(view, [], [], t)
        t1 = time.perf_counter()
        blob = json.dumps(led.snapshot())
        led.unsaved()
        led.saved()
        t2 = time.perf_counter()
        if i >= sweeps // 2:
            updates.append(t1 - t0)
            saves.append(t2 - t1)
            sizes.append(len(blob))
    t3 = time.perf_counter()
    api = json.dumps(led.to_json())
    t4 = time.perf_counter()
    return {"update_ms": statistics.median(updates) * 1e3,
            "save_ms": statistics.median(saves) * 1e3, "state_kib": sizes[-1] / 1024,
            "api_ms": (t4 - t3) * 1e3, "api_kib": len(api) / 1024,
            "paced": led.baseline is not None,  # else every sweep was startup or pending
            # a steady job: none (its commits read as progress), else the figures are of that
            "pending_s": led.to_json()["job"]["pending_seconds"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", default="100,1000", help="comma-separated group counts")
    p.add_argument("--ranks", type=int, default=8, help="ranks per group (8)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    out = {"what": "goodput ledger cost per sweep and saved sizes (synthetic sweeps)",
           "command": " ".join(["benchmarks/bench_goodput_ledger.py", *sys.argv[1:]]),
           "load_average": os.getloadavg(), "rows": []}
    print("| groups x ranks | update / sweep | snapshot + json | saved state | GET /v1/goodput |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in (int(x) for x in args.groups.split(",")):
        r = run(n, args.ranks)
        out["rows"].append({"groups": n, "ranks": args.ranks, **r})
        print(f"| {n} x {args.ranks} | {r['update_ms']:.1f} ms | {r['save_ms']:.1f} ms | "
              f"{r['state_kib']:.0f} KiB | {r['api_ms']:.1f} ms, {r['api_kib']:.0f} KiB |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
