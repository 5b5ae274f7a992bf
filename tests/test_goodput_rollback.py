"""A job relaunched whole from a checkpoint redoes the steps it rolled back: that time is
``rollback`` badput, not goodput, until the job's step passes the furthest it had reached (the
high-water step, kept across a monitor restart). The model job of tests/test_goodput.py."""

from __future__ import annotations

import pytest

from monitor.goodput import CAUSES, GoodputConfig, GoodputLedger
from monitor.store import Store
from tests.test_goodput import STEP, ModelJob, check_counted, healthy_ledger, job_json, save


def relaunch(job: ModelJob, steps_back: int) -> None:
    """Every group relaunched (a new incarnation) from a checkpoint ``steps_back`` steps back."""
    job.progress -= steps_back
    for g in job.groups:
        job.restart(g, "relaunched")


def rollback_of(led: GoodputLedger) -> float:
    return job_json(led)["badput_seconds"]["rollback"]


def test_rollback_is_a_cause():
    assert "rollback" in CAUSES


def test_redoing_the_rolled_back_steps_is_rollback_not_goodput():
    job, led = healthy_ledger(seconds=40)
    top, good0 = int(job.progress), job_json(led)["goodput_seconds"]
    relaunch(job, 50)  # 50 steps: 10 s of work at a 0.2 s step
    job.run(led, 20)
    assert int(job.progress) == top + 50  # net progress in those 20 s: 50 steps
    j = job_json(led)
    assert j["goodput_seconds"] - good0 <= 3 * (20 - 50 * STEP) + 1e-6
    assert j["badput_seconds"]["rollback"] == pytest.approx(3 * 50 * STEP, abs=0.01)
    for g in led.to_json()["groups"]:
        assert g["badput_seconds"]["rollback"] == pytest.approx(50 * STEP, abs=0.01)
    assert job.counted["rollback"] == pytest.approx(3 * 50 * STEP, abs=0.01)  # the metrics'
    check_counted(job, led)
    # with no incident open at the relaunch it is tied to none
    rows = [iv for iv in led.to_json()["intervals"] if iv["cause"] == "rollback"]
    assert rows and all(iv["incident"] is None for iv in rows)
    assert sum(iv["replica_seconds"] for iv in rows) == pytest.approx(30.0, abs=0.01)
    # past the high-water step the job's time is goodput again
    good = job_json(led)["goodput_seconds"]
    job.run(led, 5)
    assert job_json(led)["goodput_seconds"] - good == pytest.approx(15.0, abs=0.01)
    assert rollback_of(led) == pytest.approx(30.0, abs=0.01)


def test_a_relaunch_at_the_step_it_reached_books_no_rollback():
    job, led = healthy_ledger(seconds=40)
    good0 = job_json(led)["goodput_seconds"]
    relaunch(job, 0)
    job.run(led, 20)
    assert rollback_of(led) == 0.0
    assert job_json(led)["goodput_seconds"] - good0 == pytest.approx(60.0, abs=0.01)


def test_the_sweep_that_passes_the_high_water_step_is_split():
    job, led = healthy_ledger(seconds=40)
    relaunch(job, 52)  # the 11th sweep redoes 2 of its 5 steps
    job.run(led, 11)
    assert rollback_of(led) == pytest.approx(3 * 52 * STEP, abs=0.01)


def test_a_monitor_restarted_mid_rollback_keeps_the_high_water_step(tmp_path):
    path = str(tmp_path / "monitor.sqlite")
    store = Store(path)
    job, led = healthy_ledger(seconds=40)
    relaunch(job, 50)
    job.run(led, 4)
    save(store, led)
    store.close()
    store = Store(path)  # a new monitor process, same --state
    resumed = GoodputLedger.restore(GoodputConfig(), *store.load_goodput())
    store.close()
    job.run(resumed, 16)
    assert rollback_of(resumed) == pytest.approx(30.0, abs=0.01)


def test_an_older_snapshot_without_a_high_water_step_takes_the_job_step():
    job, led = healthy_ledger(seconds=40)
    relaunch(job, 50)
    job.run(led, 4)
    state = led.snapshot()
    state.pop("job_high")
    resumed = GoodputLedger.restore(GoodputConfig(), state, *led.unsaved())
    job.run(resumed, 16)  # the steps left to redo are not known: goodput, as before
    assert rollback_of(resumed) == pytest.approx(rollback_of(led), abs=0.01)


def test_a_relaunch_during_an_incident_charges_it_the_rollback():
    """A hang in group 2, evicted; the whole job then relaunched 50 steps back."""
    job, led = healthy_ledger(seconds=40)
    job.finding("hang", 2, first_seen=job.t, confirmed_at=job.t + 1, fid=1)
    job.run(led, 2, pace=0.0)
    job.evict(2, at=job.t, did=1, fid=1)
    job.evictions[-1]["status"] = "confirmed"
    job.findings = []
    job.run(led, 2, pace=0.0)
    relaunch(job, 50)
    job.run(led, 20)
    [inc] = led.to_json()["incidents"]
    assert inc["cost"]["by_cause"]["rollback"] == pytest.approx(30.0, abs=0.01)
    assert rollback_of(led) == pytest.approx(30.0, abs=0.01)
    rows = [iv for iv in led.to_json()["intervals"] if iv["cause"] == "rollback"]
    assert rows and all(iv["incident"] == inc["id"] for iv in rows)
    check_counted(job, led)
