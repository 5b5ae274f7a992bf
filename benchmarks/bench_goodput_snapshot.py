"""Where the monitor's goodput write (``Monitor._save_goodput``) spends its time at 100,000
ranks: the ledger's ``snapshot()``, its encoding, and the SQLite transaction, each timed by
the thread's CPU clock and by wall time, in a fresh store under a temporary directory.

The ledger is driven as ``bench_ledger_scale.py`` drives it (``--groups`` x ``--group-size``
ranks, leader polling's pattern, every group committing a step each sweep), then written
``--writes`` times. ``store.goodput_json_text`` (what the store writes now) and plain
``json.dumps`` (what it wrote before) are timed side by side, alternating order; with
``--baseline REV`` that revision's ledger is driven by the same views and its ``snapshot()``
and ``json.dumps`` of it (the write's work before this tree's) timed alongside.

    .venv/bin/python benchmarks/bench_goodput_snapshot.py --groups 12500 --baseline REV \\
        --json benchmarks/results/goodput_snapshot_100k.json
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
from monitor.goodput import GoodputConfig, GoodputLedger  # noqa: E402
from monitor.store import Store, goodput_json_text  # noqa: E402


def timed(fn, *args) -> tuple[Any, float, float]:
    """(fn's result, thread CPU seconds, wall seconds)."""
    c, w = time.thread_time(), time.perf_counter()
    out = fn(*args)
    return out, time.thread_time() - c, time.perf_counter() - w


def write_state(store: Store, data: str) -> None:
    """The state row's transaction as ``Store.save_goodput`` runs it (no incidents, no
    intervals), for text already encoded: the baseline's SQLite share."""
    with store._lock, store._db:
        store._db.execute("INSERT OR REPLACE INTO goodput_state (id, at, data) VALUES (1, ?, ?)",
                          (T0, data))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=12_500)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--member-every", type=int, default=30)
    ap.add_argument("--sweeps", type=int, default=12)
    ap.add_argument("--writes", type=int, default=7)
    ap.add_argument("--baseline", default=None, help="git revision to compare with")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    job = Job(args.groups, args.group_size, args.member_every)
    led = GoodputLedger(GoodputConfig())
    base = None
    if args.baseline:
        mod = ledger_module(args.baseline)
        base = mod.GoodputLedger(mod.GoodputConfig())
    for i in range(args.sweeps):
        v = job.view(T0 + i)
        warm(v)
        led.update(v, [], [], T0 + i)
        if base is not None:
            base.update(v, [], [], T0 + i)
    stages: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, cpu: float, wall: float) -> None:
        stages.setdefault(name, []).append((cpu, wall))

    with tempfile.TemporaryDirectory() as d:
        store = Store(os.path.join(d, "state.db"))
        gc.collect()
        gc.disable()  # as the monitor from 20,000 targets
        try:
            for n in range(args.writes):
                if base is not None:
                    old, cpu, wall = timed(base.snapshot)
                    add("baseline_snapshot", cpu, wall)
                    data, cpu, wall = timed(json.dumps, old)
                    add("baseline_json_dumps", cpu, wall)
                    add("baseline_json_dumps_bytes", len(data), 0.0)
                    _, cpu, wall = timed(write_state, store, data)
                    add("baseline_sqlite", cpu, wall)
                    del old, data
                state, cpu, wall = timed(led.snapshot)
                add("snapshot", cpu, wall)
                encoders = [("json_dumps", json.dumps), ("store_encode", goodput_json_text)]
                for name, fn in (encoders if n % 2 == 0 else list(reversed(encoders))):
                    data, cpu, wall = timed(fn, state)
                    add(name, cpu, wall)
                    add(name + "_bytes", len(data), 0.0)
                incidents, intervals = led.unsaved()
                _, cpu, wall = timed(store.save_goodput, state, incidents, intervals, T0)
                # the store's whole transaction, encoding included; the first write also
                # stores the intervals settled so far (every group's startup, once paced)
                add("first_save_goodput" if n == 0 else "save_goodput", cpu, wall)
                add("first_save_intervals" if n == 0 else "save_intervals", len(intervals), 0.0)
                led.saved()
                _, cpu, wall = timed(write_state, store, goodput_json_text(state))
                add("sqlite", cpu, wall)
                rows, cpu, wall = timed(store.load_goodput)
                add("load_goodput", cpu, wall)
                resumed, cpu, wall = timed(GoodputLedger.restore, GoodputConfig(), *rows)
                add("restore", cpu, wall)  # a restarted monitor's, once at its start
        finally:
            gc.enable()
        if resumed.to_json() != led.to_json():
            print("the ledger restored from the store differs from the one saved", flush=True)
            return 1
        store.close()
    out: dict[str, Any] = {"groups": args.groups, "ranks": args.groups * args.group_size,
                           "writes": args.writes, "clock": "median thread CPU and wall seconds"}
    for name, vals in stages.items():
        if name.endswith(("_bytes", "_intervals")):
            out[name] = int(vals[0][0])
        else:
            out[name + "_cpu_s"] = statistics.median(v[0] for v in vals)
            out[name + "_wall_s"] = statistics.median(v[1] for v in vals)
    if base is not None:  # the whole write from the sweep's thread: before, and now
        out["baseline_write_cpu_s"] = sum(out[f"baseline_{k}_cpu_s"]
                                          for k in ("snapshot", "json_dumps", "sqlite"))
    out["write_cpu_s"] = out["snapshot_cpu_s"] + out.get("save_goodput_cpu_s", 0.0)
    out["load_average"] = os.getloadavg()
    out["cores"] = os.cpu_count()
    print(json.dumps(out, indent=1))
    return save(out, args.json)


if __name__ == "__main__":
    sys.exit(main())
