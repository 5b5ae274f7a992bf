"""Run one benchmark script in two checkouts of this repository, alternating, in one run.

Each checkout runs its own copy of the script (so an older tree measures its own code), with
this repository's .venv; the rows of every run go into one JSON file with the commits, so a
figure is read as a per-pair difference taken under the same load.

    .venv/bin/python benchmarks/ab_trees.py --base /path/to/old-checkout --pairs 3 \\
        --json benchmarks/results/monitor_sweep_10k_ab.json -- \\
        benchmarks/bench_monitor_sweep.py --sizes 10000 --sweeps 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit(tree: str) -> str:
    return subprocess.run(["git", "-C", tree, "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()


def run(tree: str, argv: list[str]) -> list:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        subprocess.run([sys.executable, *argv, "--json", out], cwd=tree, check=True,
                       env={**os.environ, "PYTHONPATH": tree})
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the other checkout (e.g. a git worktree)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--json", required=True)
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- script and its arguments")
    args = p.parse_args()
    argv = args.script[1:] if args.script[:1] == ["--"] else args.script
    trees = {"base": os.path.abspath(args.base), "this": ROOT}
    result = {"command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
              "commits": {k: commit(t) for k, t in trees.items()}, "runs": []}
    for i in range(args.pairs):
        order = ("base", "this") if i % 2 == 0 else ("this", "base")  # neither always first
        for name in order:
            t = time.time()
            rows = run(trees[name], argv)
            result["runs"].append({"pair": i, "tree": name, "at": t,
                                   "load": os.getloadavg()[0], "rows": rows})
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
