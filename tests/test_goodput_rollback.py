"""A job relaunched whole from a checkpoint redoes the steps it rolled back: that time is
``rollback`` badput, not goodput, until the job's step passes the furthest it had reached (the
high-water step, kept across a monitor restart). The model job of tests/test_goodput.py."""

from __future__ import annotations

import pytest

from monitor.goodput import CAUSES, GoodputConfig, GoodputLedger
from monitor.store import Store
from tests.support.views import scratch_view
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
    for key in ("job_high", "job_redo_to", "job_name"):
        state.pop(key)
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


class NamedJob(ModelJob):
    """A model job whose ranks report the job's name (``job`` in /v1/state)."""

    def __init__(self, name: str, groups: int = 3) -> None:
        super().__init__(groups)
        self.name = name

    def ranks(self):
        out = super().ranks()
        for r in out.values():
            r.state["job"] = self.name
        return out


def sweep_alone(job: ModelJob, led: GoodputLedger, sweeps: int) -> None:
    """``sweeps`` sweeps of the job moving on with its groups' steps as they are set."""
    for _ in range(sweeps):
        job.t += 1.0
        job.progress += 1.0 / STEP
        led.update(scratch_view(job.t, ranks=job.ranks()), [], [], job.t)


def test_a_new_run_from_scratch_is_not_rollback():
    """Fine-tuning again from step 0 under the same monitor: nothing it does was done."""
    job, led = healthy_ledger(seconds=60)
    good0 = job_json(led)["goodput_seconds"]
    job.progress = 0
    for g in job.groups:
        job.restart(g, "newrun")
    job.run(led, 50)
    assert rollback_of(led) == 0.0
    assert job_json(led)["goodput_seconds"] - good0 == pytest.approx(150.0, abs=0.01)
    # the new run's own relaunch 50 steps back redoes its steps only
    relaunch(job, 50)
    job.run(led, 20)
    assert rollback_of(led) == pytest.approx(30.0, abs=0.01)


def test_another_job_on_the_same_state_inherits_no_high_water_step(tmp_path):
    path = str(tmp_path / "monitor.sqlite")
    store = Store(path)
    job = NamedJob("pretrain")
    led = GoodputLedger(GoodputConfig())
    job.run(led, 60)  # step 300
    save(store, led)
    store.close()
    # another job, resumed from its own checkpoint at step 150, under a new monitor process
    other = NamedJob("finetune")
    other.t, other.progress = job.t, 150.0
    for g in other.groups:
        other.restart(g, "ft")
    store = Store(path)
    resumed = GoodputLedger.restore(GoodputConfig(), *store.load_goodput())
    store.close()
    good0 = job_json(resumed)["goodput_seconds"]
    other.run(resumed, 40)
    assert rollback_of(resumed) == 0.0
    assert job_json(resumed)["goodput_seconds"] - good0 == pytest.approx(120.0, abs=0.5)


@pytest.mark.parametrize("bad", [2**40, 2**60])
def test_one_bad_step_read_raises_no_high_water_step(bad):
    job, led = healthy_ledger(seconds=60)
    good0 = job_json(led)["goodput_seconds"]
    job.t += 1.0
    job.progress += 5
    for s in job.groups.values():
        s["commits"] += 5
        s["joined"] = job.progress
    ranks = job.ranks()
    next(iter(ranks.values())).state["step"] = bad  # one rank, one sweep
    led.update(scratch_view(job.t, ranks=ranks), [], [], job.t)
    job.run(led, 60)
    assert rollback_of(led) == 0.0
    assert job_json(led)["goodput_seconds"] - good0 == pytest.approx(183.0, abs=0.5)
    # a real relaunch later still redoes only the steps the job reached
    relaunch(job, 50)
    job.run(led, 20)
    assert rollback_of(led) == pytest.approx(30.0, abs=0.01)
    resumed = GoodputLedger.restore(GoodputConfig(), led.snapshot(), *led.unsaved())
    job.progress -= 50
    for g in job.groups:
        job.restart(g, "again")
    job.run(resumed, 20)  # a restart keeps no bad step either
    assert rollback_of(resumed) == pytest.approx(60.0, abs=0.01)


def test_a_relaunch_whose_groups_come_back_one_at_a_time_is_rollback():
    """Group 0 is up first; the others' ranks stay unreachable (their old incarnations) 5 s."""
    job, led = healthy_ledger(seconds=40)
    job.progress -= 50
    job.restart(0, "relaunched")
    for g in (1, 2):
        job.groups[g].update(reach=False, **{"in": False})
    job.run(led, 5)
    assert rollback_of(led) == pytest.approx(5.0, abs=0.01)  # group 0 redoing steps alone
    for g in (1, 2):
        job.restart(g, "relaunched")
        job.groups[g].update(reach=True, joined=job.progress)
    job.run(led, 15)
    assert rollback_of(led) == pytest.approx(5.0 + 3 * (50 * STEP - 5), abs=0.01)
    check_counted(job, led)


@pytest.mark.parametrize("back", [None, 150])
def test_one_group_alone_in_the_newest_quorum_is_no_relaunch(back):
    """Group 0 restarts (at step 0, or from its own checkpoint 150 steps back) and is alone in
    the quorum a sweep, its peers' answers late: no rollback."""
    job, led = healthy_ledger(seconds=60)
    good0 = job_json(led)["goodput_seconds"]
    job.groups[0].update(rid="replica_group_0:b", commits=0,
                         joined=0.0 if back is None else job.progress - back)
    for g in (1, 2):
        job.groups[g]["in"] = False
    sweep_alone(job, led, 1)
    for g in (0, 1, 2):
        job.groups[g]["in"] = True
    job.groups[0]["joined"] = job.progress
    job.run(led, 10)
    assert rollback_of(led) == 0.0
    assert job_json(led)["goodput_seconds"] - good0 == pytest.approx(30.0, abs=0.5)


@pytest.mark.parametrize("back", [None, 150])
def test_a_shard_slice_holding_one_restarted_group_books_no_rollback(back):
    """A shard's slice holds group 0 alone; it restarts and heals from peers elsewhere."""
    job, led = ModelJob(1), GoodputLedger(GoodputConfig())
    job.run(led, 60)
    good0 = job_json(led)["goodput_seconds"]
    job.groups[0].update(rid="replica_group_0:b", commits=0,
                         joined=0.0 if back is None else job.progress - back)
    sweep_alone(job, led, 2)
    job.groups[0]["joined"] = job.progress  # healed: at the quorum's step
    job.run(led, 10)
    assert rollback_of(led) == 0.0
    assert job_json(led)["goodput_seconds"] - good0 == pytest.approx(10.0, abs=0.5)
