"""The goodput ledger at 100,000 ranks while something is wrong: CPU per sweep of
``GoodputLedger.update`` and of the store write the monitor makes after it, phase by phase.

``bench_ledger_scale.py`` times the ledger on a healthy job, where it books no badput. When the
job slows or stalls, every group below pace gets a badput slice each sweep (a ``Slice`` object
per group), kept until it settles (pending ones up to the horizon), and the sweep in which an
incident opens claims and re-judges them; the monitor then writes the changed incidents and
every closed interval at once (``Monitor._save_goodput``). Both run in the sweep's thread, after
its decisions: they lengthen the sweeps that follow a fault (docs/scaling.md, tenth round).

The job (``--groups`` x ``--group-size`` ranks, leader polling's pattern, ``bench_ledger_scale.Job``)
goes through, one sweep every ``--dt`` seconds of the ledger's clock:

1. ``healthy``: a step a sweep, until the ledger has its baseline, then ``--healthy`` sweeps;
2. ``slow``: every group at 1/``--slow-factor`` of the pace, nothing found (pending badput);
3. ``straggler``: the same, with a straggler finding open for group 7 (its incident opens in
   the first sweep of the phase);
4. ``back``: the finding resolved, a step a sweep again;
5. ``stall``: no group steps; from its third sweep a hang finding open for group 11.

Each sweep's ``update`` is timed by the thread's CPU clock; when the ledger has changed incidents
or closed intervals the write is made as the monitor makes it (``snapshot()`` and
``Store.save_goodput`` into a fresh SQLite file in a temporary directory) and timed too (thread
CPU and wall). Per phase: the median and worst, and the unsettled slices held. With
``--baseline REV`` that revision's ledger gets the same views and findings, alternating order,
and the two ledgers' ``to_json()`` must agree after every sweep (the bench stops otherwise).

    .venv/bin/python benchmarks/bench_ledger_incident.py --groups 12500 \\
        --json benchmarks/results/ledger_incident_100k.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_ledger_scale import T0, Job, ledger_module, warm  # noqa: E402
from benchmarks.bench_monitor_100k import save  # noqa: E402
from monitor import goodput as this_goodput  # noqa: E402
from monitor.store import Store  # noqa: E402


class PacedJob(Job):
    """bench_ledger_scale's job, whose groups step only on the sweeps :meth:`view` is told to."""

    def view(self, now: float, step: bool = True):
        n = self.sweep_no
        v = super().view(now)  # every state at step n (sweep n's): the job's step count
        self.sweep_no = n + 1 if step else n
        return v


