"""torch's own debug server on a CUDA rank: what its handlers serve of NCCL's Flight Recorder,
and what the monitor's torch-only adapter reads of them (docs/gpu.md, section 3).

    python3 benchmarks/gpu/torch_debug_server_nccl.py OUT [--deps DIR]

One process, world size 1 (NCCL refuses two ranks on one GPU): the default group on
``cpu:gloo,cuda:nccl`` (it records in both recorders), an NCCL group and a gloo group, 4 steps of
an all_reduce on each; then an all_reduce on the NCCL group queued behind a ~6 s
``torch.cuda._sleep`` kernel. At each moment (``healthy``, ``inflight``) it saves what the rank's
``_WorkerServer`` answers: ``GET /handler/``, ``POST /handler/fr_trace_json`` and
``POST /handler/dump_nccl_trace_json``. When the checkout's monitor imports (``--deps``: a folder
of its dependencies for that Python, put on ``sys.path``), it also saves the rank state and dump the
monitor's ``TorchPoller`` and ``TorchRanks`` make of that rank, and the same with the NCCL
handler hidden (what the monitor saw before it read NCCL's recorder).

Writes ``OUT/summary.json`` and ``OUT/<moment>/<handler>`` (the bytes as served).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
import urllib.request
from pathlib import Path

ENV = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_BUFFER_SIZE": "2000",
       "TORCH_NCCL_ENABLE_TIMING": "1", "TORCH_NCCL_TRACE_CPP_STACK": "0"}
HANDLERS = ("fr_trace_json", "dump_nccl_trace_json")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, post: bool) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=b"" if post else None, method="POST" if post else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _save(base: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    status, body = _http(f"{base}/handler/", post=False)
    (out / "handler_list").write_bytes(body)
    row: dict = {"handlers": json.loads(body) if status == 200 else f"{status}: {body[:200]!r}"}
    for h in HANDLERS:
        status, body = _http(f"{base}/handler/{h}", post=True)
        (out / h).write_bytes(body)
        try:
            doc = json.loads(body)
            row[h] = {"status": status, "bytes": len(body), "entries": len(doc.get("entries", [])),
                      "groups": sorted({e["process_group"][0] for e in doc.get("entries", [])}),
                      "pg_status": doc.get("pg_status"),
                      "states": sorted({e.get("state") for e in doc.get("entries", [])})}
        except Exception as e:  # recorded as served
            row[h] = {"status": status, "bytes": len(body), "error": repr(e)[:300]}
    return row


def _monitor_view(url: str, hide_nccl: bool) -> dict:
    """The state and dump the checkout's monitor makes of the rank (its real poller)."""
    from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
    from monitor.evidence.torch_rank import TorchRanks
    from monitor.poll import torch_server
    from monitor.poll.torch_server import TorchIdentity, TorchPoller

    poller = TorchPoller(timeout_s=5, fr_timeout_s=30)
    try:
        if hide_nccl:
            torch_server.NCCL_FR_HANDLER = "not_asked"
        polls = poller.sweep([url])
    finally:
        torch_server.NCCL_FR_HANDLER = "dump_nccl_trace_json"
        poller.close()
    ranks = TorchRanks("gpu")
    rid = "replica_group_0:gpu"
    who = TorchIdentity(rid, 0, 0, 1, "127.0.0.1:0")
    lighthouse = LighthouseStatus(1, {rid: QuorumMember(rid, 4, "127.0.0.1:0", 1)}, {rid: 0.1})
    ranks.adapt(polls, {url: who}, lighthouse, time.time())
    p = polls[url]
    if not p.ok:
        return {"ok": False, "error": p.error}
    s = p.data
    dump = ranks.dumps.get(url) or {}
    return {"ok": True, "phase": s["phase"], "waiting": s["timing"]["waiting"],
            "flight_recorder": s["torch_only"]["flight_recorder"],
            "adapted_entries": len(dump.get("entries", [])),
            "adapted_groups": sorted({e["process_group"][0] for e in dump.get("entries", [])})}


def main() -> None:
    out = Path(sys.argv[1])
    if "--deps" in sys.argv:
        sys.path.insert(0, sys.argv[sys.argv.index("--deps") + 1])
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    os.environ.update(ENV)
    import torch
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                     "device": torch.cuda.get_device_name(0), "env": ENV, "moments": {}}
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1, device_id=dev)
    nccl_g = dist.new_group([0], backend="nccl", group_desc="nccl_tp")
    gloo_g = dist.new_group([0], backend="gloo", group_desc="gloo_dp")
    import torch.distributed.debug._handlers  # noqa: F401  (torch's Python handlers)
    server = c10d._WorkerServer("127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.port}"
    try:
        for _ in range(4):
            g = torch.ones(1024, device=dev)
            c = torch.ones(1024)
            dist.all_reduce(g)  # default group, NCCL backend
            dist.all_reduce(c)  # default group, gloo backend
            dist.all_reduce(g, group=nccl_g)
            dist.all_reduce(c, group=gloo_g)
        torch.cuda.synchronize()
        time.sleep(1.5)  # the watchdog marks entries completed when it polls
        summary["moments"]["healthy"] = _save(base, out / "healthy")
        torch.cuda._sleep(int(6 * 2e9))  # holds the stream ~6 s: the next all_reduce waits
        work = dist.all_reduce(torch.ones(4096, device=dev), group=nccl_g, async_op=True)
        time.sleep(1.5)
        row = summary["moments"]["inflight"] = _save(base, out / "inflight")
        row["completed_at_dump"] = bool(work.is_completed())
        for name, hide in (("monitor_now", False), ("monitor_before", True)):
            try:
                row[name] = _monitor_view(f"torch+{base}", hide)
            except Exception:
                row[name] = {"error": traceback.format_exc()[-1500:]}
        work.wait()
        torch.cuda.synchronize()
    finally:
        server.shutdown()
        dist.destroy_process_group()
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary, indent=1, default=str)[:6000])


if __name__ == "__main__":
    main()
