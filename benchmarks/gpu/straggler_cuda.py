"""A straggler on CUDA, found and evicted by the monitor (docs/gpu.md, 7).

    python3 benchmarks/gpu/straggler_cuda.py OUT --deps DIR
    python3 benchmarks/gpu/straggler_cuda.py OUT --cpu      # the script's smoke run, CUDA hidden
    python3 benchmarks/gpu/straggler_cuda.py OUT --deps DIR --delay 0.02   # near the floor

A real Lighthouse and two replica groups of one rank each, both on the one GPU, running
``lightkeeper train --cross-group gloo`` (torchft's ProcessGroupGloo on CUDA tensors across
groups, as TorchTitan runs it: two ranks of one NCCL group cannot share a GPU), and
``lightkeeper monitor`` given both ranks and the Lighthouse, evicting. Once the monitor has
verified both ranks and they train together, group 1 is told (``POST /v1/faults``) to compute
``--delay`` seconds (0.3) slower a step (``slow_compute``: on CUDA its GPU spins that long, its
host does not wait; a throttled GPU). ``LIGHTKEEPER_CUDA_TIMING=off`` runs it with the ranks'
waits on the host clock (the monitor is then only checked never to evict the healthy group).
The straggler's floor is ``FLOOR`` (the monitor's ``--straggler-min-lag``) or the median
group's own work a step (its step outside the cross-group wait) when shorter: a delay of twice
that is expected evicted, one under it reported (``job_slow`` naming group 1 as the late one),
one between either.

Writes ``OUT/straggler_cuda.json``: each rank's clock and waits before and during the fault,
the finding (kind, group, lag), the eviction, group 1's end, and group 0's pace sampled from its
``/v1/state``: healthy, and the recovery (fault onset -> back at >= 90 % of healthy pace).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

from jobkit import (  # beside this script
    free_port,
    get,
    lighthouse,
    recorded,
    starter,
    until,
    worker_url,
)

ROOT = Path(__file__).resolve().parents[2]
FLOOR = 0.1  # the monitor's --straggler-min-lag (its default)
TOKEN = "gpu-straggler"
WAIT_EVICTION_S = 40  # from the fault's onset; the monitor needs 12 slow steps (~3 s)


def main() -> int:
    out = Path(sys.argv[1])
    deps = sys.argv[sys.argv.index("--deps") + 1] if "--deps" in sys.argv else ""
    cpu = "--cpu" in sys.argv
    # 0.3: three times the floor, as a GPU shared with the other group measures the spin low
    delay = float(sys.argv[sys.argv.index("--delay") + 1]) if "--delay" in sys.argv else 0.3
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update({"PYTHONPATH": os.pathsep.join(p for p in (deps, str(ROOT)) if p),
                "TORCH_FR_BUFFER_SIZE": "2000", "RANK": "0", "WORLD_SIZE": "1",
                "LIGHTKEEPER_FAULT_TOKEN": TOKEN})
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    sys.path[:0] = [p for p in (deps, str(ROOT)) if p]
    import numpy as np

    from lightkeeper.cluster import LIGHTHOUSE_SCRIPT
    from monitor.detect.straggler import lag_floor

    procs = []
    record: dict = {"delay_s": delay, "cpu_smoke": cpu}

    start = starter(procs, out, env)
    with recorded(procs, out / "straggler_cuda.json", record):
        # min_replicas 1: group 0 trains on alone once group 1 is evicted
        lh = lighthouse(start, out, LIGHTHOUSE_SCRIPT)
        ranks = []
        for g in (0, 1):
            ranks.append(start([sys.executable, "-u", "-m", "lightkeeper.cli", "train",
                                "--replica-group", str(g), "--num-replica-groups", "2",
                                "--cross-group", "gloo", "--lighthouse", lh,
                                "--steps", "1000000", "--job", "gpu", "--pg-timeout", "10",
                                "--quorum-timeout", "10"], f"rank{g}"))
        urls = [worker_url(out / f"rank{g}.log") for g in (0, 1)]
        port = free_port()
        mon = f"http://127.0.0.1:{port}"
        start([sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", str(port),
               "--lighthouse", lh, "--targets", ",".join(urls), "--state",
               str(out / "monitor.sqlite"), "--interval", "0.5", "--min-replicas", "1"],
              "monitor")
        until(lambda: get(mon + "/healthz"), 60, "the monitor to serve")

        def together():
            for p in ranks:
                if p.poll() is not None:
                    raise RuntimeError(f"a rank exited ({p.returncode}) before the fault")
            states = [get(u + "/v1/state") for u in urls]
            rows = get(mon + "/v1/ranks")
            verified = sum((r.get("verification") or {}).get("state") == "verified"
                           for r in rows)
            ok = verified == 2 and all(s.get("num_participants") == 2 and (s.get("step") or 0) >= 50
                                       and s["timing"]["window"] for s in states)
            return states if ok else None

        before = until(together, 300, "both groups verified and training together")
        record["before"] = [_timing(s) for s in before]

        # group 0's pace, sampled from its /v1/state from here to the end
        pace: list[tuple[float, int]] = []

        def sample():
            s = get(urls[0] + "/v1/state")
            pace.append((time.time(), int(s.get("step") or 0)))

        def sample_for(seconds: float) -> None:
            end = time.time() + seconds
            while time.time() < end:
                sample()
                time.sleep(0.1)

        sample_for(4)  # healthy, both groups
        onset_step = int(get(urls[1] + "/v1/state")["step"]) + 5
        spec = f"slow_compute:delay={delay},from_step={onset_step}"
        r = get(urls[1] + "/v1/faults", body={"spec": spec}, token=TOKEN)
        record["fault"] = {"spec": spec, "answer": r}

        def struck():
            sample()
            return get(urls[1] + "/v1/state").get("faults_struck_at", {}).get(spec)

        onset = until(struck, 60, "the fault to strike on group 1")

        last: dict[int, dict] = {}  # each rank's last /v1/state while both trained

        def evicted():
            sample()
            for g, u in enumerate(urls):
                if ranks[g].poll() is None:
                    last[g] = get(u + "/v1/state")
            d = get(mon + "/v1/evictions?decision=evict")
            return d if d and ranks[1].poll() is not None else None

        try:
            until(evicted, WAIT_EVICTION_S, "group 1 evicted and gone")
        except TimeoutError:  # on the host clock a GPU-side straggler may go unseen
            record["not_evicted_within_s"] = WAIT_EVICTION_S
        # both ranks' split in the steps group 1 was slow, before the eviction
        record["during"] = [_slow_steps(last.get(g, {}), onset_step) for g in (0, 1)]
        sample_for(10)  # group 0 alone, after the eviction
        findings = get(mon + "/v1/findings")
        record["findings"] = [(f["kind"], f["replica_group"]) for f in findings]
        record["job_slow"] = [{k: (f.get("evidence") or {}).get(k) for k in
                               ("summary", "host_clock_cuda_ranks", "late_group")}
                              for f in findings if f["kind"] == "job_slow"]
        [f] = [f for f in findings if f["kind"] == "straggler"][:1] or [None]
        evictions = get(mon + "/v1/evictions?decision=evict")
        [d] = evictions[:1] or [None]
        record["finding"] = f and {k: f.get(k) for k in ("kind", "replica_group", "ranks",
                                                         "first_seen", "confirmed_at")} | {
            "median_lag_s": (f.get("evidence") or {}).get("median_lag_s")}
        record["eviction"] = d and {k: d.get(k) for k in ("at", "replica_group", "reason",
                                                          "status", "source", "confirmed_at")}
        record["group1_exit_rc"] = ranks[1].returncode
        # how the evicted rank ended (on CUDA by a signal, on CPU exit code 1: docs/gpu.md, 7)
        record["group1_log_tail"] = (out / "rank1.log").read_text(errors="replace") \
            .splitlines()[-12:]
        record["pace"] = _pace(pace, onset)
        if onset and f:
            record["onset_to_confirmed_s"] = round(f["confirmed_at"] - onset, 2)
        if onset and d:
            record["onset_to_evicted_s"] = round(d["at"] - onset, 2)
        host = cpu or os.environ.get("LIGHTKEEPER_CUDA_TIMING", "").strip().lower() == "off"
        dur = record["during"]
        # the healthy rank waits most of the fault's time across groups, the slow one does not
        record["waits_name_group_1"] = bool(
            dur[0]["steps"] and dur[1]["steps"]
            and dur[0]["wait_cross_s"] > 0.3 * delay > dur[1]["wait_cross_s"])
        # right: group 1 named and evicted, group 0 training on; under the floor, reported as
        # job_slow naming group 1 late (the spin measures low on a shared GPU: twice the
        # floor). Never: group 0 evicted. The host clock is not asked to see a GPU-side
        # straggler (docs/gpu.md, 2): recorded only.
        evicted_right = bool(f and f["replica_group"] == 1 and d and d["replica_group"] == 1
                             and ranks[0].poll() is None
                             and record["pace"].get("recovered_s") is not None)
        slow = [j for j in findings if j["kind"] == "job_slow"]
        reported_right = bool(slow and (slow[0].get("evidence") or {}).get("late_group") == 1)
        # the monitor's own rule, on each group's healthy window (one rank a group)
        floor = lag_floor(FLOOR, np.array([[(b["step_s"] or 0.0) - (b["wait_cross_s"] or 0.0)]
                                           for b in record["before"]]))
        record["expected"] = "evict" if delay >= 2 * floor else (
            "report" if delay < floor else "either")
        right = {"evict": evicted_right, "report": reported_right}.get(
            record["expected"], evicted_right or reported_right)
        record["right"] = right
        record["wrong_evictions"] = [e["replica_group"] for e in evictions
                                     if e["replica_group"] != 1]
        record["ok"] = bool(
            not record["wrong_evictions"] and (host or right and record["waits_name_group_1"])
            and all(b["clock"] == ("host" if host else "device") for b in record["before"]))
    return 0 if record.get("ok") else 1


def _timing(state: dict) -> dict:
    t = state.get("timing") or {}
    w = t.get("window") or {}
    return {"group": state.get("replica_group"), "step": state.get("step"),
            "device": (state.get("device") or {}).get("type"), "clock": t.get("clock"),
            **{k: w.get(k) for k in ("step_s", "compute_s", "wait_cross_s", "wait_group_s")}}


def _slow_steps(state: dict, from_step: int) -> dict:
    """Medians of the rank's timed steps from ``from_step`` on (its ``timing.recent``)."""
    rows = [r for r in (state.get("timing") or {}).get("recent") or [] if r["step"] >= from_step]
    out: dict = {"group": state.get("replica_group"), "steps": len(rows)}
    for k in ("step_s", "compute_s", "wait_cross_s", "wait_group_s"):
        out[k] = statistics.median(r[k] for r in rows) if rows else None
    return out


def _pace(samples: list[tuple[float, int]], onset: float | None) -> dict:
    """Healthy steps/s (before ``onset``) and the first time after it that a 1 s window of
    group 0's steps is back at >= 90 % of that."""
    if not samples or onset is None:
        return {"samples": len(samples)}
    pre = [s for s in samples if s[0] < onset]
    healthy = (pre[-1][1] - pre[0][1]) / (pre[-1][0] - pre[0][0]) if len(pre) > 1 else None
    out = {"samples": len(samples), "healthy_steps_per_s": healthy and round(healthy, 1),
           "recovered_s": None}
    post = [s for s in samples if s[0] >= onset]
    for i, (t, step) in enumerate(post):
        j = next((j for j in range(i, len(post)) if post[j][0] >= t + 1.0), None)
        if j is None:
            break
        rate = (post[j][1] - step) / (post[j][0] - t)
        if healthy and rate >= 0.9 * healthy:
            out["recovered_s"] = round(t - onset, 2)
            out["pace_after_steps_per_s"] = round(rate, 1)
            break
    return out


if __name__ == "__main__":
    sys.exit(main())
