"""A fault confirmed before another fault's kill whose own eviction is held (--cooldown, the
rails): once the kill's own part is over by the ranks' commits, the job's lost time is the held
fault's (its stall or drag), not that kill's recovery, and the recovery ends ``superseded``.
The model job of tests/test_goodput.py."""

from __future__ import annotations

import re
import time

import pytest

from monitor.api.app import create_app
from monitor.config import MonitorConfig
from monitor.service import Monitor
from tests.support.clock import ManualClock
from tests.test_goodput import check_counted, check_invariant, healthy_ledger


def _incidents(led) -> dict[int, dict]:
    return {i["replica_group"]: i for i in led.to_json()["incidents"]}


def _confirmed_kill(job, g: int, did: int, fid: int) -> None:
    job.evict(g, at=job.t, did=did, fid=fid)
    job.evictions[-1]["status"] = "confirmed"


def test_a_hang_held_at_a_kill_stalls_the_job_as_its_own_not_as_that_kills_recovery():
    """Hangs in groups 2 (B) and 3 (A) confirmed together; A is killed, B's kill held 30 s
    while B's hang keeps the job still."""
    job, led = healthy_ledger(groups=4, seconds=40)
    h = job.t
    job.run(led, 2, pace=0.0)
    job.finding("hang", 2, first_seen=h + 0.1, confirmed_at=job.t, fid=22)
    job.finding("hang", 3, first_seen=h + 0.1, confirmed_at=job.t, fid=21)
    job.sweep(led, pace=0.0)
    _confirmed_kill(job, 3, did=8, fid=21)
    job.run(led, 30, pace=0.0)
    window = led.to_json()["pace"]["window_s"]
    a, b = _incidents(led)[3], _incidents(led)[2]
    # A's kill keeps at most a window of the three survivors' time; the rest is B's stall
    assert a["cost"]["by_cause"]["recovery"] <= 3 * window + 1e-6, a
    assert b["cost"]["by_cause"]["stall"] >= 3 * (30 - window) - 1e-6, b
    assert (a["back_to_pace"], a["superseded_by"]) == ("superseded", b["id"])
    assert a["evicted_at"] < a["back_to_pace_at"] <= a["evicted_at"] + window
    _confirmed_kill(job, 2, did=9, fid=22)
    job.run(led, 3, pace=0.0)
    job.findings.clear()
    job.run(led, 30, pace=1.0)
    a, b = _incidents(led)[3], _incidents(led)[2]
    assert a["cost"]["by_cause"]["recovery"] <= 3 * window + 1e-6, a
    # B's own eviction is recovered from, on its own incident
    assert b["back_to_pace"] == "reached" and b["cost"]["by_cause"]["recovery"] > 0
    assert b["back_to_pace_at"] > b["evicted_at"]
    check_invariant(led)
    check_counted(job, led)


def _held_straggler_and_killed_hang(after: float):
    """Group 0's straggler held by the rails (never evicted) keeps the job at 0.5x; a hang in
    group 2 is killed, the survivors still for longer than a window (the Lighthouse has not
    dropped the killed group), then group 2 back and the job on at the straggler's 0.5x for
    ``after`` s. Returns (job, ledger, seconds still, when the job went on)."""
    job, led = healthy_ledger(groups=3, seconds=60)
    s_on = job.t
    job.groups[0]["struck"] = {"slow_compute": s_on + 0.05}
    job.run(led, 5, pace=0.5)
    job.finding("straggler", 0, first_seen=s_on + 0.1, confirmed_at=job.t, fid=1)
    job.run(led, 30, pace=0.5)
    h = job.t
    job.run(led, 2, pace=0.0)
    hang = job.finding("hang", 2, first_seen=h + 0.1, confirmed_at=job.t, fid=2)
    job.sweep(led, pace=0.0)
    _confirmed_kill(job, 2, did=7, fid=2)
    job.findings.remove(hang)
    still = int(led.to_json()["pace"]["window_s"]) + 3
    job.run(led, still, pace=0.0)
    # a straggler slows commits, it does not stop them: the stall is the kill's recovery
    hang_inc = _incidents(led)[2]
    assert hang_inc["back_to_pace"] is None
    assert hang_inc["cost"]["by_cause"]["recovery"] == pytest.approx(2 * still)
    job.restart(2, "b")
    job.sweep(led, pace=0.5)
    went_on = job.t
    job.run(led, after, pace=0.5)
    return job, led, still, went_on


def test_a_straggler_held_at_a_kill_drags_once_the_job_went_on_without_the_killed_group():
    job, led, still, went_on = _held_straggler_and_killed_hang(300)
    hang_inc, strag = _incidents(led)[2], _incidents(led)[0]
    # the kill's recovery ended the sweep the job went on, the hang's incident closed
    assert (hang_inc["back_to_pace"], hang_inc["superseded_by"]) == ("superseded", strag["id"])
    assert hang_inc["back_to_pace_at"] == pytest.approx(went_on)
    assert hang_inc["open"] is False
    assert hang_inc["cost"]["by_cause"]["recovery"] <= 2 * still + 3 + 1e-6, hang_inc
    # every group in the quorum at 0.5x since: half of each second is the straggler's drag
    assert strag["open"] and strag["back_to_pace"] is None
    assert strag["cost"]["by_cause"]["straggler_drag"] >= 3 * 300 * 0.5 * 0.95, strag
    bad = led.to_json()["job"]["badput_seconds"]
    assert bad["recovery"] == pytest.approx(hang_inc["cost"]["by_cause"]["recovery"])
    assert bad["unattributed"] == 0, bad
    check_invariant(led)
    check_counted(job, led)


def test_the_overview_shows_a_superseded_recovery_as_the_demo_report_does(tmp_path):
    """Superseded by incident N at the time it ended, as the demo report, not as back at pace:
    ``back_to_pace_at`` is no time the job was back at pace."""
    _, led, _, went_on = _held_straggler_and_killed_hang(10)
    mon = Monitor(MonitorConfig(port=0, targets=["http://127.0.0.1:9"],
                                state_path=str(tmp_path / "m.db")), clock=ManualClock(1000.0))
    mon.goodput.ledger = led
    html = create_app(mon).test_client().get("/").get_data(as_text=True)
    line = re.sub(r"\s+", " ", re.search(r'id="last-incident">(.*?)</span>', html, re.S)[1])
    at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(went_on))
    assert f"hang in group 2, onset &rarr; superseded by incident 1 at {at}," in line, line
    assert "back at pace" not in line, line
