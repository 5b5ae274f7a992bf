"""A fault that struck before the job trained healthy for a while leaves no healthy baseline: the
report says so instead of pacing the job against the fault's own phase (``--inject`` gives a
fault at the group's start; it may strike before every group commits). In-process, from plain
data in the shape the demo records (``tests/test_demo_report.py``)."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace as NS

from lightkeeper import demo as demo_cli
from lightkeeper import report
from lightkeeper.report import phases
from lightkeeper.scenario import Scenario

SLOW, FAST = 1.0, 4.0  # steps/s: the job with the straggler, and after its eviction


def ticks(train_start: float, evicted: float, end: float) -> list[tuple[float, int]]:
    out, step, t = [], 0, train_start
    while t <= end + 1e-9:
        out.append((round(t, 2), int(step)))
        step += 0.5 * (SLOW if t < evicted else FAST)
        t += 0.5
    return out


def fault(struck: float, evicted: float | None = 30.0) -> dict:
    return {"replica_group": 1, "group_rank": 0, "rank": 1, "host": "node-1",
            "spec": "slow_compute:delay=0.6,from_step=15,rank=0", "given": "start",
            "injected_at_s": 5.0, "struck_at_s": struck, "detected_at_s": None,
            "detected_kind": None, "finding_ranks": None, "culprit_ranks": None,
            "culprit_hosts": None, "evicted_at_s": evicted, "restarted_at_s": None,
            "survivors_committing_at_s": None, "rejoined_at_s": None, "steps_lost": None,
            "outcome": "evicted, did not rejoin in time", "note": None,
            "host_quarantined_at_s": None, "restarted_on": None, "restarted_addr": None}


def test_a_fault_that_struck_before_training_leaves_no_baseline():
    got = phases(10.0, 50.0, [fault(8.0)], groups=2, ticks=ticks(10.0, 30.0, 50.0))
    # the first phase is the straggler's: nothing is "x healthy" against it
    assert got[0]["name"] == "slow_compute in group 1 rank 0"
    assert got[0]["step_rate"] == SLOW and got[1]["step_rate"] == FAST
    assert [p["vs_healthy"] for p in got] == [None, None]
    assert report.healthy_rate(got) is None
    why = report.no_baseline(10.0, [fault(8.0)])
    assert why.startswith("no healthy baseline: fault 1 (slow_compute in group 1 rank 0)")
    assert "before training started" in why


def test_a_healthy_phase_under_three_seconds_is_no_baseline_either():
    got = phases(10.0, 50.0, [fault(11.5)], groups=2, ticks=ticks(10.0, 30.0, 50.0))
    assert got[0]["name"] == "healthy" and got[0]["vs_healthy"] is None
    assert "1.5s after training started" in report.no_baseline(10.0, [fault(11.5)])


def test_a_fault_after_a_healthy_while_keeps_its_baseline():
    got = phases(10.0, 50.0, [fault(20.0)], groups=2, ticks=ticks(10.0, 20.0, 50.0))
    assert got[0]["name"] == "healthy" and got[0]["vs_healthy"] == 1.0
    assert report.healthy_rate(got) == SLOW and report.no_baseline(10.0, [fault(20.0)]) is None


def _demo(tmp_path, faults, train_start, demo_ticks):
    p = argparse.ArgumentParser()
    demo_cli.add_arguments(p)
    return NS(args=p.parse_args(["--groups", "2", "--ranks-per-group", "1"]), sc=Scenario(),
              dir=tmp_path, evictions=[], faults=faults, goodput=None, lighthouse_log=[],
              now=lambda: demo_ticks[-1][0] + 2, samples=[], ticks=demo_ticks,
              train_start_s=train_start, t0_unix=0.0, interrupted=False, error=None,
              monitor_url=None, pids=list, prom_note=None, prom=None, events=[], findings=[],
              user_url=lambda u: u, cluster=NS(lighthouse_url="http://lh"))


def test_the_report_says_why_it_has_no_baseline_and_no_figure_against_it(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "plot", lambda *a: None)  # the picture is not what is tested
    demo = _demo(tmp_path, [fault(8.0)], 10.0, ticks(10.0, 30.0, 50.0))
    summary = report.write_report(demo, tmp_path)
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["healthy_step_rate"] is None
    assert rep["no_baseline"].startswith("no healthy baseline: fault 1")
    [f] = rep["faults"]
    assert f["steps_lost"] is None  # not ~0 against the straggler's own pace
    assert all(p["vs_healthy"] is None for p in rep["phases"])
    md = (tmp_path / "report.md").read_text()
    assert "Healthy step rate: none, no healthy baseline: fault 1" in md
    assert "| no healthy baseline | evicted, did not rejoin in time |" in summary  # steps lost
    phase_rows = [line for line in summary.splitlines() if line.startswith("| slow_compute")]
    assert phase_rows and phase_rows[0].endswith("| no healthy baseline |")
    assert "1.00x" not in summary


def test_a_run_with_a_healthy_while_reports_its_baseline(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "plot", lambda *a: None)
    demo = _demo(tmp_path, [fault(20.0)], 10.0, ticks(10.0, 20.0, 50.0))
    report.write_report(demo, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert f"Healthy step rate: {SLOW} committed steps/s." in md and "no healthy" not in md
