"""tests/test_torch_debug_server_e2e.py on a GPU: a torchft job on CUDA watched only through
torch's own debug server, a group hung before its cross-group all-reduce (docs/gpu.md, 4).

    python3 benchmarks/gpu/torch_only_e2e.py OUT --deps DIR
    python3 benchmarks/gpu/torch_only_e2e.py OUT --cpu    # the script's smoke run, on gloo alone

A real Lighthouse and two replica groups of one rank each on the one GPU
(tests/fixtures/torch_debug_server_job.py with ``JOB_DEVICE=cuda``: torchft's ProcessGroupGloo on
CUDA tensors across groups, an NCCL group of the rank alone in-group, ``start_debug_server()``,
no Lightkeeper code); group 1 stops at step ``HANG_AT`` before its all-reduce. ``lightkeeper
monitor --torch-stores`` as its own process, with the Lighthouse only. ``--deps``: a folder with
torchft and the monitor's dependencies for that Python (docs/gpu.md), put on ``PYTHONPATH``.

Writes ``OUT/torch_only_e2e.json``: what each rank's server listed and how many entries each
recorder held while healthy, the monitor's view of both ranks, the hang finding, the eviction,
the seconds from the hang to each, and the eviction's incident bundle (each rank's stacks and
dump, read by ``lightkeeper analyze``); the processes' logs beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from jobkit import free_port, get, lighthouse, recorded, starter, until  # beside this script

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "fixtures" / "torch_debug_server_job.py"
HANG_AT = 12








def bundle(mon: str, bid: str | None, out: Path, env: dict) -> dict:
    """The eviction's incident bundle: what each rank's row says, each dump's entries by
    recorder (NCCL's are ``nccl:`` ops), and whether ``lightkeeper analyze`` names rank 1."""
    import tarfile

    if not bid:
        return {"id": None, "agrees": False}
    path = out / "bundle.tar.gz"
    with urllib.request.urlopen(f"{mon}/v1/incidents/{bid}/bundle", timeout=10) as r:
        path.write_bytes(r.read())
    with tarfile.open(path) as tar:
        files = {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar if m.isfile()}
    manifest = json.loads(files["manifest.json"])
    dumps = {}
    for name, data in files.items():
        if name.startswith("fr/"):
            ops = [str(e.get("profiling_name")) for e in json.loads(data).get("entries", [])]
            dumps[name] = {"entries": len(ops), "nccl": sum(o.startswith("nccl:") for o in ops)}
    analyze = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "analyze", "--format",
                              "json", str(path)], capture_output=True, text=True, env=env,
                             cwd=ROOT, timeout=120)
    try:
        [b] = json.loads(analyze.stdout)["bundles"]
    except (ValueError, KeyError, TypeError):
        b = {"error": (analyze.stdout + analyze.stderr)[-2000:]}
    return {"id": bid, "ranks": [{k: r.get(k) for k in ("rank", "role", "torch_only", "stacks",
                                                        "fr_trace")} for r in manifest["ranks"]],
            "files": sorted(files), "dumps": dumps, "analyze": b,
            "agrees": b.get("culprit_ranks") == [1] and b.get("analysis_agrees") is True}


