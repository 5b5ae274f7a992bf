"""Every lost second tied to what explains it (docs/goodput.md): a network fault's or a job-wide
slowdown's slow commits are its drag, an incident already acted on takes no later stall, and a
held incident survives a monitor restart that closed its finding. Driven through
tests/test_goodput.py's model job."""

from __future__ import annotations

import pytest

from monitor.goodput import GoodputLedger
from tests.test_goodput import healthy_ledger


def slowed_then_confirmed(kind: str) -> dict:
    """8 s at 0.4x pace from the onset, then confirmed (a group's fault: evicted), then 30 s
    back at pace; the ledger's document."""
    job, led = healthy_ledger(groups=3, seconds=40, horizon_s=10.0)
    onset = job.t
    job.run(led, 8, pace=0.4)
    g = None if kind == "job_slow" else 1
    job.findings.append({"id": 1, "kind": kind, "replica_group": g,
                         "replica_id": job.groups[1]["rid"] if g is not None else None,
                         "ranks": [3] if g is not None else [], "evidence": {},
                         "first_seen": onset, "confirmed_at": job.t})
    if g is not None:
        job.evict(1, at=job.t, did=1, fid=1)
    job.sweep(led, pace=0.4)
    job.findings.clear()
    job.run(led, 30, pace=1.0)
    return led.to_json()


def test_a_network_faults_slowdown_is_its_drag_as_a_stragglers_is():
    straggler, network = slowed_then_confirmed("straggler"), slowed_then_confirmed("network")
    [s], [n] = straggler["incidents"], network["incidents"]
    assert n["cost"]["by_cause"] == pytest.approx(s["cost"]["by_cause"], abs=0.01)
    assert n["cost"]["by_cause"]["straggler_drag"] > 10
    assert network["job"]["badput_seconds"]["unattributed"] == 0
    assert network["job"]["pending_seconds"] == 0


def test_a_job_wide_slowdown_is_its_incidents_drag():
    doc = slowed_then_confirmed("job_slow")
    [inc] = doc["incidents"]
    bad = doc["job"]["badput_seconds"]
    # 9 sweeps at 0.4x pace on 3 groups: 0.6 x 9 x 3 replica-seconds, all of it the incident's
    assert inc["cost"]["by_cause"] == {"straggler_drag": pytest.approx(16.2, abs=0.01)}
    assert bad["straggler_drag"] == pytest.approx(16.2, abs=0.01)
    assert bad["unattributed"] == 0 and doc["job"]["pending_seconds"] == 0


def hang_evicted_never_back(**cfg):
    """A hang in group 2, evicted; group 2 never returns; the job back at pace."""
    job, led = healthy_ledger(seconds=30, **cfg)
    hang_at = job.t
    job.run(led, 2, pace=0.0)
    job.finding("hang", 2, first_seen=hang_at + 0.1, confirmed_at=job.t, fid=21)
    job.evict(2, at=job.t, did=8, fid=21)
    job.sweep(led, pace=0.0)
    job.findings.clear()  # cleared once the group is gone
    job.run(led, 3, pace=0.0)
    job.run(led, 30, pace=1.0)
    [inc] = led.to_json()["incidents"]
    assert inc["open"] and inc["back_to_pace"] == "reached"
    return job, led, inc["cost"]["by_cause"]


def test_an_evicted_incident_waiting_for_its_group_takes_no_later_stall():
    job, led, before = hang_evicted_never_back(horizon_s=10.0)
    for _ in range(3):  # pauses nothing is found about (checkpoints, say)
        job.run(led, 8, pace=0.0)
        job.run(led, 60, pace=1.0)
    [inc] = led.to_json()["incidents"]
    after = inc["cost"]["by_cause"]
    assert after["stall"] == before["stall"] and after["recovery"] == before["recovery"]
    assert after["capacity_lost"] > before["capacity_lost"]  # its group is still gone


def test_a_later_hangs_first_seconds_are_its_own_not_an_older_incidents():
    job, led, before = hang_evicted_never_back()
    h2 = job.t
    job.run(led, 2, pace=0.0)  # a hang in group 0, confirmed 2 s after its onset
    job.finding("hang", 0, first_seen=h2 + 0.1, confirmed_at=job.t, fid=30)
    job.evict(0, at=job.t, did=9, fid=30)
    job.run(led, 3, pace=0.0)
    job.run(led, 10, pace=1.0)
    doc = led.to_json()
    new, old = doc["incidents"]
    assert old["cost"]["by_cause"]["stall"] == before["stall"]
    first = [iv for iv in doc["intervals"] if h2 - 0.01 <= iv["start"] < h2 + 2
             and iv["cause"] != "capacity_lost"]
    assert first and all(iv["cause"] == "stall" and iv["incident"] == new["id"] for iv in first)
    assert new["cost"]["by_cause"]["stall"] >= 4.0  # 2 s on the 2 groups still in


def restarted(led: GoodputLedger) -> GoodputLedger:
    incidents, intervals = led.unsaved()
    return GoodputLedger.restore(led.cfg, led.snapshot(), incidents, intervals)


def held_mismatch(**cfg):
    """A mismatch in group 1, confirmed, held (not evicted: rails or --dry-run), the job at
    pace; then the monitor restarts, closing the finding (``monitor_restarted``)."""
    job, led = healthy_ledger(seconds=30, **cfg)
    job.groups[1]["struck"] = {"mismatch:at_step=150": job.t - 0.5}
    job.finding("mismatch", 1, first_seen=job.t - 0.4, confirmed_at=job.t, fid=5)
    job.run(led, 10)
    [inc] = led.to_json()["incidents"]
    assert inc["open"] and inc["back_to_pace"] == "reached" and inc["evicted_at"] is None
    job.findings = []
    return job, restarted(led), inc


def test_the_same_fault_confirmed_again_after_a_restart_joins_its_incident():
    job, led, before = held_mismatch()
    job.run(led, 3)
    job.finding("mismatch", 1, first_seen=job.t - 0.4, confirmed_at=job.t, fid=6)
    job.run(led, 3)
    [inc] = led.to_json()["incidents"]
    assert inc["finding_ids"] == [5, 6] and inc["open"] and inc["resolved_at"] is None
    assert inc["onset_at"] == before["onset_at"] and inc["detect_s"] == before["detect_s"]


def test_an_incident_a_restart_closed_is_resolved_a_horizon_later_if_not_found_again():
    job, led, _ = held_mismatch(horizon_s=10.0)
    restart_at = job.t
    job.run(led, 5)
    assert led.to_json()["incidents"][0]["open"]
    job.run(led, 10)
    [inc] = led.to_json()["incidents"]
    assert not inc["open"] and inc["resolved_at"] >= restart_at + 10.0
