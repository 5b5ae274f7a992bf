"""An incident's cost as the on-call engineer reads it: the sweep whose kill the monitor decides
is the fault's (the kill is stamped after the sweep's time), a closed incident's cost stays put
as the baseline moves on (across a restart too), and the metrics count a slice tied to an
incident at once, even behind older slow time of its group that nothing explains yet. The
model job of tests/test_goodput.py."""

from __future__ import annotations

import sqlite3

import pytest

from monitor.goodput import GoodputConfig, GoodputLedger
from monitor.store import Store
from tests.test_goodput import STEP, ModelJob, check_counted, healthy_ledger, job_json, save


def kill_after_the_sweep(job: ModelJob, led: GoodputLedger, g: int, did: int, fid: int,
                         pace: float) -> None:
    """One sweep whose finding is confirmed at its time and whose kill is decided later in it
    (after the incident bundle is fetched): the ledger reads it stamped after ``now``, while the
    killed group is still in the quorum the sweep saw."""
    job.evict(g, at=job.t + 1.2, did=did, fid=fid)
    job.groups[g]["in"] = True
    job.sweep(led, pace=pace)
    job.groups[g]["in"] = False
    job.evictions[-1]["status"] = "confirmed"


@pytest.mark.parametrize(("kind", "pace", "cause"), [("hang", 0.0, "stall"),
                                                     ("straggler", 0.3, "straggler_drag")])
def test_the_sweep_a_kill_is_decided_in_is_the_faults_not_unattributed(kind, pace, cause):
    job, led = healthy_ledger(seconds=30)
    onset = job.t
    job.run(led, 2, pace=pace)  # slow, nothing explains it yet: pending
    job.finding(kind, 2, first_seen=onset + 0.1, confirmed_at=job.t + 1, fid=4)
    kill_after_the_sweep(job, led, 2, did=2, fid=4, pace=pace)
    killed_at = job.t
    job.run(led, 70)  # past the horizon: whatever nothing explained settled as unattributed
    out = led.to_json()
    j = out["job"]
    assert j["pending_seconds"] == 0 and j["badput_seconds"]["unattributed"] == 0, j
    [inc] = out["incidents"]
    # three sweeps of three groups from the onset to the sweep the kill was decided in
    assert inc["cost"]["by_cause"][cause] == pytest.approx(3 * 3 * (1 - pace), abs=0.5)
    assert inc["cost"]["by_cause"][cause] == pytest.approx(j["badput_seconds"][cause])
    ivs = [iv for iv in out["intervals"] if iv["cause"] == cause]
    assert {iv["replica_group"] for iv in ivs} == {0, 1, 2}
    assert all(iv["incident"] == inc["id"] and iv["eviction_id"] is None for iv in ivs)
    assert max(iv["end"] for iv in ivs) == pytest.approx(killed_at)
    check_counted(job, led)


def test_a_fault_killed_in_the_sweep_it_struck_is_judged_from_its_onset():
    """Confirmed and its kill decided within the sweep it struck in: that sweep's pace window
    starts at the onset (the fault was not acted on yet), not 20 healthy steps before it."""
    job, led = healthy_ledger(seconds=30)
    job.finding("network", 1, first_seen=job.t + 0.1, confirmed_at=job.t + 1, fid=3)
    kill_after_the_sweep(job, led, 1, did=5, fid=3, pace=0.7)
    job.run(led, 10)
    [inc] = led.to_json()["incidents"]
    assert inc["kind"] == "network" and inc["evicted_at"] is not None
    # its survivors' and its own slow commits in that sweep: ~0.2-0.4 s of each group's second
    assert inc["cost"]["by_cause"]["straggler_drag"] == pytest.approx(3 * 0.3, abs=0.35)


