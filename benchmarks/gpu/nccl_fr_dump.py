"""Make real NCCL Flight Recorder dumps on one GPU (the fixture tests/fixtures/nccl-fr-h100/).

Usage (on a machine with a CUDA GPU; torch only, no lightkeeper imports)::

    python benchmarks/gpu/nccl_fr_dump.py OUTDIR            # all parts, ~40 s on an H100
    python benchmarks/gpu/nccl_fr_dump.py OUTDIR --cpu      # smoke run of the script on gloo/CPU

Parts, each in its own process (the Flight Recorder reads its environment at start-up):

1. ``job``: NCCL, world size 1 (one GPU), the default group and two subgroups, 4 steps of
   all_reduce, all_gather_into_tensor, all_gather (list), reduce_scatter_tensor, broadcast,
   all_to_all_single, a coalesced pair of all_reduces (``_coalescing_manager``) and a barrier;
   then ``_dump_nccl_trace`` (pickle) and ``_dump_nccl_trace_json`` -> ``rank0`` / ``rank0.json``.
   Then a collective that cannot start: a ``torch.cuda._sleep`` kernel holds the stream, an
   all_reduce is enqueued behind it, and the trace is dumped while it waits (full and
   ``onlyActive``) -> ``inflight-rank0`` / ``inflight-rank0.json`` / ``inflight-active-rank0.json``.
2. ``timeout``: the same stuck all_reduce in a group with a 4 s timeout and
   ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``: the watchdog times it out and writes the dump itself, as it
   does in production (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` prefix + rank) -> ``timeout-rank0``.
   The process is then torn down by torch (that is expected and reported).
3. ``two_ranks``: two processes, world size 2, both on GPU 0: NCCL refuses it (recorded, to say
   why the fixture has no cross-rank NCCL job).

Writes ``OUTDIR/summary.json`` with the torch/NCCL versions, env and what each part produced.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ENV = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_ENABLE_TIMING": "1",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_TRACE_CPP_STACK": "0",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
}


def _dump(c10d, cpu: bool, pickle_path: Path | None, json_path: Path | None, only_active=False):
    if pickle_path is not None:
        fn = c10d._dump_fr_trace if cpu else c10d._dump_nccl_trace
        try:
            data = fn(includeCollectives=True, includeStackTraces=True, onlyActive=only_active)
        except TypeError:
            data = fn()
        pickle_path.write_bytes(data)
    if json_path is not None:
        fn = c10d._dump_fr_trace_json if cpu else c10d._dump_nccl_trace_json
        try:
            data = fn(includeCollectives=True, onlyActive=only_active)
        except TypeError:
            data = fn()
        json_path.write_bytes(data if isinstance(data, bytes) else data.encode())


def part_job(out: Path, cpu: bool) -> dict:
    import torch
    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist

    dev = torch.device("cpu" if cpu else "cuda:0")
    if not cpu:
        torch.cuda.set_device(dev)
    store = dist.HashStore()
    dist.init_process_group("gloo" if cpu else "nccl", store=store, rank=0, world_size=1,
                            device_id=None if cpu else dev)
    tp = dist.new_group([0], group_desc="tp")
    dp = dist.new_group([0], group_desc="dp")
    t = torch.ones(1024, device=dev)
    h = torch.ones(256, 256, device=dev, dtype=torch.bfloat16)
    w = torch.randn(512, 512, device=dev)
    for _ in range(4):
        for _ in range(8):
            w = w @ w.T / 512  # some compute so durations are not all launch noise
        dist.all_reduce(t)
        out_t = torch.empty(1024, device=dev)
        dist.all_gather_into_tensor(out_t, t, group=tp)
        dist.all_gather([torch.empty(1024, device=dev)], t, group=tp)
        rs = torch.empty(1024, device=dev)
        dist.reduce_scatter_tensor(rs, t, group=tp)
        dist.broadcast(h, src=0, group=dp)
        a2a = torch.empty(1024, device=dev)
        dist.all_to_all_single(a2a, t, group=dp)
        a, b = torch.ones(64, device=dev), torch.ones(32, device=dev)  # coalesced: one dtype
        if not cpu:  # gloo does not implement coalescing
            with dist._coalescing_manager(group=dp, device=dev, async_ops=True) as cm:
                dist.all_reduce(a, group=dp)
                dist.all_reduce(b, group=dp)
            cm.wait()
        dist.barrier()
    if not cpu:
        torch.cuda.synchronize()
    time.sleep(1.5)  # let the watchdog see every entry complete (it polls, ~100 ms)
    _dump(c10d, cpu, out / "rank0", out / "rank0.json")
    result = {"steps": 4}
    if not cpu:
        # a collective enqueued behind a kernel that holds the stream for ~6 s: scheduled, not
        # started, while we dump
        torch.cuda._sleep(int(6 * 2e9))
        stuck = torch.ones(4096, device=dev)
        work = dist.all_reduce(stuck, group=tp, async_op=True)
        time.sleep(1.0)
        _dump(c10d, cpu, out / "inflight-rank0", out / "inflight-rank0.json")
        _dump(c10d, cpu, None, out / "inflight-active-rank0.json", only_active=True)
        result["inflight_completed_at_dump"] = bool(work.is_completed())
        work.wait()
        torch.cuda.synchronize()
    dist.destroy_process_group()
    return result


def part_timeout(out: Path, cpu: bool) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev,
                            timeout=datetime.timedelta(seconds=60))
    short = dist.new_group([0], timeout=datetime.timedelta(seconds=4), group_desc="short_timeout")
    t = torch.ones(1024, device=dev)
    for _ in range(3):
        dist.all_reduce(t)
        dist.all_reduce(t, group=short)
    torch.cuda.synchronize()
    time.sleep(0.5)
    torch.cuda._sleep(int(40 * 2e9))  # holds the stream well past the 4 s timeout
    dist.all_reduce(torch.ones(2048, device=dev), group=short, async_op=True)
    print("stuck all_reduce enqueued; waiting for the watchdog", flush=True)
    time.sleep(60)  # the watchdog dumps and tears the process down before this ends
    return {"survived": True}


def part_two_ranks(out: Path, rank: int, port: int) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=dev)
    t = torch.ones(16, device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return {"rank": rank, "all_reduce": t.tolist()[:1]}


def child(part: str, out: Path, cpu: bool, *extra: str) -> None:
    if part == "job":
        res = part_job(out, cpu)
    elif part == "timeout":
        res = part_timeout(out, cpu)
    else:
        res = part_two_ranks(out, int(extra[0]), int(extra[1]))
    print("RESULT " + json.dumps(res), flush=True)
    os._exit(0)


def run_child(args: list[str], env: dict, timeout: float) -> dict:
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, __file__, "--child", *args], env=env, timeout=timeout,
                           capture_output=True, text=True)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        rc = "timeout"
        text = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
    result = None
    for line in text.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
    return {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "result": result,
            "log_tail": text[-3000:]}


def main() -> None:
    if sys.argv[1] == "--child":
        child(sys.argv[2], Path(sys.argv[3]), sys.argv[4] == "cpu", *sys.argv[5:])
        return
    out = Path(sys.argv[1])
    cpu = "--cpu" in sys.argv
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **ENV, "PYTHONUNBUFFERED": "1"}
    mode = "cpu" if cpu else "gpu"
    summary: dict = {"env": ENV}
    import torch

    summary["torch"] = torch.__version__
    if not cpu:
        summary["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        summary["device"] = torch.cuda.get_device_name(0)
    summary["job"] = run_child(["job", str(out), mode], env, 120)
    if not cpu and "--job-only" not in sys.argv:
        tenv = {**env, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(out / "timeout-rank"),
                "TORCH_FR_DUMP_TEMP_FILE": str(out / "timeout-rank")}
        summary["timeout"] = run_child(["timeout", str(out), mode], tenv, 90)
        summary["timeout"]["files"] = sorted(p.name for p in out.glob("timeout-rank*"))
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, __file__, "--child", "two", str(out), mode,
                                   str(r), str(port)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        two = []
        for p in procs:
            try:
                text, _ = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                text, _ = p.communicate()
            two.append({"rc": p.returncode, "log_tail": text[-2500:]})
        summary["two_ranks_one_gpu"] = two
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: (v if k not in ("job", "timeout") else {kk: vv for kk, vv in v.items()
                                                                   if kk != "log_tail"})
                      for k, v in summary.items() if k != "two_ranks_one_gpu"}, indent=1))
    for name in sorted(p.name for p in out.iterdir()):
        print(name, (out / name).stat().st_size)


if __name__ == "__main__":
    main()
