"""What instrumenting a rank costs its steps: the trainer with and without its WorkerServer.

One real torchft Lighthouse and one single-rank replica group training the real trainer
(``lightkeeper train``, gloo on CPU), run alternately ``plain`` (``--no-worker-server``: the
Manager is not instrumented) and ``served`` (the WorkerServer on the rank, its Manager's calls
wrapped and timed, nobody polling it). Each run's pace is the median interval between its
step log lines after the first ``--skip`` steps (the span from the first counted to the last,
over the steps between: the lines carry milliseconds), so start-up is not counted; the figure is
each pair's ratio served / plain, taken side by side.

    .venv/bin/python benchmarks/bench_instrument.py [--pairs 3] [--steps 300] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightkeeper.cluster import LIGHTHOUSE_SCRIPT  # noqa: E402
from lightkeeper.processes import free_port, wait_until  # noqa: E402

STEP_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .* step=(\d+) ")


def run_once(lighthouse: str, served: bool, steps: int, skip: int, workdir: str) -> dict:
    """One trainer run; its mean step interval (s) after ``skip`` steps."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-u", "-m", "lightkeeper.cli", "train", "--replica-group", "0",
           "--num-replica-groups", "1", "--lighthouse", lighthouse, "--steps", str(steps),
           "--job", "bench"] + ([] if served else ["--no-worker-server"])
    out = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"trainer exited {out.returncode}: {(out.stdout + out.stderr)[-2000:]}")
    at = {}
    for line in (out.stdout + out.stderr).splitlines():
        m = STEP_LINE.match(line)
        if m:
            at[int(m.group(2))] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
    ordered = [at[s] for s in sorted(at) if s > skip]
    if len(ordered) < 10:
        raise RuntimeError(f"only {len(ordered)} steps logged after step {skip}")
    span = (ordered[-1] - ordered[0]).total_seconds()
    return {"served": served, "steps": len(ordered) - 1, "step_s": span / (len(ordered) - 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--skip", type=int, default=20, help="first steps not counted (start-up)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="lk-bench-instrument-")
    url_file = os.path.join(workdir, "lighthouse.url")
    lh = subprocess.Popen([sys.executable, "-u", "-c", LIGHTHOUSE_SCRIPT, "1", "1000", "3000",
                           url_file, "127.0.0.1"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, start_new_session=True)
    rows = []
    try:
        lighthouse = wait_until(lambda: os.path.exists(url_file)
                                and open(url_file).read().strip(), 30, what="the Lighthouse")
        for pair in range(args.pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)
            got = {served: run_once(lighthouse, served, args.steps, args.skip, workdir)
                   for served in order}
            row = {"pair": pair, "plain_step_s": got[False]["step_s"],
                   "served_step_s": got[True]["step_s"],
                   "ratio": got[True]["step_s"] / got[False]["step_s"],
                   "steps": got[True]["steps"], "at": time.time()}
            rows.append(row)
            print(f"pair {pair}: plain {row['plain_step_s'] * 1e3:.2f} ms/step, served "
                  f"{row['served_step_s'] * 1e3:.2f} ms/step, ratio {row['ratio']:.3f}",
                  flush=True)
    finally:
        os.killpg(lh.pid, signal.SIGKILL)
        lh.wait()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    ratios = sorted(r["ratio"] for r in rows)
    print(f"served / plain step time: median {statistics.median(ratios):.3f}, "
          f"range {ratios[0]:.3f}-{ratios[-1]:.3f} over {len(rows)} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