def finding(fid: int, kind: str, group: int, view, first_seen: float, now: float) -> dict:
    """An open confirmed finding as the monitor hands it to the ledger (with its store id)."""
    gv = view.groups[group]
    return {"id": fid, "kind": kind, "replica_group": group, "replica_id": gv.replica_id,
            "ranks": [group * 8 + 1], "first_seen": first_seen, "confirmed_at": now,
            "evidence": {}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=12_500)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--member-every", type=int, default=30)
    ap.add_argument("--dt", type=float, default=1.0, help="seconds between sweeps")
    ap.add_argument("--healthy", type=int, default=5, help="healthy sweeps after the baseline")
    ap.add_argument("--slow", type=int, default=10, help="slow sweeps before the finding")
    ap.add_argument("--straggler", type=int, default=5)
    ap.add_argument("--back", type=int, default=5)
    ap.add_argument("--stall", type=int, default=6)
    ap.add_argument("--slow-factor", type=float, default=1.6, help="step time / healthy")
    ap.add_argument("--baseline", default=None, help="git revision to compare with")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sides = {"this": this_goodput}
    if args.baseline:
        sides["baseline"] = ledger_module(args.baseline)
    ledgers = {k: m.GoodputLedger(m.GoodputConfig()) for k, m in sides.items()}
    job = PacedJob(args.groups, args.group_size, args.member_every)
    tmp = tempfile.TemporaryDirectory(prefix="bench-ledger-incident-")
    stores = {k: Store(os.path.join(tmp.name, f"{k}.sqlite")) for k in sides}
    rows: list[dict[str, Any]] = []
    now, i = T0, 0
    phase, fired = "healthy", {}

    def sweep(step: bool, findings=lambda view: []) -> None:
        nonlocal now, i
        view = job.view(now, step)
        warm(view)
        findings = findings(view)
        gc.collect()
        row: dict[str, Any] = {"sweep": i, "phase": phase}
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        for k in order:
            led = ledgers[k]
            c = time.thread_time()
            led.update(view, [dict(f) for f in findings], [], now)
            row[k + "_update_s"] = time.thread_time() - c
            incidents, intervals = led.unsaved()
            if incidents or intervals:  # the monitor writes at once (Monitor._save_goodput)
                c, w = time.thread_time(), time.perf_counter()
                stores[k].save_goodput(led.snapshot(), incidents, intervals, at=now)
                led.saved()
                row[k + "_write_s"] = time.thread_time() - c
                row[k + "_write_wall_s"] = time.perf_counter() - w
                row[k + "_write_intervals"] = len(intervals)
            row[k + "_unsettled"] = sum(len(r["groups"]) for r in led.snapshot()["unsettled"])
        if len(sides) > 1 and ledgers["this"].to_json() != ledgers["baseline"].to_json():
            raise SystemExit(f"sweep {i}: the two ledgers' JSON differ")
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                          for k, v in row.items()}), flush=True)
        now += args.dt
        i += 1

    gc.disable()  # as the monitor from 20,000 targets: no collection inside a timed update
    try:
        for _ in range(200):
            if ledgers["this"].baseline is not None:
                break
            sweep(True)
        else:
            raise SystemExit("no pace baseline after 200 healthy sweeps: the fake job's "
                             "commits are not read as progress")
        for _ in range(args.healthy):
            sweep(True)
        # slow: a step on the sweeps where the pace's running count passes a whole step
        pace = 1.0 / args.slow_factor
        done = 0.0

        def slow_step() -> bool:
            nonlocal done
            before, done = int(done), done + pace
            return int(done) > before

        phase = "slow"
        slow_from = now
        for _ in range(args.slow):
            sweep(slow_step())
        phase = "straggler"
        fired["straggler"] = now
        for _ in range(args.straggler):
            sweep(slow_step(), lambda v: [finding(1, "straggler", 7, v, slow_from, now)])
        phase = "back"
        for _ in range(args.back):
            sweep(True)
        phase = "stall"
        stall_from = now
        for n in range(args.stall):
            sweep(False, (lambda v: [finding(2, "hang", 11, v, stall_from, now)]) if n >= 2
                  else (lambda v: []))
    finally:
        gc.enable()
        for s in stores.values():
            s.close()
        tmp.cleanup()
    out: dict[str, Any] = {"groups": args.groups, "ranks": args.groups * args.group_size,
                           "dt_s": args.dt, "slow_factor": args.slow_factor,
                           "baseline": args.baseline, "clock": "thread CPU (time.thread_time)",
                           "phases": {}}
    for ph in ("healthy", "slow", "straggler", "back", "stall"):
        sel = [r for r in rows if r["phase"] == ph]
        if ph == "healthy":
            sel = sel[-args.healthy:]
        d: dict[str, Any] = {"sweeps": len(sel)}
        for k in sides:
            ups = [r[k + "_update_s"] for r in sel]
            writes = [r[k + "_write_s"] for r in sel if k + "_write_s" in r]
            d[k] = {"update_median_s": statistics.median(ups), "update_max_s": max(ups),
                    "writes": len(writes),
                    "write_median_s": statistics.median(writes) if writes else None,
                    "write_max_s": max(writes) if writes else None,
                    "write_wall_max_s": max((r[k + "_write_wall_s"] for r in sel
                                             if k + "_write_s" in r), default=None),
                    "intervals_written_max": max((r[k + "_write_intervals"] for r in sel
                                                  if k + "_write_s" in r), default=None),
                    "unsettled_max": max(r[k + "_unsettled"] for r in sel)}
        out["phases"][ph] = d
    out["load_average"] = os.getloadavg()
    out["cores"] = os.cpu_count()
    print(json.dumps(out, indent=1))
    return save(out, args.json)


if __name__ == "__main__":
    sys.exit(main())
