"""A ledger restored from a state file another version wrote, with a badput cause this one does
not know (a settled column, unsettled runs): its seconds resume as unattributed, and the ledger
goes on settling and saving instead of raising every sweep. The model job of
tests/test_goodput.py."""

from __future__ import annotations

import json

import pytest

from monitor.goodput import GoodputLedger
from tests.test_goodput import check_invariant, healthy_ledger, job_json


def test_a_cause_this_version_does_not_know_resumes_as_unattributed():
    job, led = healthy_ledger(seconds=40, horizon_s=10)
    job.run(led, 3, pace=0.5)  # unexplained slowness: runs not settled yet
    before = job_json(led)
    state = json.loads(json.dumps(led.snapshot()))
    assert state["unsettled"] and before["badput_seconds"]["startup"] > 0
    # another version's: startup counted as "warmup", the unsettled time as "rollback"
    for cols in (state["totals"], state["gpu_totals"]):
        cols["warmup"] = cols.pop("startup")
    for r in state["unsettled"]:
        r["cause"] = "rollback"
    incidents = [i.to_store() for i in led.incidents.values()]
    again = GoodputLedger.restore(led.cfg, state, incidents, [])
    j = job_json(again)
    check_invariant(again)  # no second lost
    assert j["expected_seconds"] == before["expected_seconds"]
    assert j["badput_seconds"]["unattributed"] == pytest.approx(
        before["badput_seconds"]["startup"] + before["pending_seconds"], abs=0.01)
    for _ in range(20):  # past the horizon: every run settles
        job.sweep(again)
    j = job_json(again)
    assert j["pending_seconds"] == 0 and j["expected_seconds"] > before["expected_seconds"]
