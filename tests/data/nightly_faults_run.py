"""Each documented fault on a real 3 x 2 job, on one torchft; prints one JSON row per fault.

    .venv/bin/python tests/data/nightly_faults_run.py nightly|0.2.0 OUT_DIR [FAULT ...]

A real Lighthouse (the torchft's own, from that torchft's Python package), ``lightkeeper monitor``
evicting, 3 replica groups of 2 bare ranks (``lightkeeper train``) on hosts host-g0..g2 with
torchft-nightly first on PYTHONPATH or .venv's torchft 0.2.0; each fault is posted to group 1's
ranks (``POST /v1/faults``); a supervisor restarts the group from a warm spare on a fresh host
once none of its processes is left. Per fault: the finding (kind, ranks, hosts), the eviction
and its status, the seconds from the fault to the finding, to the eviction and to the restarted
group back in a 3-group quorum at pace. Makes benchmarks/results/torchft_nightly_faults.json.
"""
# ruff: noqa: B023 (every lambda below is waited on at once, in its own iteration)

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lightkeeper.cluster import Host, LocalCluster  # noqa: E402
from lightkeeper.processes import free_port, stop_process, wait_until  # noqa: E402

FAULT_TOKEN, EXIT_TOKEN, G = "nf-faults", "nf-exit", 1
FAULTS = {
    "straggler": "slow_compute:factor=4,rank=1",
    "hang_group": "hang:at_step={at},where=group,rank=1",
    "hang_cross": "hang:at_step={at},where=cross",
    "mismatch_group": "mismatch:at_step={at},where=group,rank=1",
    "dead_rank": "crash:at_step={at},rank=1",
    "straggler_cross": "slow:delay=0.5,rank=1",
    "hang_cross_rank1": "hang:at_step={at},where=cross,rank=1",
    "mismatch_cross": "mismatch:at_step={at},where=cross,rank=1",
}


