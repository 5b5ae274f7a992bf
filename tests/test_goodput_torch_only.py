"""The goodput ledger over a job watched through torch's debug server only (``--torch-stores``:
monitor/evidence/torch_rank.py): its ranks report the Lighthouse's step, ``participating`` and
``quorum_id``, but no commit count. The model job of tests/test_goodput.py with the count left
out of every rank's state."""

from __future__ import annotations

from monitor.goodput import GoodputLedger
from tests.test_goodput import STEP, ModelJob, check_counted
from tests.test_goodput_restart import restarted


class TorchOnlyJob(ModelJob):
    def ranks(self):
        out = super().ranks()
        for rv in out.values():
            del rv.state["commits"]
            del rv.state["faults_struck_at"]
        return out


def test_a_healthy_job_without_commit_counts_is_goodput_by_its_steps():
    job, led = TorchOnlyJob(2), GoodputLedger()
    job.run(led, 200)
    out = led.to_json()
    j = out["job"]
    assert j["goodput_ratio"] >= 0.9, j
    assert {c for c, v in j["badput_seconds"].items() if v} == {"startup"}
    assert j["pending_seconds"] == 0
    assert abs(out["baseline"]["step_seconds"] - STEP) < 0.02
    check_counted(job, led)


def gain(led, g, since):
    [row] = [x for x in led.to_json()["groups"] if x["replica_group"] == g]
    return row["goodput_seconds"] - since.get(g, 0.0)


def test_a_group_without_commit_counts_leaving_the_quorum_is_lost_capacity():
    job, led = TorchOnlyJob(3), GoodputLedger()
    job.run(led, 30)
    job.groups[2]["in"] = False
    job.run(led, 10)
    [g2] = [g for g in led.to_json()["groups"] if g["replica_group"] == 2]
    assert g2["badput_seconds"]["capacity_lost"] == 10
    assert g2["badput_seconds"]["startup"] < 15  # its startup only, not its time out
    # back, healed to the job's step, with the job at half pace: the steps it skipped are none
    # of its commits (else its pace would pass for healthy)
    job.groups[2]["in"] = True
    before = {g: gain(led, g, {}) for g in (0, 2)}
    job.run(led, 8, pace=0.5)
    assert abs(gain(led, 2, before) - gain(led, 0, before)) < 0.5


def test_a_new_incarnation_counts_no_step_reached_before_it():
    job, led = TorchOnlyJob(2), GoodputLedger()
    job.run(led, 30)
    job.restart(1, "b")  # rejoins at once, at the job's step
    before = {g: gain(led, g, {}) for g in (0, 1)}
    job.run(led, 8, pace=0.5)
    assert 2 < gain(led, 1, before) and abs(gain(led, 1, before) - gain(led, 0, before)) < 0.5


def test_a_restart_before_a_group_heals_credits_none_of_its_jump():
    """Out of the quorum for a minute (the job's step runs ~300 ahead of it), the monitor
    restarts, then the group heals to the job's step: its first sweep back counts the
    quorum's rise only, as without the restart."""
    job, led = TorchOnlyJob(3), GoodputLedger()
    job.run(led, 30)
    job.groups[2]["in"] = False
    job.run(led, 60)
    led = restarted(led)
    job.groups[2]["in"] = True
    before = {g: gain(led, g, {}) for g in (0, 2)}
    job.run(led, 40, pace=0.5)
    assert abs(gain(led, 2, before) - gain(led, 0, before)) < 0.5
