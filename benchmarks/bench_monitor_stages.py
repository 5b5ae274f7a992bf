"""Where one monitor sweep's time goes at 100,000 ranks, stage by stage, without HTTP.

The real Monitor (leader polling on, no Lighthouse) over ``--groups`` x ``--group-size``
virtual ranks (tests/support/virtual_ranks.py's documents: states with per-step timings), with
its poller replaced by an in-process one that answers each URL asked with the document a
virtual rank would serve, parsed as the monitor parses the poller process's answers
(``judge_body``: msgspec, whose documents share their keys' string objects); Flight Recorder requests
get a 404. What is left is the monitor's own per-sweep work on the answers, split by stage
(schedule, view + verification, Flight Recorder trigger, detectors, host ledger, goodput,
metrics), and the seconds its cyclic garbage collector took; the HTTP side's cost per request
is bench_monitor_sweep.py's poller row. A fake poller because the point is to take the
requests out; the answers are the real documents.

    .venv/bin/python benchmarks/bench_monitor_stages.py --groups 12500 --sweeps 3

Every figure is CPU time of the sweep's thread (``time.thread_time``): this box is shared, and
wall time follows the load. A stage's time excludes the stages and answers it calls; what no
stage accounts for is ``sweep orchestration`` (sweep_once's own steps: the Flight Recorder
fetch's scans, findings, decisions, confirmations); ``last views freed`` is the previous
sweep's views let go (the monitor drops them in sweep_once; here the bench holds them until
the sweep ends and times their release: mostly the ~21,000 answers they held). ``--drill`` then plants a hang in one
non-leader rank and times the sweeps that drill its group; ``--profile FILE`` writes the
measured leader sweeps' cProfile stats; ``--split`` also times the detectors' and the goodput
ledger's steps (their stage rows then hold what their steps do not).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import operator
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_monitor_100k import GcClock, save  # noqa: E402
from monitor import service  # noqa: E402
from monitor.config import MonitorConfig  # noqa: E402
from monitor.poll.poller import RankPoll, judge_body  # noqa: E402
from monitor.service import Monitor  # noqa: E402
from tests.support.virtual_ranks import VirtualRanks  # noqa: E402

# (object on the Monitor, dotted, or "service" the loop's module; method; stage) timed
STAGES = [("schedule", "plan", "schedule"),
          ("views", "update", "view + verification"),
          ("detectors", "fr_wanted", "Flight Recorder trigger"),
          ("detectors", "update", "detectors"),
          ("enforcer", "host_findings", "host ledger"),
          ("enforcer", "judge_hosts", "host ledger"),
          ("goodput", "account", "goodput"),
          ("service", "publish_sweep", "metrics")]
# --split: the detectors' and goodput ledger's steps timed on their own (each less the
# steps it calls: "det: straggler rest" is _straggler without its row folding)
SPLIT = [("detectors.straggler", "answers", "det: fold rows"),
         ("detectors.straggler", "judge", "det: straggler rest"),
         ("detectors.liveness", "dead", "det: dead"), ("detectors.hang", "judge", "det: hang"),
         ("detectors.liveness", "stuck_starting", "det: stuck"),
         ("detectors", "_note_commit_failures", "det: commit counts"),
         ("detectors.findings", "resolve_gone", "det: resolve gone"),
         ("goodput.ledger", "_partition", "gp: quorum split"),
         ("goodput.ledger", "_account", "gp: account"), ("goodput.ledger", "_settle", "gp: settle"),
         ("goodput.ledger", "_explain", "gp: incidents")]
ORCHESTRATION = "sweep orchestration"
# the last sweep's views dropped (in the monitor: when sweep_once replaces them): mostly the
# answers they held, ~21,000 parsed documents, freed
FREED = "last views freed"
# the view engineer's stages (issue 17): their sum is printed on its own line
VIEW_STAGES = ("schedule", "view + verification", ORCHESTRATION)


class InProcessPoller:
    """Answers like the virtual ranks, without sockets (see the module docstring)."""

    max_idle = 0

    def __init__(self, vr: VirtualRanks, index: dict[str, int]) -> None:
        self.vr, self.index = vr, index
        self.cpu_seconds = 0.0
        self.stack: list[list[float]] = []  # the bench's open stages (their children's CPU)

    def sweep(self, urls, path="/v1/state", timeout_s=None, max_bytes=None, queries=None):
        t = time.thread_time()
        if path != "/v1/state":
            out = {u: RankPoll(u, False, reason="http_status", error="HTTP 404: b''")
                   for u in urls}
        else:  # parsed and packed as the monitor reads an answer (PollHandle.result, judge_body)
            asked, index, at = self.vr.state_asked, self.index, time.time()
            queries = queries or [""] * len(urls)
            # "?since=N&recent=M" (Detectors.state_queries), as a virtual rank reads it
            out = {u: judge_body(u, asked(index[u], q), 0.0, at, state=True)
                   for u, q in zip(urls, queries, strict=True)}
        spent = time.thread_time() - t
        self.cpu_seconds += spent
        if self.stack:  # not the stage's own work
            self.stack[-1][1] += spent
        return out

    def close(self) -> None:
        pass


def drilled_sweep(mon: Monitor, vr: VirtualRanks, sweeps: int) -> list[dict]:
    """Hang group rank 3 of the middle group (its leader then waits in an in-group
    collective, the other leaders in the cross-group one) and time ``sweeps`` sweeps: the
    schedule drills the hung group, whose every rank is then polled each sweep."""
    g = len(mon.view.groups) // 2
    vr.hung[g * vr.group_size + 3] = time.monotonic() - 30.0
    out = []
    for _ in range(sweeps):
        c = time.thread_time()
        mon.polling.poller.cpu_seconds = 0.0
        mon.sweep_once()
        cpu = time.thread_time() - c
        row = {"cpu_s": cpu, "monitor_s": cpu - mon.polling.poller.cpu_seconds,
               "asked": len(mon.schedule.last.urls), "drilled": len(mon.schedule.last.drilled)}
        print("drilled sweep:", json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                            for k, v in row.items()}), flush=True)
        out.append(row)
    vr.hung.clear()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=12_500)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--sweeps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, help="cProfile stats of the leader sweeps")
    ap.add_argument("--split", action="store_true",
                    help="time the detectors' and goodput ledger's steps on their own too")
    ap.add_argument("--drill", type=int, default=None, metavar="SWEEPS",
                    help="then hang one non-leader rank and time this many sweeps")
    args = ap.parse_args()
    n = args.groups * args.group_size
    vr = VirtualRanks(n, 0, args.group_size, 1.0)
    urls = [f"http://127.0.0.1:1/r/{r}" for r in range(n)]
    poller = InProcessPoller(vr, {u: i for i, u in enumerate(urls)})
    gc_clock = GcClock()
    stages: dict[str, list[float]] = {}
    now: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        mon = Monitor(MonitorConfig(port=0, targets=urls, state_path=os.path.join(d, "m.db"),
                                    leader_polling="on", max_targets=n))
        mon.polling.poller.close()
        mon.polling.poller = poller
        try:
            c = time.thread_time()
            mon.sweep_once()  # every rank: nothing known yet
            first_cpu = time.thread_time() - c
            mon.sweep_once()

            stack: list[list[float]] = []  # per open stage: [its start, its children's CPU]

            def timed(obj, name: str, label: str) -> None:
                """Add the CPU seconds of ``obj.name`` to ``label``, less the stages it calls
                (the Flight Recorder trigger runs inside the orchestration's Polling.fr_dumps)."""
                f = getattr(obj, name)

                def w(*a, **k):
                    stack.append([time.thread_time(), 0.0])
                    try:
                        return f(*a, **k)
                    finally:
                        began, children = stack.pop()
                        spent = time.thread_time() - began
                        now[label] = now.get(label, 0.0) + spent - children
                        if stack:
                            stack[-1][1] += spent
                setattr(obj, name, w)

            for obj, name, label in STAGES + (SPLIT if args.split else []):
                timed(service if obj == "service" else operator.attrgetter(obj)(mon), name, label)
            poller.stack = stack
            row = {"ranks": n, "groups": args.groups, "sweeps": [],
                   "first_sweep_cpu_s": first_cpu, "stage_clock": "thread CPU (time.thread_time)"}
            prof = cProfile.Profile(time.thread_time) if args.profile else None
            for _ in range(args.sweeps):
                now.clear()
                poller.cpu_seconds = 0.0
                gc_clock.take()
                last = [mon.view, mon.evidence]  # freed below, timed on its own
                t, c = time.perf_counter(), time.thread_time()
                if prof is not None:
                    prof.enable()
                mon.sweep_once()
                if prof is not None:
                    prof.disable()
                wall, cpu = time.perf_counter() - t, time.thread_time() - c
                c = time.thread_time()
                last.clear()
                now[FREED] = time.thread_time() - c
                own = cpu - poller.cpu_seconds + now[FREED]
                sweep = {"wall_s": wall, "cpu_s": cpu, "answers_s": poller.cpu_seconds,
                         "monitor_s": own, "gc_s": gc_clock.take(),
                         "asked": len(mon.schedule.last.urls), **now}
                # what no stage above accounts for: sweep_once's own steps between them
                sweep[ORCHESTRATION] = own - sum(now.values())
                row["sweeps"].append(sweep)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in sweep.items()}), flush=True)
            if prof is not None:
                prof.dump_stats(args.profile)
            if args.drill is not None:
                row["drilled_sweep"] = drilled_sweep(mon, vr, args.drill)
        finally:
            mon.stop()
    for key in row["sweeps"][0]:
        stages[key] = [s.get(key, 0.0) for s in row["sweeps"]]
    row["median"] = {k: statistics.median(v) for k, v in stages.items()}
    row["load_average"] = os.getloadavg()
    row["cores"] = os.cpu_count()
    med = row["median"]
    print(f"median of {args.sweeps} leader sweeps at {n} ranks, CPU seconds (load average "
          f"{row['load_average'][0]:.1f} on {row['cores']} cores; first sweep "
          f"{first_cpu:.2f} s):")
    for k, v in med.items():
        per_group = f"{1e6 * v / args.groups:8.1f} us/group" \
            if k not in ("asked", "wall_s") else ""
        print(f"  {k:>32}: {v:10.3f}  {per_group}")
    mine = sum(med.get(k, 0.0) for k in VIEW_STAGES)
    print(f"  {'view, verification, schedule, orchestration':>32}: {mine:10.3f}  "
          f"{1e6 * mine / args.groups:8.1f} us/group")
    row["view_stages_s"] = mine
    print(f"monitor's own work per leader sweep: {med['monitor_s']:.2f} s "
          f"({1e6 * med['monitor_s'] / args.groups:.0f} us/group)")
    return save(row, args.json)


if __name__ == "__main__":
    sys.exit(main())