@pytest.mark.parametrize("older", [False, True])
def test_a_closed_incidents_cost_stays_put_as_the_baseline_moves(tmp_path, older):
    """Its group-steps are its replica-seconds over the baseline it closed with: a job that
    settles at a slower pace afterwards, here after a monitor restart, does not rewrite them.
    ``older``: the incident was closed by an older monitor, whose rows keep no such baseline:
    its cost stays put from the restart on."""
    cfg = {"horizon_s": 10.0}
    job, led = healthy_ledger(seconds=30, **cfg)
    onset = job.t
    job.run(led, 6, pace=0.4)
    job.finding("straggler", 1, first_seen=onset, confirmed_at=job.t, fid=1)
    job.sweep(led, pace=0.4)
    job.evict(1, at=job.t + 0.2, did=1, fid=1)
    job.evictions[-1]["status"] = "confirmed"
    job.run(led, 8)
    job.findings = []
    job.restart(1, "b")
    job.run(led, 8)
    [inc] = led.to_json()["incidents"]
    assert not inc["open"]
    cost = inc["cost"]
    assert cost["group_steps"] == pytest.approx(cost["replica_seconds"] / STEP, rel=0.05)

    path = str(tmp_path / "monitor.sqlite")

    def restart(led: GoodputLedger) -> GoodputLedger:  # a new monitor process, same --state
        store = Store(path)
        save(store, led)
        store.close()
        if older:  # the row as an older monitor wrote it, once
            with sqlite3.connect(path) as con:
                con.execute("UPDATE goodput_incidents SET data = "
                            "json_remove(data, '$.closed_step_s')")
            con.close()
        store = Store(path)
        state, incidents, intervals = store.load_goodput()
        store.close()
        return GoodputLedger.restore(GoodputConfig(**cfg), state, incidents, intervals)

    led = restart(led)
    older = False
    job.run(led, 120, pace=0.6)  # the job's new normal, adopted after the horizon
    assert led.baseline > 1.4 * STEP
    [after] = led.to_json()["incidents"]
    assert after["cost"] == cost
    led = restart(led)  # what the upgraded monitor saved holds it too
    [after] = led.to_json()["incidents"]
    assert after["cost"] == cost


def test_metrics_count_a_tied_slice_at_once_behind_older_unexplained_slow_time():
    """Slow time nothing explains, then a hang: the hang claims its idle sweeps as its stall,
    and the metrics count that stall in the sweep that confirmed it, though the older slow
    time of the same groups waits for the horizon (it settles in each group's time order)."""
    job, led = healthy_ledger(seconds=30)
    job.sweep(led, pace=0.5)  # slow, before the hang: pending until the horizon
    hang_at = job.t
    job.run(led, 2, pace=0.0)
    job.finding("hang", 2, first_seen=hang_at + 0.1, confirmed_at=job.t + 1, fid=1)
    job.sweep(led, pace=0.0)
    j = job_json(led)
    assert j["pending_seconds"] > 0  # the older slow time, still open to a claim
    assert j["badput_seconds"]["stall"] == pytest.approx(3 * 3, abs=0.01)
    assert job.counted["stall"] == pytest.approx(j["badput_seconds"]["stall"])
    check_counted(job, led)
    job.run(led, 70, pace=0.0)
    assert job.counted["stall"] == pytest.approx(job_json(led)["badput_seconds"]["stall"])
    check_counted(job, led)


def test_a_manual_kill_stamped_inside_a_sweep_takes_none_of_that_sweeps_stall():
    """Group 2 hangs, its finding held; an operator kills group 0 by hand while a sweep runs
    (stamped after the sweep's time): that sweep's stall is still the hang's, not the kill's,
    which had not happened yet."""
    job, led = healthy_ledger(seconds=30)
    onset = job.t
    job.run(led, 3, pace=0.0)
    job.finding("hang", 2, first_seen=onset + 0.1, confirmed_at=job.t, fid=1)
    job.run(led, 3, pace=0.0)
    job.evict(0, at=job.t + 1.5, did=7, fid=None, source="manual")
    job.groups[0]["in"] = True  # the sweep saw it in the quorum still
    job.sweep(led, pace=0.0)
    job.groups[0]["in"] = False
    job.evictions[-1]["status"] = "confirmed"
    job.run(led, 3, pace=0.0)
    out = led.to_json()
    manual = next(i for i in out["incidents"] if i["kind"] == "manual")
    before = [iv for iv in out["intervals"] if iv["incident"] == manual["id"]
              and iv["end"] <= manual["onset_at"] - 1e-6]
    assert before == [], before
    check_counted(job, led)
