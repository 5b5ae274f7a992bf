"""Does a rank's per-step compute/wait split (worker_server/timing.py) still name the slow rank
when its work runs on a GPU? Measured side by side, in one run, on one GPU.

Usage::

    python benchmarks/gpu/cuda_step_timing.py OUTDIR             # on a CUDA machine, ~1-2 min
    python benchmarks/gpu/cuda_step_timing.py OUTDIR --cpu       # smoke run on gloo/CPU
    python benchmarks/gpu/cuda_step_timing.py OUTDIR --scenarios=gloo_sleep,nccl1_sleep

Needs torch only: ``worker_server/timing.py`` is loaded by file path (no Flask, no torchft).

Scenarios (two processes on the same GPU; rank 1 does ``--slow`` times rank 0's GPU work):

- ``gloo``: the step's cross collective is a gloo all_reduce of CUDA tensors (gloo copies them to
  the host, so the host blocks until its own GPU work is done and the peer has sent), then a
  torchft-like commit: ``current_stream().synchronize()`` and a CPU barrier (the vote).
- ``gloo_sleep``, ``nccl1_sleep``: the same, but the slow rank launches the same kernels as
  its peer plus one ``torch.cuda._sleep`` of about 30 ms: slower on the GPU only, as a throttled
  or slower GPU is, with no extra host work to give it away;
- ``nccl1``: the gradient all_reduce is NCCL in a group of world size 1 per process (NCCL refuses
  two ranks on one GPU), so it only makes the stream wait; the ranks meet in the commit (stream
  synchronize, then the CPU barrier), as torchft's ``should_commit`` does on NCCL.

Each process alternates blocks of steps between timer modes, new timers per block:

- ``host``: ``StepTimer(device=False)``, host clock only (timing.py before the CUDA fix);
- ``device``: ``StepTimer()`` with ``LIGHTKEEPER_CUDA_TIMING`` unset: CUDA events once CUDA is
  initialized (the fix);
- ``sync``: host clock, the loop synchronizes the stream before every timed wait (the
  alternative the fix was weighed against);
- ``none``: no timer (the overhead reference).

A third scenario, ``overhead``, is one process with a launch-bound step (small layers, 10 timed
waits a step on NCCL world size 1) and the four modes interleaved: ms per step for each.

Writes ``OUTDIR/cuda_step_timing.json`` and prints a table: per scenario, mode and rank, the
median ``step_s``, ``compute_s``, ``wait_cross_s``, ``wait_group_s``, and whether the slow rank
is the one with the shorter total wait (what the monitor's straggler rule relies on).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODES = ("host", "device", "sync", "none")


def load_timing():
    spec = importlib.util.spec_from_file_location("lk_timing", REPO / "worker_server" / "timing.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["lk_timing"] = mod
    spec.loader.exec_module(mod)
    return mod


class NoTimer:
    clock = "none"

    class _Null:
        def __enter__(self):
            return None

        def __exit__(self, *exc):
            return None

    _null = _Null()

    def begin_step(self):
        pass

    def waiting(self, scope):
        return self._null

    def end_step(self, step):
        return None


class SyncTimer:
    """Host timing that first waits for the stream before every timed wait."""

    def __init__(self, timer, torch):
        self.timer, self.torch, self.clock = timer, torch, "sync"

    def begin_step(self):
        self.timer.begin_step()

    def waiting(self, scope):
        self.torch.cuda.current_stream().synchronize()
        return self.timer.waiting(scope)

    def end_step(self, step):
        return self.timer.end_step(step)

    def snapshot(self):
        return self.timer.snapshot()


def make_timer(mode, timing, torch, cpu):
    if mode == "none":
        return NoTimer()
    if mode == "host":
        return timing.StepTimer(window=100000, device=False)
    if mode == "device":
        return timing.StepTimer(window=100000)
    if cpu:
        return timing.StepTimer(window=100000, device=False)
    return SyncTimer(timing.StepTimer(window=100000, device=False), torch)


def worker(name: str, rank: int, world: int, port: int, out: Path, cpu: bool, steps: int,
           blocks: int, slow: int) -> None:
    os.environ.pop("LIGHTKEEPER_CUDA_TIMING", None)
    scenario, _, kind = name.partition("_")
    import torch
    import torch.distributed as dist

    timing = load_timing()
    dev = torch.device("cpu" if cpu else "cuda:0")
    if not cpu:
        torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=world and rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    cpu_group = dist.new_group(backend="gloo")  # the commit vote
    own = None
    if scenario in ("nccl1", "overhead") and not cpu:
        groups = [dist.new_group([r], backend="nccl") for r in range(world)]
        own = groups[rank]
    torch.manual_seed(0)
    if scenario == "overhead":
        width, batch, layers = 1024, 64, 8
    else:
        width, batch, layers = (128, 32, 4) if cpu else (4096, 8192, 4)
    dtype = torch.float32 if cpu else torch.bfloat16
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, dtype=dtype) for _ in range(layers)]).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(batch, width, device=dev, dtype=dtype)
    micro = (slow if rank == 1 else 1) if scenario != "overhead" and kind != "sleep" else 1
    # "_sleep": the slow rank launches the same kernels plus one that only takes GPU time
    # (a slower GPU, not more launches): about 30 ms at the H100's clock
    sleep_cycles = int(0.03 * 1.98e9) if kind == "sleep" and rank == 1 and not cpu else 0
    vote = torch.zeros(1)
    small = [torch.ones(256, device=dev) for _ in range(layers)]

    def step(timer, n):
        timer.begin_step()
        for _ in range(2 * micro):  # forward + backward, "micro-batches"
            loss = model(x).float().pow(2).mean()
            loss.backward()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        if scenario == "overhead":
            for t in small:  # per-layer in-group collectives, as FSDP issues them
                with timer.waiting("group"):
                    dist.all_reduce(t, group=own)
        flat = torch.cat([p.grad.flatten()[: 1 << 18].float() for p in model.parameters()
                          if p.grad is not None])
        with timer.waiting("cross"):
            if scenario == "gloo" or cpu:
                dist.all_reduce(flat)  # gloo on CUDA tensors: blocks the host
            else:
                dist.all_reduce(flat, group=own)  # NCCL: the stream waits, the host goes on
        with timer.waiting("group"):  # should_commit
            if not cpu:
                torch.cuda.current_stream().synchronize()
            if scenario != "overhead":
                dist.all_reduce(vote, group=cpu_group)
        timer.end_step(n)
        opt.step()
        opt.zero_grad(set_to_none=False)

    # warm up (CUDA init, NCCL/gloo connections, kernels)
    for n in range(3):
        step(NoTimer(), n)
    if not cpu:
        torch.cuda.synchronize()
    results: dict[str, list] = {m: [] for m in MODES}
    wall: dict[str, list] = {m: [] for m in MODES}
    clocks: dict[str, set] = {m: set() for m in MODES}
    n = 0
    for b in range(blocks):
        order = MODES if b % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            dist.barrier(group=cpu_group)
            timer = make_timer(mode, timing, torch, cpu)
            if not cpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(timer, n)
                n += 1
            if not cpu:
                torch.cuda.synchronize()
            wall[mode].append((time.perf_counter() - t0) / steps)
            clocks[mode].add(timer.clock)
            if mode != "none":
                results[mode].extend(timer.snapshot()["recent"])
    res = {"rank": rank, "scenario": name, "micro": micro, "gpu_sleep_cycles": sleep_cycles, "results": results,
           "wall_s_per_step": wall, "clock": {m: sorted(c) for m, c in clocks.items()}}
    (out / f"{name}-rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_scenario(scenario, out, cpu, steps, blocks, slow) -> list[dict]:
    world = 1 if scenario == "overhead" else 2
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LIGHTKEEPER_CUDA_TIMING", None)
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", scenario, str(r), str(world),
                               str(port), str(out), "cpu" if cpu else "gpu", str(steps),
                               str(blocks), str(slow)], env=env) for r in range(world)]
    deadline = time.monotonic() + 400
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [json.loads((out / f"{scenario}-rank{r}.json").read_text())
            for r in range(world) if (out / f"{scenario}-rank{r}.json").exists()]


def med(rows, key):
    return statistics.median(r[key] for r in rows) if rows else float("nan")


def summarize(scenario, ranks) -> dict:
    summary: dict = {}
    for mode in MODES:
        per = {}
        for r in ranks:
            rows = r["results"][mode]
            per[r["rank"]] = {
                "micro": r["micro"],
                "clock": r["clock"][mode],
                "wall_ms_per_step": 1e3 * statistics.median(r["wall_s_per_step"][mode]),
                **{k: med(rows, k) for k in ("step_s", "compute_s", "wait_cross_s", "wait_group_s")},
            }
            per[r["rank"]]["wait_s"] = per[r["rank"]]["wait_cross_s"] + per[r["rank"]]["wait_group_s"]
        entry = {"ranks": per}
        if len(ranks) == 2 and mode != "none":
            by_step = [{row["step"]: row for row in r["results"][mode]} for r in sorted(ranks, key=lambda r: r["rank"])]
            common = sorted(set(by_step[0]) & set(by_step[1]))

            def wait(row):
                return row["wait_cross_s"] + row["wait_group_s"]

            slow_shorter = sum(wait(by_step[1][s]) < wait(by_step[0][s]) for s in common)
            entry["steps_compared"] = len(common)
            entry["steps_slow_rank_waits_less"] = slow_shorter
            entry["slow_rank_named"] = per[1]["wait_s"] < per[0]["wait_s"]
        summary[mode] = entry
    return summary


def print_table(scenario, summary):
    print(f"\n== {scenario} ==")
    print(f"{'mode':7} {'rank':>4} {'work':>4} {'clock':>7} {'ms/step':>8} {'step_s':>8} "
          f"{'compute':>8} {'w_cross':>8} {'w_group':>8} {'wait':>8}  slow rank waits less")
    for mode, entry in summary.items():
        for rank, v in sorted(entry["ranks"].items()):
            verdict = ""
            if rank == 1 and "slow_rank_named" in entry:
                verdict = (f"{entry['slow_rank_named']} ({entry['steps_slow_rank_waits_less']}/"
                           f"{entry['steps_compared']} steps)")
            print(f"{mode:7} {rank:>4} {v['micro']:>4} {','.join(v['clock']):>7} "
                  f"{v['wall_ms_per_step']:8.2f} {v['step_s']:8.4f} {v['compute_s']:8.4f} "
                  f"{v['wait_cross_s']:8.4f} {v['wait_group_s']:8.4f} {v['wait_s']:8.4f}  {verdict}")


def main() -> None:
    if sys.argv[1] == "--worker":
        a = sys.argv[2:]
        worker(a[0], int(a[1]), int(a[2]), int(a[3]), Path(a[4]), a[5] == "cpu", int(a[6]),
               int(a[7]), int(a[8]))
        return
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    cpu = "--cpu" in sys.argv
    import torch

    report = {"torch": torch.__version__,
              "device": "cpu" if cpu else torch.cuda.get_device_name(0), "scenarios": {}}
    plan = [("gloo", 10, 3, 4), ("nccl1", 10, 3, 4), ("gloo_sleep", 10, 3, 1),
            ("nccl1_sleep", 10, 3, 1), ("overhead", 100, 5, 1)]
    only = [a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--scenarios=")]
    if only:
        plan = [p for p in plan if p[0] in only[0]]
    if cpu:
        plan = [("gloo", 3, 2, 4), ("overhead", 5, 2, 1)]
    for scenario, steps, blocks, slow in plan:
        t0 = time.monotonic()
        ranks = run_scenario(scenario, out, cpu, steps, blocks, slow)
        summary = summarize(scenario, ranks)
        summary["seconds"] = round(time.monotonic() - t0, 1)
        report["scenarios"][scenario] = summary
        print_table(scenario, {k: v for k, v in summary.items() if k != "seconds"})
    (out / "cuda_step_timing.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
