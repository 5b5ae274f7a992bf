"""An incident whose job settled below pace (``back_to_pace: settled``) is shown as settled at
its level, not as back at pace: on the monitor's overview and in the demo report. Plain data
and an in-process app, no processes."""

from __future__ import annotations

import re

from lightkeeper import recovery
from lightkeeper.report import recoveries
from lightkeeper.report_text import cost_markdown
from monitor.api.app import create_app
from monitor.config import MonitorConfig
from monitor.service import Monitor
from tests.support.clock import ManualClock
from tests.test_demo_recovery import EVICTIONS, HANG, LIGHTHOUSE, T0, hang_run


def settled_incident(t0: float) -> dict:
    return {"id": 2, "kind": "hang", "replica_group": 2, "detected_at": t0 + 11.3,
            "onset_at": t0 + 10.0, "evicted_at": t0 + 11.5, "back_to_pace_at": t0 + 22.0,
            "back_to_pace": "settled", "settled_pace": 0.7, "settled_step_s": 0.286,
            "superseded_by": None, "recovery_s": 12.0, "detect_s": 1.3, "open": False,
            "cost": {"replica_seconds": 9.0, "group_steps": 45.0, "gpu_seconds": None,
                     "by_cause": {"stall": 4.0, "recovery": 2.0, "capacity_lost": 3.0}}}


def test_the_report_shows_a_settled_recovery_as_settled_not_back_at_pace():
    goodput = {"incidents": [settled_incident(T0)]}
    faults = [dict(HANG)]
    recoveries(faults, [], hang_run(), LIGHTHOUSE, EVICTIONS, goodput, T0, 24.0, 3,
               recovery.TORCHFT_DEFAULTS)
    f = faults[0]
    row = next(line for line in cost_markdown({"faults": faults}).splitlines()
               if line.startswith("| 1 |"))
    assert row.split(" | ")[2].startswith("settled at 0.7x after 12.0s (ledger)"), row
    # the steady period's start is no time the job was back at 90% of its healthy pace
    assert f["stages"]["back_at_pace_ledger"] is None
    assert f["settled_pace"] == 0.7 and f["recovery_s"] == 12.0


def test_the_overview_shows_a_settled_recovery_as_settled(tmp_path, monkeypatch):
    mon = Monitor(MonitorConfig(port=0, targets=["http://127.0.0.1:9"],
                                state_path=str(tmp_path / "m.db")), clock=ManualClock(1000.0))
    ledger_json = mon.goodput.to_json

    def with_incident(**kw):
        return {**ledger_json(**kw), "incidents": [settled_incident(1000.0)]}

    monkeypatch.setattr(mon.goodput, "to_json", with_incident)
    html = create_app(mon).test_client().get("/").get_data(as_text=True)
    line = re.sub(r"\s+", " ", re.search(r'id="last-incident">(.*?)</span>', html, re.S)[1])
    assert "settled at 0.7x after 12.0 s" in line and "back at pace" not in line, line
