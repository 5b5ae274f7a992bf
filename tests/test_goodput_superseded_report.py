"""The tools that read an incident's ``recovery_s`` from ``GET /v1/goodput`` where another
fault's confirmation ended the recovery (``back_to_pace: superseded``): its
``back_to_pace_at`` is that detection, not the job back at pace, so the demo report does not
read it as one (the benchmark's reconciliation: tests/test_bench_goodput.py). Plain data, no
processes."""

from __future__ import annotations

from lightkeeper import recovery
from lightkeeper.report import recoveries
from lightkeeper.report_text import cost_markdown
from tests.test_demo_recovery import EVICTIONS, HANG, LIGHTHOUSE, T0, hang_run


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
