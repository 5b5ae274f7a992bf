"""A fault confirmed while the job is still recovering from another fault's eviction: from its
detection the lost time is the new fault's own (its stall or drag), not the older eviction's
recovery, and it ends that recovery. The model job of tests/test_goodput.py."""

from __future__ import annotations

import pytest

from tests.test_goodput import check_counted, check_invariant, healthy_ledger


def _evicted_hang(groups: int, g: int):
    """A hang in group ``g``, confirmed 2 s after it struck and evicted (the kill confirmed)."""
    job, led = healthy_ledger(groups=groups, seconds=40)
    h = job.t
    job.run(led, 2, pace=0.0)
    job.finding("hang", g, first_seen=h + 0.1, confirmed_at=job.t, fid=21)
    job.evict(g, at=job.t, did=8, fid=21)
    job.evictions[-1]["status"] = "confirmed"
    return job, led


def _incidents(led) -> dict[int, dict]:
    return {i["replica_group"]: i for i in led.to_json()["incidents"]}


def test_a_hang_held_during_a_recovery_is_its_own_stall_not_that_recovery():
    job, led = _evicted_hang(groups=4, g=3)
    killed_at = job.t
    job.run(led, 2, pace=0.0)
    job.findings.clear()
    job.run(led, 1, pace=1.0)  # the survivors resume: not yet a whole window W at pace
    h2 = job.t
    job.run(led, 2, pace=0.0)  # group 2 hangs; its eviction is held (--cooldown) for 50 s
    job.finding("hang", 2, first_seen=h2 + 0.1, confirmed_at=job.t, fid=22)
    detected = job.t
    job.run(led, 50, pace=0.0)
    a, b = _incidents(led)[3], _incidents(led)[2]
    # the three groups in the quorum stalled by B for the 50 s it was held
    assert b["cost"]["by_cause"].get("stall", 0.0) >= 3 * 50 * 0.95, b
    assert "recovery" not in b["cost"]["by_cause"]
    # A's recovery ended at B's detection: no later, in time or in cost
    assert a["back_to_pace_at"] == pytest.approx(detected)
    # said so: the job was not back at pace, another fault took over
    assert (a["back_to_pace"], a["superseded_by"]) == ("superseded", b["id"])
    assert a["recovery_s"] <= detected - a["onset_at"] + 1e-6
    assert a["cost"]["by_cause"]["recovery"] <= 3 * (detected - killed_at) + 1e-6, a
    job.evict(2, at=job.t, did=9, fid=22)
    job.evictions[-1]["status"] = "confirmed"
    job.run(led, 3, pace=0.0)
    job.findings.clear()
    job.run(led, 30, pace=1.0)
    a, b = _incidents(led)[3], _incidents(led)[2]
    assert a["cost"]["by_cause"]["recovery"] <= 3 * (detected - killed_at) + 1e-6, a
    # B's own eviction is recovered from, on its own incident
    assert b["back_to_pace"] == "reached" and b["cost"]["by_cause"]["recovery"] > 0
    check_invariant(led)
    check_counted(job, led)


def test_a_straggler_held_during_a_recovery_is_its_own_drag():
    job, led = _evicted_hang(groups=3, g=2)
    job.sweep(led, pace=0.0)
    job.findings.clear()
    s_on = job.t
    job.groups[1]["struck"] = {"slow_compute": s_on + 0.05}
    job.run(led, 5, pace=0.4)  # a straggler from the survivors' resume, confirmed 5 s in
    job.finding("straggler", 1, first_seen=s_on + 0.1, confirmed_at=job.t, fid=22)
    detected = job.t
    job.run(led, 40, pace=0.4)  # held 40 s (--min-replicas while group 2 is out)
    a, b = _incidents(led)[2], _incidents(led)[1]
    # the two groups in the quorum at 0.4x pace: 0.6 of each second is the straggler's drag
    assert b["cost"]["by_cause"].get("straggler_drag", 0.0) == pytest.approx(2 * 40 * 0.6,
                                                                            rel=0.1), b
    assert a["back_to_pace_at"] == pytest.approx(detected)
    assert (a["back_to_pace"], a["superseded_by"]) == ("superseded", b["id"])
    assert a["cost"]["by_cause"]["recovery"] <= 2 * (detected - a["evicted_at"]) + 1e-6, a
    assert led.to_json()["job"]["badput_seconds"]["recovery"] == pytest.approx(
        a["cost"]["by_cause"]["recovery"])
    check_counted(job, led)


