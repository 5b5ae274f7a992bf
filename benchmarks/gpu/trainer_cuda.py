"""``lightkeeper train`` on CUDA, watched by the monitor (docs/gpu.md, 6).

    python3 benchmarks/gpu/trainer_cuda.py OUT --deps DIR
    python3 benchmarks/gpu/trainer_cuda.py OUT --cpu      # the script's smoke run, CUDA hidden

A real Lighthouse, one replica group of one rank (NCCL refuses two ranks of one group on one
GPU) running the project's trainer: the model on the GPU, torchft's ProcessGroupNCCL across
groups, the WorkerServer on the rank; ``lightkeeper monitor`` given the rank and the Lighthouse.
``--deps``: a folder with torchft and the monitor's dependencies for that Python (docs/gpu.md).

Writes ``OUT/trainer_cuda.json``: what the rank served while it trained (its device, the clock its
waits were measured on, its step split, its Flight Recorder's collectives and whether they carry
GPU durations), the monitor's view of it, and how the job ended; the processes' logs beside it.
"""

from __future__ import annotations

import collections
import os
import subprocess
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
STEPS = 600  # a few seconds of training on an H100 (6-10 ms a step): time to read it


def main() -> int:
    out = Path(sys.argv[1])
    deps = sys.argv[sys.argv.index("--deps") + 1] if "--deps" in sys.argv else ""
    cpu = "--cpu" in sys.argv
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (deps, str(ROOT)) if p),
           "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_BUFFER_SIZE": "2000",
           "TORCH_NCCL_ENABLE_TIMING": "1", "RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    sys.path[:0] = [p for p in (deps, str(ROOT)) if p]
    from lightkeeper.cluster import LIGHTHOUSE_SCRIPT

    procs: list[subprocess.Popen] = []
    record: dict = {"steps": STEPS, "cpu_smoke": cpu}

    start = starter(procs, out, env)
    with recorded(procs, out / "trainer_cuda.json", record):
        lh = lighthouse(start, out, LIGHTHOUSE_SCRIPT, heartbeat_ms=3000)
        t0 = time.time()
        rank = start([sys.executable, "-u", "-m", "lightkeeper.cli", "train", "--replica-group",
                      "0", "--num-replica-groups", "1", "--lighthouse", lh, "--steps",
                      str(STEPS), "--job", "gpu"], "rank")
        url = worker_url(out / "rank.log")
        port = free_port()
        mon = f"http://127.0.0.1:{port}"
        start([sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", str(port),
               "--lighthouse", lh, "--targets", url, "--state",
               str(out / "monitor.sqlite"), "--interval", "0.5"], "monitor")
        until(lambda: get(mon + "/healthz"), 60, "the monitor to serve")

        def training():
            if rank.poll() is not None:
                raise RuntimeError(f"the rank exited ({rank.returncode}) before it was seen at "
                                   "step 20")
            s = get(url + "/v1/state")
            return s if (s.get("step") or 0) >= 20 and s["timing"]["window"] else None

        state = until(training, 240, "the rank at step 20")
        record["started_to_step_20_s"] = round(time.time() - t0, 1)
        t = state["timing"]
        record["rank"] = {"device": state.get("device"), "clock": t.get("clock"),
                          "step": state["step"], "window": t["window"],
                          "last_step": t["last_step"]}
        fr = get(url + "/v1/fr_trace")
        entries = fr.get("entries") or []
        ops = collections.Counter(str(e.get("profiling_name")) for e in entries)
        nccl = [e for e in entries if str(e.get("profiling_name")).startswith("nccl:")]
        record["fr_trace"] = {
            "entries": len(entries), "ops": dict(ops),
            "nccl_completed": sum(e.get("state") == "completed" for e in nccl),
            "nccl_with_duration": sum(isinstance(e.get("duration_ms"), (int, float))
                                      for e in nccl),
            "incarnations": [{k: i.get(k) for k in ("pg_id", "quorum_id", "global_ranks")}
                             for i in fr.get("incarnations") or []]}
        row = until(lambda: next((r for r in get(mon + "/v1/ranks") if r["url"] == url
                                  and (r.get("verification") or {}).get("state") == "verified"),
                                 None), 30, "the monitor to verify the rank")
        record["monitor"] = {"verification": row["verification"]["state"],
                             "phase": row.get("phase"), "step": row.get("step"),
                             "findings": [f["kind"] for f in get(mon + "/v1/findings")]}
        rc = until(lambda: rank.poll() is not None and [rank.returncode], 600,
                   "the rank to finish")[0]
        record["rank_exit"] = {"rc": rc, "after_s": round(time.time() - t0, 1)}
        # on the GPU the waits are timed on its clock (unless turned off), and they are not 0:
        # NCCL's all-reduce and the commit vote take time there too
        host = cpu or os.environ.get("LIGHTKEEPER_CUDA_TIMING", "").strip().lower() == "off"
        window = record["rank"]["window"]
        record["ok"] = (rc == 0 and record["monitor"]["verification"] == "verified"
                        and record["rank"]["clock"] == ("host" if host else "device")
                        and window["wait_cross_s"] > 0 and window["wait_group_s"] > 0
                        and (cpu or record["fr_trace"]["nccl_with_duration"] > 0))
    return 0 if record.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
