"""``lightkeeper demo``: a local fault-tolerant job with a WorkerServer on every rank.

Starts a torchft Lighthouse and ``--groups`` replica groups (real processes, gloo on CPU),
trains ``--steps`` committed steps, prints each rank's WorkerServer URL and, at the end, each
group's final state. Every process it started is stopped by PID on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import requests


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=int, default=2, help="replica groups (default 2)")
    p.add_argument("--ranks-per-group", type=int, default=1, help="ranks per group (default 1)")
    p.add_argument("--steps", type=int, default=60, help="committed steps to train (default 60)")
    p.add_argument("--report-dir", default=None,
                   help="where logs go (default: a new directory under the system temp dir)")


def _state(url: str) -> dict | None:
    try:
        return requests.get(url + "/v1/state", timeout=2).json()
    except (requests.RequestException, ValueError):
        return None


def run(args: argparse.Namespace) -> int:
    from .cluster import ClusterError, LocalCluster

    if args.groups < 1 or args.ranks_per_group < 1 or args.steps < 1:
        print("lightkeeper demo: --groups, --ranks-per-group and --steps must be >= 1",
              file=sys.stderr)
        return 2
    report_dir = Path(args.report_dir or tempfile.mkdtemp(prefix="lightkeeper-demo-"))
    cluster = LocalCluster(report_dir / "logs", num_groups=args.groups,
                           ranks_per_group=args.ranks_per_group, steps=args.steps)
    try:
        print(f"lightkeeper demo: logs in {report_dir / 'logs'}")
        cluster.start()
        print(f"Lighthouse: {cluster.lighthouse_url}")
        for g, group in sorted(cluster.groups.items()):
            for rank, url in sorted(group.worker_urls.items()):
                print(f"replica group {g} rank {rank}: {url}  "
                      f"(try: curl {url}/v1/state)")
        last = -1
        while any(g.alive() for g in cluster.groups.values()):
            states = [s for g in cluster.groups.values() for u in g.worker_urls.values()
                      if (s := _state(u))]
            step = min((s["step"] for s in states), default=last)
            if step != last and states:
                print(f"  step {step:>4}/{args.steps}  quorum {states[0]['quorum_id']}  "
                      f"participants {states[0]['num_participants']}")
                last = step
            time.sleep(1.0)  # display refresh, not synchronization
        failed = [g for g, grp in cluster.groups.items() if grp.proc.returncode != 0]
        if failed:
            print(f"lightkeeper demo: replica groups {failed} failed; see {report_dir / 'logs'}",
                  file=sys.stderr)
            return 1
        print(f"done: {args.groups} replica groups trained {args.steps} steps")
        return 0
    except ClusterError as e:
        print(f"lightkeeper demo: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
