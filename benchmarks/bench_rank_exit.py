"""Benchmark: how long a rank (and a torchrun group) takes to exit after its last step.

A real Lighthouse and real ``lightkeeper train`` processes, side by side in alternating order:

- ``lone ranks``: two replica groups of one rank each (``min_replicas=2``: one quorum) train
  ``--steps`` steps. ``end_process``: ``lightkeeper train`` as shipped (trainer.loop.end_process:
  the rank's cleanup, atexit handlers, logs flushed, ``os._exit``). ``interpreter exit``: the same
  CLI with ``end_process`` replaced by ``sys.exit``, i.e. the interpreter's own finalization, as
  before (the WorkerServer's stop is the current one in both: http_serving's prompt stop is not
  part of this A/B).
- ``torchrun group``: one group of two ranks under torchrun. ``TORCHRUN_SCRIPT``: LocalCluster's
  launcher as shipped (the agent exits once it returns). ``torchrun``: ``python -m
  torch.distributed.run``, as before.
- ``torchrun stop``: LocalCluster.stop() of a training 2-group x 2-rank torchrun job (SIGTERM,
  3 s grace, one group after the other, as every test's teardown and the demo's stop do), with
  LocalCluster's TORCHRUN_SCRIPT as shipped vs one that runs torchrun as ``-m`` does. Its row's
  ``exit_after_last_step_s`` is the seconds ``stop()`` took.

For each process: seconds from its last step logged (the trainer's ``asctime``, ms) to its exit
seen by this process (polled every 10 ms), and its CPU time (``wait4``: the process and the
children it waited for). Medians over ``--rounds``; the load average is recorded with them.

    .venv/bin/python benchmarks/bench_rank_exit.py --rounds 3 --out benchmarks/results/rank_exit.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightkeeper.cluster import TORCHRUN_SCRIPT, LocalCluster  # noqa: E402

# The CLI with end_process replaced by sys.exit: the interpreter finalizes as it would on return.
INTERPRETER_EXIT = (
    "import sys, trainer.loop\n"
    "trainer.loop.end_process = sys.exit\n"
    "from lightkeeper.cli import main\n"
    "sys.exit(main())\n"
)


def _last_step_time(log: str) -> float:
    line = [x for x in log.splitlines() if " lightkeeper.trainer INFO step=" in x][-1]
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> tuple[list[float], list[float]]:
    """Exit times (time.time()) and CPU seconds of every process, polled every 10 ms."""
    exited: dict[int, float] = {}
    cpu: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(exited) < len(procs):
        if time.monotonic() > deadline:
            raise TimeoutError("ranks did not finish")
        for i, p in enumerate(procs):
            if i in exited:
                continue
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                exited[i] = time.time()
                cpu[i] = ru.ru_utime + ru.ru_stime
                p.returncode = os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    return [exited[i] for i in range(len(procs))], [cpu[i] for i in range(len(procs))]


def _env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                         "TORCHELASTIC_USE_AGENT_STORE", "LIGHTKEEPER_MONITOR")}
    return {**base, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **extra}


def lone_ranks(workdir: Path, variant: str, steps: int) -> list[dict]:
    cluster = LocalCluster(workdir, num_groups=2, min_replicas=2)
    try:
        lighthouse = cluster.start_lighthouse()
        head = ([sys.executable, "-m", "lightkeeper.cli"] if variant == "end_process"
                else [sys.executable, "-c", INTERPRETER_EXIT])
        procs, logs = [], []
        for g in (0, 1):
            logs.append(workdir / f"{variant}-g{g}.log")
            with open(logs[-1], "wb") as out:
                procs.append(subprocess.Popen(
                    [*head, "train", "--lighthouse", lighthouse, "--num-replica-groups", "2",
                     "--replica-group", str(g), "--steps", str(steps)],
                    env=_env(), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT))
        exits, cpus = _wait_all(procs, 300)
        return [{"exit_after_last_step_s": round(e - _last_step_time(log.read_text()), 3),
                 "cpu_s": round(c, 2), "status": p.returncode}
                for p, log, e, c in zip(procs, logs, exits, cpus, strict=True)]
    finally:
        cluster.stop()


def torchrun_group(workdir: Path, variant: str, steps: int) -> list[dict]:
    cluster = LocalCluster(workdir, num_groups=1)
    try:
        lighthouse = cluster.start_lighthouse()
        head = ([sys.executable, "-c", TORCHRUN_SCRIPT] if variant == "TORCHRUN_SCRIPT"
                else [sys.executable, "-m", "torch.distributed.run"])
        log = workdir / f"{variant}-torchrun.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*head, "--standalone", "--local-addr=127.0.0.1", "--nproc-per-node=2",
                 "--no-python", sys.executable, "-m", "lightkeeper.cli", "train",
                 "--lighthouse", lighthouse, "--num-replica-groups", "1", "--steps", str(steps)],
                env=_env(), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        [exit_at], [cpu] = _wait_all([proc], 300)
        return [{"exit_after_last_step_s": round(exit_at - _last_step_time(log.read_text()), 3),
                 "cpu_s": round(cpu, 2), "status": proc.returncode}]
    finally:
        cluster.stop()


# torchrun as ``python -m torch.distributed.run`` runs it: the interpreter finalizes on return.
PLAIN_TORCHRUN = "import runpy\nrunpy.run_module('torch.distributed.run', run_name='__main__')\n"


def torchrun_stop(workdir: Path, variant: str, steps: int) -> list[dict]:
    import lightkeeper.cluster as lc

    shipped = lc.TORCHRUN_SCRIPT
    lc.TORCHRUN_SCRIPT = shipped if variant == "TORCHRUN_SCRIPT" else PLAIN_TORCHRUN
    cluster = LocalCluster(workdir, num_groups=2, ranks_per_group=2, steps=1_000_000,
                           extra_env={"PYTHONPATH": str(ROOT)})
    try:
        cluster.start(timeout=300)

        def stepped() -> bool:
            return all(" lightkeeper.trainer INFO step=" in g.log()
                       for g in cluster.groups.values())
        deadline = time.monotonic() + 300
        while not stepped():
            if time.monotonic() > deadline:
                raise TimeoutError("no step")
            time.sleep(0.1)
        procs = [p for g in cluster.groups.values() for p in g.processes()]
        started = time.monotonic()
        cluster.stop()
        took = time.monotonic() - started
        return [{"exit_after_last_step_s": round(took, 3), "cpu_s": 0.0,
                 "status": [p.returncode for p in procs]}]
    finally:
        cluster.stop()
        lc.TORCHRUN_SCRIPT = shipped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    ap.add_argument("--cases", default="lone ranks,torchrun group,torchrun stop",
                    help="comma-separated cases to run (default: all)")
    args = ap.parse_args()
    cases = {"lone ranks": (lone_ranks, ("end_process", "interpreter exit")),
             "torchrun group": (torchrun_group, ("TORCHRUN_SCRIPT", "torchrun")),
             "torchrun stop": (torchrun_stop, ("TORCHRUN_SCRIPT", "torchrun"))}
    cases = {c: cases[c] for c in args.cases.split(",")}
    runs: dict[str, dict[str, list[dict]]] = {c: {v: [] for v in vs} for c, (_, vs) in
                                              cases.items()}
    loads = []
    with tempfile.TemporaryDirectory(prefix="bench-rank-exit-") as tmp:
        for r in range(args.rounds):
            for case, (fn, variants) in cases.items():
                order = variants if r % 2 == 0 else variants[::-1]  # alternate who goes first
                for v in order:
                    loads.append(os.getloadavg()[0])
                    rows = fn(Path(tmp) / f"r{r}-{case.replace(' ', '_')}-{v.replace(' ', '_')}",
                              v, args.steps)
                    runs[case][v].extend(rows)
                    print(f"round {r} {case:15} {v:17} " + " ".join(
                        f"{x['exit_after_last_step_s']:.2f}s/cpu {x['cpu_s']:.1f}s/rc {x['status']}"
                        for x in rows), flush=True)
    summary = {case: {v: {"median_exit_after_last_step_s": statistics.median(
                              x["exit_after_last_step_s"] for x in rows),
                          "median_cpu_s": statistics.median(x["cpu_s"] for x in rows),
                          "exits": len(rows),
                          "all_status_0": all(x["status"] == 0 for x in rows)
                          if case != "torchrun stop" else None}
                      for v, rows in by_variant.items()}
               for case, by_variant in runs.items()}
    result = {"benchmark": "rank_exit", "rounds": args.rounds, "steps": args.steps,
              "cpus": os.cpu_count(), "load_avg_1m": {"min": min(loads), "max": max(loads)},
              "summary": summary, "runs": runs}
    print(json.dumps(summary, indent=1))
    print(f"load average (1 min) during the runs: {min(loads):.1f}-{max(loads):.1f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
