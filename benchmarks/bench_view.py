"""The view's own stages at 100,000 ranks, this tree's against another revision's, in one process.

What bench_monitor_stages.py times as ``schedule``, ``view + verification`` and ``last views
freed``, without the rest of the monitor: ``LeaderSchedule.plan`` and ``drill_now``,
``ViewBuilder.update`` with ``Verifier.judge`` (no Lighthouse) and the evidence view, then the
previous sweep's views let go. The ``--baseline`` revision's ``monitor`` (and
``tests/support``) comes from ``git archive`` and is imported under the same names beside
this tree's. The two sides take turns sweep by sweep, in alternating order, over the same
virtual-rank documents (tests/support/virtual_ranks.py's). Each side parses its own copy with
its own ``judge_body``, so neither frees the other's. That makes the ratio a side-by-side
one on a shared, loaded box. Thread CPU (``time.thread_time``). GC is off during sweeps and
what survives is frozen, as in the monitor from 20,000 targets.

    .venv/bin/python benchmarks/bench_view.py --groups 12500 --sweeps 6 --baseline REV

This bench leaves out the detectors, ledgers and metrics that run between two sweeps in the
monitor. They push the view's objects out of the cache, so ratios here can be better than
bench_monitor_stages.py's for locality changes. Use that bench for the monitor's figures.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_monitor_100k import save  # noqa: E402
from benchmarks.bench_poller import baseline_error, baseline_tree  # noqa: E402

MODULES = ("monitor.poll.discovery", "monitor.poll.poller", "monitor.schedule", "monitor.evidence.verification",
           "monitor.evidence.view", "tests.support.virtual_ranks")
STAGES = ("schedule", "view + verification", "last views freed")


def _ours(name: str) -> bool:
    return name.split(".")[0] in ("monitor", "tests")


def load(root: str) -> dict[str, Any]:
    """MODULES imported from ``root``; the modules of that name loaded before are put back
    afterwards (the objects made from each side's modules use that side's code)."""
    before = {k: sys.modules.pop(k) for k in [k for k in sys.modules if _ours(k)]}
    sys.path.insert(0, root)
    try:
        return {m: importlib.import_module(m) for m in MODULES}
    finally:
        sys.path.remove(root)
        for k in [k for k in sys.modules if _ours(k)]:
            del sys.modules[k]
        sys.modules.update(before)


class Side:
    """One revision's schedule, view builder and verifier, with its stage times."""

    def __init__(self, name: str, mods: dict[str, Any], urls: list[str], interval: float):
        self.name, self.mods = name, mods
        self.targets = [mods["monitor.poll.discovery"].Target(u, "static") for u in urls]
        self.views = mods["monitor.evidence.view"].ViewBuilder()
        self.verifier = mods["monitor.evidence.verification"].Verifier()
        self.schedule = mods["monitor.schedule"].LeaderSchedule(
            mode="on", member_interval_s=interval)
        self.view = None
        self.times: dict[str, list[float]] = {s: [] for s in STAGES}
        self.asked = 0

    def sweep(self, answer, now: float, keep: bool) -> None:
        judge_body = self.mods["monitor.poll.poller"].judge_body
        t = time.thread_time()
        plan = self.schedule.plan(self.targets, self.view, now)
        self.schedule.drill_now({}, self.view, now)
        plan_s = time.thread_time() - t
        polls = {u: judge_body(u, answer(u), 0.0, now) for u in plan.urls}
        verifier = self.verifier
        t = time.thread_time()
        view = self.views.update(
            self.targets, polls, now=now, polled=None if plan.everything else set(plan.urls),
            judge=lambda ranks, changed: verifier.judge(ranks, changed, None, None, False, now))
        view.evidence()
        update_s = time.thread_time() - t
        del polls
        last, self.view = [self.view], view
        del view
        t = time.thread_time()
        last.clear()
        freed_s = time.thread_time() - t
        if keep:
            for s, v in zip(STAGES, (plan_s, update_s, freed_s), strict=True):
                self.times[s].append(v)
        self.asked = len(plan.urls)


class _Answers:
    """One sweep's answers: a virtual rank's document, made once for both sides."""

    def __init__(self, vr: Any, index: dict[str, int]) -> None:
        self.vr, self.index, self.bodies = vr, index, {}

    def __call__(self, url: str) -> bytes:
        b = self.bodies.get(url)
        if b is None:
            b = self.bodies[url] = self.vr.state(self.index[url])
        return b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=12_500)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--sweeps", type=int, default=6, help="measured sweeps (after 2 to warm)")
    ap.add_argument("--member-interval-s", type=float, default=10.0)
    ap.add_argument("--baseline", default="HEAD",
                    help="the revision compared with the work tree (default HEAD)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n = args.groups * args.group_size
    urls = [f"http://127.0.0.1:1/r/{r}" for r in range(n)]
    index = {u: i for i, u in enumerate(urls)}
    with tempfile.TemporaryDirectory() as root:
        baseline_tree(args.baseline, root)
        try:
            old = load(root)
        except ImportError as e:  # its modules import names this tree no longer has
            raise SystemExit(baseline_error(args.baseline, f"its tree does not load ({e})")) \
                from None
        sides = [Side(args.baseline, old, urls, args.member_interval_s),
                 Side("this tree", load(ROOT), urls, args.member_interval_s)]
        vr = sides[1].mods["tests.support.virtual_ranks"].VirtualRanks(
            n, 0, args.group_size, 1.0)
        gc.disable()
        try:
            now = time.time()
            for s in range(args.sweeps + 2):
                now += 1.0
                vr.t0 -= 1.0  # every rank one step on
                answer = _Answers(vr, index)  # the same bytes for both sides
                for side in (sides if s % 2 == 0 else sides[::-1]):
                    side.sweep(answer, now, keep=s >= 2)
                    gc.collect()
                    gc.freeze()
        finally:
            gc.unfreeze()
            gc.enable()
    row: dict[str, Any] = {"ranks": n, "groups": args.groups, "sweeps": args.sweeps,
                           "baseline": args.baseline, "clock": "thread CPU", "sides": {}}
    for side in sides:
        med = {s: 1e6 * statistics.median(v) / args.groups for s, v in side.times.items()}
        med["sum"] = sum(med.values())
        row["sides"][side.name] = {"us_per_group": med, "asked": side.asked}
    base, new = (row["sides"][s.name]["us_per_group"] for s in sides)
    row["ratio"] = {k: new[k] / base[k] for k in base}
    row["load_average"] = os.getloadavg()
    print(f"median of {args.sweeps} leader sweeps at {n} ranks, thread CPU us/group (load "
          f"average {row['load_average'][0]:.1f}; {sides[1].asked} ranks asked a sweep):")
    for k in (*STAGES, "sum"):
        print(f"  {k:>22}: {args.baseline} {base[k]:7.1f}  this tree {new[k]:7.1f}  "
              f"ratio {row['ratio'][k]:.2f}")
    return save(row, args.json)


if __name__ == "__main__":
    sys.exit(main())
