"""The goodput ledger and its metrics at 100,000 ranks: CPU per group per sweep, this tree's
ledger and a baseline revision's side by side in one process, on the same views.

``--groups`` x ``--group-size`` ranks behind a real :class:`monitor.evidence.view.ViewBuilder` with
leader polling's pattern (every group's leader asked each sweep, each member once per
``--member-every`` sweeps), every group committing one step per sweep. Each sweep's view goes
to both ledgers (``GoodputLedger.update`` and ``MonitorMetrics.add_goodput``: the monitor's
``goodput`` and ``metrics`` work of a sweep, less the store), in alternating order, each timed
by the thread's CPU clock; their ``to_json()`` is compared after every sweep (the figures must
be the same: the bench stops on the first difference). The ledger's startup (before its
healthy baseline exists: ``baseline_min_samples`` sweeps after a whole pace window) and its
paced sweeps are reported apart. ``snapshot()`` (what the monitor writes every few seconds)
is timed once at the end, both sides.

    .venv/bin/python benchmarks/bench_ledger_scale.py --groups 12500 --sweeps 30 \\
        --baseline REV --json benchmarks/results/ledger_scale_100k.json

The view building is not timed (bench_monitor_stages.py has it); the ledger sees the whole view
(no Lighthouse here: every rank is evidence).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_monitor_100k import save  # noqa: E402
from benchmarks.bench_poller import baseline_error, git_source  # noqa: E402
from monitor import goodput as this_goodput  # noqa: E402
from monitor.api.metrics import MonitorMetrics  # noqa: E402
from monitor.evidence.view import ViewBuilder  # noqa: E402
from monitor.poll.discovery import Target  # noqa: E402
from monitor.poll.poller import RankPoll  # noqa: E402
from tests.support.monitor_sim import rank_state  # noqa: E402

T0 = 1_700_000_000.0


def ledger_module(rev: str) -> Any:
    """``monitor/goodput/`` at ``rev`` (from 6ca0a53 on), imported as the package
    ``monitor.goodput_at_<rev>``: its absolute imports resolve to this tree's, so the view is
    the same for both sides. Its ``GoodputLedger`` and ``GoodputConfig`` are the module's
    (the package's, or its ``ledger`` module's before the package re-exported them)."""
    files = subprocess.run(["git", "ls-tree", "--name-only", rev, "monitor/goodput/"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()
    if not files:
        raise SystemExit(baseline_error(rev, "it has no monitor/goodput/ (before 6ca0a53)"))
    folder = tempfile.mkdtemp(prefix="goodput_at_")
    atexit.register(shutil.rmtree, folder, True)  # its modules are loaded by then
    for path in files:
        if path.endswith(".py"):
            with open(os.path.join(folder, os.path.basename(path)), "w") as f:
                f.write(git_source(rev, path))
    name = "monitor.goodput_at_" + rev
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod if hasattr(mod, "GoodputLedger") else importlib.import_module(name + ".ledger")


class Job:
    """Every rank's state; each sweep every group commits a step and the due ranks answer."""

    def __init__(self, groups: int, size: int, member_every: int) -> None:
        self.size, self.member_every = size, member_every
        self.targets = [Target(f"http://127.0.0.1:1/r/{r}", "static")
                        for r in range(groups * size)]
        self.states = []
        for r in range(groups * size):
            s = rank_state(r, r // size, step=0, quorum_id=2, participants=groups, now=T0)
            s.update(group_rank=r % size, group_world_size=size, commits=0, host=f"h{r // 8}")
            self.states.append(s)
        self.builder = ViewBuilder()
        self.sweep_no = 0

    def view(self, now: float):
        n = self.sweep_no
        self.sweep_no += 1
        polled = set()
        polls = {}
        for r, (t, s) in enumerate(zip(self.targets, self.states, strict=True)):
            s["step"] = s["commits"] = n
            s["last_step_at"] = now - 0.02  # the job's pace is dated from the ranks' commits
            if n == 0 or r % self.size == 0 or (r // self.size + n) % self.member_every == 0:
                polled.add(t.url)
                polls[t.url] = RankPoll(t.url, True, data=dict(s))
        return self.builder.update(self.targets, polls, now=now, polled=polled)


def warm(view) -> None:
    """The view's derived values the ledger reads, computed before the timing: in the
    monitor the view, schedule and detectors stages read them first (and pay for them)."""
    view.in_quorum()
    for gv in view.groups.values():
        gv.reachable, gv.replica_id, gv.step  # noqa: B018 (cached on first read)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=12_500)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--member-every", type=int, default=30)
    ap.add_argument("--sweeps", type=int, default=30)
    ap.add_argument("--dt", type=float, default=1.0, help="seconds between sweeps (one step)")
    ap.add_argument("--baseline", default=None, help="git revision to compare with")
    ap.add_argument("--memory", action="store_true",
                    help="also tracemalloc what each ledger holds (slow: a run of its own)")
    ap.add_argument("--memory-only", action="store_true", help="--memory, and no timing")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sides = {"this": this_goodput}
    if args.baseline:
        sides["baseline"] = ledger_module(args.baseline)
    ledgers = {k: m.GoodputLedger(m.GoodputConfig()) for k, m in sides.items()}
    metrics = {k: MonitorMetrics("bench") for k in sides}
    held: dict[str, int] = {}
    if args.memory or args.memory_only:  # what each ledger holds after the sweeps, one at a time
        for k in sides:
            job = Job(args.groups, args.group_size, args.member_every)
            tracemalloc.start()
            led = sides[k].GoodputLedger(sides[k].GoodputConfig())
            for i in range(args.sweeps):
                v = job.view(T0 + i * args.dt)
                warm(v)
                led.update(v, [], [], T0 + i * args.dt)
            gc.collect()
            # the memory allocated by the ledger's module and still held (numpy's arrays
            # included: numpy reports them to tracemalloc)
            snap = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(True, "*goodput*")])
            held[k] = sum(st.size for st in snap.statistics("filename"))
            tracemalloc.stop()
            del led, v, job
            print(f"{k}: the ledger holds {held[k] / 2**20:.1f} MiB after {args.sweeps} sweeps",
                  flush=True)
    if args.memory_only:
        out = {"groups": args.groups, "sweeps": args.sweeps, "baseline": args.baseline,
               "what": "tracemalloc: memory allocated in the ledger's module and still held",
               **{f"{k}_held_mib": v / 2**20 for k, v in held.items()},
               "load_average": os.getloadavg()}
        print(json.dumps(out))
        return save(out, args.json)
    job = Job(args.groups, args.group_size, args.member_every)
    rows: list[dict[str, Any]] = []
    gc.disable()  # as the monitor from 20,000 targets: no collection inside a timed update
    try:
        for i in range(args.sweeps):
            now = T0 + i * args.dt
            view = job.view(now)
            warm(view)
            gc.collect()
            row: dict[str, Any] = {"sweep": i}
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for k in order:
                c = time.thread_time()
                acct = ledgers[k].update(view, [], [], now)
                metrics[k].add_goodput(acct)
                row[k + "_s"] = time.thread_time() - c
                row[k + "_phase"] = "startup" if ledgers[k].baseline is None else "paced"
            if len(sides) > 1 and ledgers["this"].to_json() != ledgers["baseline"].to_json():
                print(f"sweep {i}: the two ledgers' JSON differ", flush=True)
                return 1
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
        snap = {}
        for k in sides:
            c = time.thread_time()
            ledgers[k].snapshot()
            snap[k] = time.thread_time() - c
    finally:
        gc.enable()
    out: dict[str, Any] = {"groups": args.groups, "ranks": args.groups * args.group_size,
                           "sweeps": args.sweeps, "baseline": args.baseline,
                           "clock": "thread CPU (time.thread_time)", "snapshot_s": snap}
    g = args.groups
    for k in sides:
        for phase in ("startup", "paced"):
            vals = [r[k + "_s"] for r in rows[2:] if r[k + "_phase"] == phase]
            if vals:
                out[f"{k}_{phase}_us_per_group"] = 1e6 * statistics.median(vals) / g
                out[f"{k}_{phase}_sweeps"] = len(vals)
        if held:
            out[f"{k}_held_mib"] = held[k] / 2**20
    out["load_average"] = os.getloadavg()
    out["cores"] = os.cpu_count()
    print(json.dumps(out, indent=1))
    return save(out, args.json)


if __name__ == "__main__":
    sys.exit(main())
