"""The tools that read an incident's ``recovery_s`` from ``GET /v1/goodput`` where another
fault's confirmation ended the recovery (``back_to_pace: superseded``): its
``back_to_pace_at`` is that detection, not the job back at pace, so neither the benchmark's
reconciliation nor the demo report reads it as one. Plain data, no processes."""

from __future__ import annotations

from benchmarks.bench_goodput import back_at_pace, job_commit_times, reconcile
from lightkeeper import recovery
from lightkeeper.report import recoveries
from lightkeeper.report_text import cost_markdown
from tests.test_bench_goodput import B, ledger_of, steady
from tests.test_demo_recovery import EVICTIONS, HANG, LIGHTHOUSE, T0, hang_run


def test_reconcile_marks_a_superseded_recovery_not_applicable_not_failed():
    # group 2 hangs at 20 s, evicted at 22 s; a second fault confirmed at 23 s ends the
    # recovery there, while the survivors go on at full pace only from 27 s
    commits = {g: steady(0, 20) + [27 + t for t in steady(0, 33)] for g in (0, 1)}
    commits[2] = steady(0, 20)
    jt = job_commit_times({g: [(t, i + 1) for i, t in enumerate(times)]
                           for g, times in commits.items()})
    led = ledger_of(commits, 5, 60, B, 3)
    assert back_at_pace(jt, 22.0, 60, B) - 23.0 > 3  # the ground truth is later than 23 s
    inc = {"id": 1, "kind": "hang", "replica_group": 2, "onset_at": 20.05, "detected_at": 21.5,
           "evicted_at": 22.0, "back_to_pace_at": 23.0, "recovery_s": 2.95,
           "back_to_pace": "superseded", "superseded_by": 2}
    ivs = [{"incident": 1, "start": 20.0, "end": 23.0}]
    strikes = [{"replica_group": 2, "kind": "hang", "at": 20.0}]
    checks = reconcile(commits, jt, led, [inc], ivs, strikes, 3)
    back = [c for c in checks if "back at pace" in c["check"]]
    assert len(back) == 1 and back[0]["ok"] and back[0].get("na"), back
    assert "superseded by incident 2" in back[0]["note"]
    assert all(c["ok"] for c in checks), checks


def test_the_report_shows_a_superseded_recovery_as_superseded_not_as_a_recovery_time():
    goodput = {"incidents": [
        {"id": 2, "kind": "hang", "replica_group": 2, "detected_at": T0 + 11.3,
         "onset_at": T0 + 10.0, "evicted_at": T0 + 11.5, "back_to_pace_at": T0 + 12.0,
         "back_to_pace": "superseded", "superseded_by": 5, "recovery_s": 2.0,
         "detect_s": 1.3, "open": False,
         "cost": {"replica_seconds": 9.0, "group_steps": 45.0,
                  "by_cause": {"stall": 4.0, "recovery": 2.0, "capacity_lost": 3.0}}}]}
    cost = recovery.measured_cost(recovery.ledger_incident(HANG, goodput, T0), T0, groups=3)
    assert (cost["back_to_pace"], cost["superseded_by"]) == ("superseded", 5)
    faults = [dict(HANG)]
    recoveries(faults, [], hang_run(), LIGHTHOUSE, EVICTIONS, goodput, T0, 24.0, 3,
               recovery.TORCHFT_DEFAULTS)
    f = faults[0]
    assert f["recovery_s"] is None and f["superseded_by"] == 5
    assert f["stages"]["back_at_pace_ledger"] is None
    row = next(line for line in cost_markdown({"faults": faults}).splitlines()
               if line.startswith("| 1 |"))
    recovery_cell = row.split(" | ")[2]
    # incident 5 is no fault of the table's: named as the ledger's incident, not as fault #5
    assert recovery_cell.startswith("superseded by incident 5 at 12.0s (ledger)"), row
    other = {**f, "cost": {**f["cost"], "incident": 5}, "superseded_by": None}  # fault 2's
    row = next(line for line in cost_markdown({"faults": [f, other]}).splitlines()
               if line.startswith("| 1 |"))
    assert row.split(" | ")[2].startswith("superseded by #2 at 12.0s (ledger)"), row
