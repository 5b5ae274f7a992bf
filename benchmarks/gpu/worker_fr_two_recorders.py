"""A Lightkeeper rank on a GPU serves both Flight Recorders as one dump (docs/gpu.md, 5).

    python3 benchmarks/gpu/worker_fr_two_recorders.py OUT --deps DIR

One process: an NCCL default group of the rank alone (its all-reduces in NCCL's recorder) and
torchft's ProcessGroupGloo on CUDA tensors as its cross-group group (the generic recorder), as
TorchTitan runs torchft on GPUs by default, hooked by the WorkerServer's IncarnationTracker as
``WorkerServer.attach(manager)`` hooks it. ``--deps``: torchft and the WorkerServer's
dependencies for that Python (docs/gpu.md). Writes ``OUT/worker_fr_two_recorders.json``: what
``/v1/fr_trace`` serves (``fr_dump``), and of it what ``?pg=torchft`` keeps and the monitor's
analysis reads.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    out = Path(sys.argv[1])
    if "--deps" in sys.argv:
        sys.path.insert(0, sys.argv[sys.argv.index("--deps") + 1])
    sys.path.insert(0, str(ROOT))
    os.environ.update(TORCH_FR_BUFFER_SIZE="2000", TORCH_NCCL_ENABLE_TIMING="1")
    out.mkdir(parents=True, exist_ok=True)
    import torch
    import torch.distributed as dist
    from torchft.process_group import ProcessGroupGloo

    from monitor.analysis import normalize_dumps
    from worker_server.endpoints import filter_fr_dump
    from worker_server.flight_recorder import IncarnationTracker, fr_dump

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=dev)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo()
    tracker = IncarnationTracker(group_rank=0)
    record: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                    "hooked": tracker.hook(SimpleNamespace(_pg=pg))}
    pg.configure(f"127.0.0.1:{store.port}/gpu/1", "r0", 0, 1, quorum_id=4)
    for _ in range(3):
        g = torch.ones(1024, device=dev)
        dist.all_reduce(g)  # in-group: NCCL's recorder
        pg.allreduce([g], dist.AllreduceOptions()).wait()  # cross-group: gloo on CUDA
    torch.cuda.synchronize()
    body = fr_dump(tracker, {"rank": 0})
    doc = json.loads(body)
    ft = json.loads(filter_fr_dump(body, "torchft", None))["entries"]
    traces, errors = normalize_dumps({0: doc})
    record.update(
        entries=[(e["process_group"][0], e["profiling_name"], e["pg_id"], e["record_id"],
                  e["state"]) for e in doc["entries"]],
        incarnations=doc["incarnations"],
        torchft_entries=[(e["process_group"][0], e["profiling_name"], e["record_id"])
                         for e in ft],
        flavour=traces[0].flavour if 0 in traces else None, errors=errors,
        groups=sorted(k.pg for k in traces[0].groups) if 0 in traces else None)
    record["ok"] = bool(len(ft) == 3 and doc["incarnations"]
                        and doc["incarnations"][0]["pg_id"] is not None
                        and any(e[1].startswith("nccl:") for e in record["entries"]))
    (out / "worker_fr_two_recorders.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    dist.destroy_process_group()
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