def _slow_recovery(led, job, transient: bool, rejoin: bool) -> None:
    """After the hang's kill: the survivors at 0.5x for 20 s (a heal, say), then at pace;
    ``transient``: a straggler confirmed 3 s in that clears 3 s later, never evicted;
    ``rejoin``: the killed group back in the quorum meanwhile."""
    job.run(led, 2, pace=0.0)
    job.findings.clear()
    job.run(led, 3, pace=0.5)
    f = job.finding("straggler", 1, first_seen=job.t - 2, confirmed_at=job.t, fid=30) \
        if transient else None
    if rejoin:
        job.restart(3, "b")
    job.run(led, 3, pace=0.5)
    if f is not None:
        job.findings.remove(f)  # caught up: resolved, never acted on
    job.run(led, 14, pace=0.5)
    job.run(led, 60, pace=1.0)


@pytest.mark.parametrize("rejoin", [False, True])
def test_a_finding_that_clears_unacted_gives_the_recovery_back(rejoin):
    """A finding confirmed during a recovery that clears without an eviction, the job still
    slow, does not end it: the rest of the slow time is still the eviction's recovery, not
    unattributed, and its back at pace is the job's own (reopened if the killed group's
    return had closed it meanwhile)."""
    runs = {}
    for transient in (False, True):
        job, led = _evicted_hang(groups=4, g=3)
        _slow_recovery(led, job, transient, rejoin)
        runs[transient] = led
        check_invariant(led)
        check_counted(job, led)
    plain, tangled = _incidents(runs[False])[3], _incidents(runs[True])[3]
    assert (tangled["back_to_pace"], tangled["superseded_by"]) == ("reached", None)
    window = runs[True].to_json()["pace"]["window_s"]
    assert tangled["recovery_s"] == pytest.approx(plain["recovery_s"], abs=window)
    job_bad = runs[True].to_json()["job"]["badput_seconds"]
    assert job_bad["unattributed"] == 0, job_bad
    # the straggler keeps the drag of the seconds it was open; the rest is the recovery's
    drag = _incidents(runs[True])[1]["cost"]["by_cause"]["straggler_drag"]
    assert tangled["cost"]["by_cause"]["recovery"] + drag == pytest.approx(
        plain["cost"]["by_cause"]["recovery"], abs=0.01)


def test_a_kill_taken_back_is_no_longer_superseded_and_a_new_kill_recovers_anew():
    """A's kill (sent) is superseded by B's confirmation, then turns unconfirmed (the group
    still answered): no eviction, so no recovery that B ended. Killed again later, A's job
    back at pace is its own: ``reached``, superseded by nothing."""
    job, led = healthy_ledger(groups=4, seconds=40)
    h = job.t
    job.run(led, 2, pace=0.0)
    job.finding("hang", 3, first_seen=h + 0.1, confirmed_at=job.t, fid=21)
    job.evict(3, at=job.t, did=8, fid=21)  # sent, not yet confirmed
    job.run(led, 2, pace=0.0)
    b = job.finding("straggler", 1, first_seen=job.t - 0.5, confirmed_at=job.t, fid=30)
    job.run(led, 2, pace=0.0)
    assert _incidents(led)[3]["back_to_pace"] == "superseded"
    job.evictions[-1]["status"] = "unconfirmed"
    job.groups[3]["in"] = True
    job.run(led, 2, pace=0.0)
    a = _incidents(led)[3]
    assert a["evicted_at"] is None
    assert (a["back_to_pace"], a["superseded_by"], a["recovery_s"]) == (None, None, None)
    job.findings.remove(b)
    job.run(led, 2, pace=0.0)
    job.evict(3, at=job.t, did=10, fid=21)
    killed_at = job.t
    job.evictions[-1]["status"] = "confirmed"
    job.run(led, 3, pace=0.0)
    job.findings.clear()
    job.run(led, 30, pace=1.0)
    a = _incidents(led)[3]
    assert (a["back_to_pace"], a["superseded_by"]) == ("reached", None)
    assert a["evicted_at"] == killed_at and a["back_to_pace_at"] > killed_at
    check_invariant(led)