def main() -> None:
    flavour, out = sys.argv[1], Path(sys.argv[2])
    faults = sys.argv[3:] or list(FAULTS)
    path = [str(ROOT)]
    if flavour == "nightly":
        path.insert(0, str(Path(sys.prefix) / "torchft-nightly"))
    os.environ["PYTHONPATH"] = os.pathsep.join(path)  # the Lighthouse and every rank
    mport = free_port()
    murl = f"http://127.0.0.1:{mport}"
    cl = LocalCluster(out / "cluster", num_groups=3, ranks_per_group=2, steps=100_000,
                      step_pause_s=0.25, pg_timeout_s=20, join_timeout_ms=2000,
                      heartbeat_timeout_ms=3000, launcher="bare",
                      extra_env={"LIGHTKEEPER_MONITOR": murl, "LIGHTKEEPER_FAULT_TOKEN": FAULT_TOKEN,
                                 "LIGHTKEEPER_EXIT_TOKEN": EXIT_TOKEN})
    mon = None
    stop = threading.Event()
    restarts: list[dict] = []
    hosts = iter(f"host-g{i}" for i in range(3, 20))

    def get(path):
        return requests.get(murl + path, timeout=5).json()

    def states(g):
        out = {}
        for r, u in list(cl.groups[g].worker_urls.items()):
            try:
                out[r] = requests.get(u + "/v1/state", timeout=1).json()
            except (requests.RequestException, ValueError):
                pass
        return out

    def in_quorum():
        ss = [s for g in range(3) for s in states(g).values()]
        return len(ss) == 6 and len({s["quorum_id"] for s in ss}) == 1 and all(
            s["num_participants"] == 3 and s["participating"] and s["commits"] > 0 for s in ss)

    def step(g):
        return max((s["step"] for s in states(g).values()), default=-1)

    def supervise():
        while not stop.wait(0.2):
            grp = cl.groups[G]
            if grp.alive():
                continue
            restarts.append({"at": time.time(),
                             "exit_codes": {r: p.returncode for r, p in grp.rank_procs.items()}})
            cl.start_group(G, host=Host(next(hosts)))
            cl.wait_for_workers(G, timeout=120)

    try:
        cl.start_lighthouse()
        with open(out / "monitor.log", "wb") as log:
            mon = subprocess.Popen(
                [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", str(mport),
                 "--lighthouse", cl.lighthouse_url, "--state", str(out / "m.sqlite"),
                 "--interval", "0.5", "--cooldown", "3", "--min-replicas", "2",
                 "--fr-interval", "2", "--rank-exit-token", EXIT_TOKEN, "--orphan-grace", "2",
                 "--starting-timeout", "120"], stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        cl.start_spare(G)
        wait_until(cl.spares[G].ready, 300, interval=0.5, what="spare")
        for g in range(3):
            cl.start_group(g, host=Host(f"host-g{g}"), use_spare=False)
        for g in range(3):
            cl.wait_for_workers(g, timeout=180)
        threading.Thread(target=supervise, daemon=True).start()
        wait_until(in_quorum, 240, interval=0.5, what="3-group quorum")
        for name in faults:
            if G not in cl.spares:
                cl.start_spare(G)
            wait_until(cl.spares[G].ready, 300, interval=0.5, what="spare")
            base = step(0)
            wait_until(lambda: in_quorum() and step(0) >= base + 12, 240, interval=0.5,
                       what="healthy steps")
            row = {"torchft": flavour, "fault": name}
            sts = states(G)
            rid = next(s["replica_id"] for s in sts.values())
            spec = FAULTS[name].format(at=step(G) + 3)
            row["spec"] = spec
            t0 = time.time()
            for u in cl.groups[G].worker_urls.values():
                requests.post(u + "/v1/faults", json={"spec": spec}, timeout=5,
                              headers={"Authorization": f"Bearer {FAULT_TOKEN}"})
            try:
                f = wait_until(lambda: next((f for f in get("/v1/findings")
                                             if f["confirmed_at"] >= t0), None),
                               90, interval=0.3, what="a finding")
                row.update(found=True, kind=f["kind"], replica_group=f["replica_group"],
                           faulted_incarnation=f["replica_id"] == rid, ranks=f["ranks"],
                           hosts=f["evidence"].get("culprit_hosts"),
                           level=f["evidence"].get("level"),
                           found_after_s=round(f["confirmed_at"] - t0, 1))
            except TimeoutError:
                row["found"] = False
            try:
                d = wait_until(lambda: next((d for d in get("/v1/evictions")
                                             if d["decision"] == "evict" and d["replica_id"] == rid
                                             and d["status"] in ("confirmed", "failed",
                                                                 "unconfirmed")), None),
                               60, interval=0.3, what="eviction")
                row.update(evicted=d["status"], evict_reason=d["reason"],
                           lighthouse_http=d["http_status"])
            except TimeoutError:
                row["evicted"] = False
                if any(s["replica_id"] == rid for s in states(G).values()):
                    cl.kill_group(G)  # end the faulted incarnation by hand, not its successor
            try:
                wait_until(lambda: any(r["at"] >= t0 for r in restarts), 90, interval=0.3,
                           what="restart")
                wait_until(lambda: in_quorum() and all(s["replica_id"] != rid
                                                       for s in states(G).values()), 180,
                           interval=0.5, what="back in quorum")
            except TimeoutError as e:  # e.g. a size mismatch on gloo aborts the peers too
                row["back_in_quorum_after_s"] = None
                row["not_back"] = str(e)
                row["dead_elsewhere"] = {g: cl.groups[g].alive_ranks() for g in range(3)}
                row["findings"] = [(f["kind"], f["replica_group"], f["ranks"])
                                   for f in get("/v1/findings") if f["confirmed_at"] >= t0]
                print(json.dumps(row), flush=True)
                break
            row["restarted_exit_codes"] = restarts[-1]["exit_codes"]
            row["heals"] = sorted(s["heals"] for s in states(G).values())
            row["back_in_quorum_after_s"] = round(time.time() - t0, 1)
            base = step(G)
            wait_until(lambda: step(G) >= base + 5, 120, interval=0.3, what="5 steps")
            row["five_steps_after_s"] = round(time.time() - t0, 1)
            later = [f for f in get("/v1/findings") if f["confirmed_at"] >= t0]
            row["findings"] = [(f["kind"], f["replica_group"], f["ranks"]) for f in later]
            print(json.dumps(row), flush=True)
        print(json.dumps({"goodput_incidents": get("/v1/goodput").get("incidents")}), flush=True)
    finally:
        stop.set()
        if mon is not None:
            stop_process(mon, grace=5)
        cl.stop()


if __name__ == "__main__":
    main()