def main() -> int:
    out = Path(sys.argv[1])
    deps = sys.argv[sys.argv.index("--deps") + 1] if "--deps" in sys.argv else ""
    device = "cpu" if "--cpu" in sys.argv else "cuda:0"
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (deps, str(ROOT)) if p),
           "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
           "TORCH_NCCL_ENABLE_TIMING": "1"}
    sys.path[:0] = [p for p in (deps, str(ROOT)) if p]
    from lightkeeper.cluster import LIGHTHOUSE_SCRIPT

    procs: list[subprocess.Popen] = []
    record: dict = {"hang_at_step": HANG_AT, "device": device}

    start = starter(procs, out, env)
    with recorded(procs, out / "torch_only_e2e.json", record):
        # min_replicas 2: the groups start training together (CUDA starts one process seconds
        # before the other, which would reach HANG_AT alone)
        lh = lighthouse(start, out, LIGHTHOUSE_SCRIPT, min_replicas=2, heartbeat_ms=3000)
        ranks = [start([sys.executable, "-u", str(JOB)], f"group{g}", {
            "REPLICA_GROUP_ID": str(g), "RANK": "0", "WORLD_SIZE": "1", "JOB_DEVICE": device,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "DEBUG_FRONTEND_PORT": str(free_port()), "TORCHFT_LIGHTHOUSE": lh,
            "HANG_AT_STEP": str(HANG_AT if g == 1 else -1)}) for g in range(2)]
        port = free_port()
        mon = f"http://127.0.0.1:{port}"
        start([sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", str(port),
               "--lighthouse", lh, "--torch-stores", "--state",
               str(out / "monitor.sqlite"), "--interval", "0.5", "--hang-floor", "2",
               "--min-replicas", "1", "--cooldown", "5"], "monitor")
        until(lambda: get(mon + "/healthz"), 60, "the monitor to serve")

        def both_ranks():
            rows = [r for r in get(mon + "/v1/ranks") if r["url"].startswith("torch+")]
            return rows if len(rows) == 2 and all(r.get("torch_only") for r in rows) else None

        rows = until(both_ranks, 120, "both ranks read through torch's server")
        record["ranks_first_seen"] = [{k: r.get(k) for k in ("url", "rank", "torch_only",
                                                               "verification")} for r in rows]
        for r in rows:  # what each recorder holds, straight from the rank's server
            base = r["url"].removeprefix("torch+")
            counts = {}
            for h in ("fr_trace_json", "dump_nccl_trace_json"):
                try:
                    doc = get(f"{base}/handler/{h}", post=True)
                except urllib.error.HTTPError as e:  # a CPU build has no NCCL handler
                    doc = f"HTTP {e.code}"
                counts[h] = len(doc.get("entries", [])) if isinstance(doc, dict) else doc[:200]
            r["recorders"] = counts
            record.setdefault("recorders", {})[str(r["rank"])] = counts

        hung_at = until(lambda: "hanging at step" in (out / "group1.log").read_text()
                        and time.time(), 180, "group 1 to hang")
        record["hung_at"] = hung_at

        def hang():
            found = [f for f in get(mon + "/v1/findings") if f["kind"] == "hang"]
            return found[0] if found else None

        finding = until(hang, 90, "the hang finding")
        record["hang_found_after_s"] = round(time.time() - hung_at, 2)
        ev = finding["evidence"]
        record["finding"] = {k: finding.get(k) for k in ("replica_group", "ranks", "replica_id")}
        record["finding"]["evidence"] = {k: ev.get(k) for k in ("level", "waiting_ranks",
                                                                 "waits")}
        record["finding"]["culprit_stacks_seen"] = 'torch_debug_server_job.py", line' in (
            ev.get("culprits") or [{}])[0].get("stacks_text", "")

        def evicted():
            done = [d for d in get(mon + "/v1/evictions")
                    if d["decision"] == "evict" and d["replica_group"] == 1]
            return done[0] if done else None

        decision = until(evicted, 60, "group 1 evicted")
        record["evicted_after_s"] = round(time.time() - hung_at, 2)
        record["eviction"] = {k: decision.get(k) for k in ("replica_group", "replica_id",
                                                             "reason", "status")}
        until(lambda: ranks[1].poll() is not None, 30, "group 1 to exit")
        record["group1_exited_after_s"] = round(time.time() - hung_at, 2)
        record["group0_alive"] = ranks[0].poll() is None
        record["bundle"] = bundle(mon, decision.get("bundle"), out, env)
        record["ok"] = (finding["replica_group"] == 1 and finding["ranks"] == [1]
                        and record["group0_alive"] and record["bundle"]["agrees"])
    return 0 if record.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