def test_a_new_kill_after_a_settled_one_was_taken_back_reads_its_own_back_at_pace():
    """The job settled at 0.6x after A's kill (sent); the kill turns unconfirmed, and A is
    killed again: its back at pace is looked for anew, so the old settle's level no longer
    labels it."""
    job, led = healthy_ledger(groups=4, seconds=40)
    h = job.t
    job.run(led, 2, pace=0.0)
    job.finding("hang", 3, first_seen=h + 0.1, confirmed_at=job.t, fid=21)
    job.evict(3, at=job.t, did=8, fid=21)
    job.run(led, 2, pace=0.0)
    job.findings.clear()
    job.run(led, 90, pace=0.6)
    assert (_incidents(led)[3]["back_to_pace"], _incidents(led)[3]["settled_pace"]) == (
        "settled", 0.6)
    job.evictions[-1]["status"] = "unconfirmed"  # the group answered; still out of the quorum
    job.run(led, 2, pace=0.6)
    job.evict(3, at=job.t, did=10, fid=21)
    job.evictions[-1]["status"] = "confirmed"
    job.run(led, 3, pace=0.0)
    job.run(led, 30, pace=0.6)  # at the settled level's pace: the baseline moved there
    a = _incidents(led)[3]
    assert (a["back_to_pace"], a["settled_pace"], a["settled_step_s"]) == ("reached", None, None)
    assert a["back_to_pace_at"] > a["evicted_at"]
    check_invariant(led)


def test_a_fault_that_strikes_during_a_recovery_costs_from_its_onset():
    """A hang that strikes while the job still recovers from an earlier kill, confirmed 3 s
    later: the survivors commit nothing from its onset, so that time is its stall, claimed
    back to its onset (as a slowdown's idle drag is), not the earlier kill's recovery; the
    kill keeps the recovery booked before it."""
    job, led = _evicted_hang(groups=4, g=3)
    job.run(led, 2, pace=0.0)  # the survivors wait for a quorum without group 3
    job.findings.clear()
    job.run(led, 1, pace=1.0)  # they resume: not yet a whole window W at pace
    h2 = job.t
    job.run(led, 3, pace=0.0)
    job.finding("hang", 2, first_seen=h2 + 0.1, confirmed_at=job.t, fid=22)
    job.run(led, 2, pace=0.0)
    job.evict(2, at=job.t, did=9, fid=22)
    job.evictions[-1]["status"] = "confirmed"
    killed = job.t
    job.run(led, 3, pace=0.0)
    job.findings.clear()
    job.run(led, 20, pace=1.0)
    a, b = _incidents(led)[3], _incidents(led)[2]
    # the three groups in the quorum from the sweep of B's onset to its kill
    assert b["cost"]["by_cause"]["stall"] == pytest.approx(3 * (killed - h2))
    assert a["cost"]["by_cause"]["recovery"] == pytest.approx(3 * 2)
    first = min((iv for iv in led.to_json()["intervals"] if iv["incident"] == b["id"]),
                key=lambda iv: iv["start"])
    assert (first["start"], first["cause"]) == (h2, "stall")
    assert led.to_json()["job"]["badput_seconds"]["recovery"] == pytest.approx(
        a["cost"]["by_cause"]["recovery"] + b["cost"]["by_cause"]["recovery"])
    check_invariant(led)
    check_counted(job, led)
