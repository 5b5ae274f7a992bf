"""Slots never seen (``--expected-groups`` above the groups running) are one interval per cause,
whatever their number: not one per sweep (docs/goodput.md, "intervals")."""

from __future__ import annotations

import pytest

from monitor.goodput import GoodputConfig, GoodputLedger
from tests.test_goodput import T0, ModelJob, check_counted, check_invariant


def unseen_rows(led: GoodputLedger) -> list[dict]:
    ivs = led.to_json(intervals=10_000)["intervals"]
    return sorted((iv for iv in ivs if iv["replica_group"] is None), key=lambda iv: iv["start"])


def test_two_unseen_slots_make_one_interval_per_cause():
    job = ModelJob(2)
    led = GoodputLedger(GoodputConfig(expected_groups=4))
    job.run(led, 60)
    startup, lost = unseen_rows(led)
    assert (startup["cause"], lost["cause"]) == ("startup", "capacity_lost")
    # the ledger's clock starts at the first sweep (T0 + 1): the two rows tile the rest
    assert startup["start"] == T0 + 1 and startup["end"] == lost["start"]
    assert lost["end"] == job.t
    for iv in (startup, lost):
        assert iv["replica_seconds"] == pytest.approx(2 * (iv["end"] - iv["start"]), abs=0.01)
        assert iv["gpu_seconds"] == pytest.approx(2 * iv["replica_seconds"], abs=0.01)
    unseen = next(g for g in led.to_json()["groups"] if g["replica_group"] is None)
    assert unseen["expected_seconds"] == pytest.approx(2 * 59, abs=0.01)
    check_invariant(led)
    check_counted(job, led)


def test_unseen_slots_across_a_gap_are_one_interval():
    job = ModelJob(2)
    led = GoodputLedger(GoodputConfig(expected_groups=5))
    job.run(led, 30)
    gap_from = job.t
    job.sweep(led, dt=100)
    [row] = [iv for iv in unseen_rows(led) if iv["cause"] == "unattributed"]
    assert (row["start"], row["end"]) == (gap_from, job.t)
    assert row["replica_seconds"] == pytest.approx(3 * 100, abs=0.01)
    check_invariant(led)


def test_unseen_slots_while_a_kill_has_the_job_down_are_one_interval():
    job = ModelJob(2)
    led = GoodputLedger(GoodputConfig(expected_groups=4))
    job.run(led, 40)
    job.finding("hang", 1, first_seen=job.t, confirmed_at=job.t + 1, fid=7)
    job.run(led, 2, pace=0.0)
    job.evict(1, at=job.t, did=1, fid=7)
    job.evictions[-1]["status"] = "confirmed"
    down_at = job.t
    for g in job.groups.values():
        g["reach"] = False
    job.run(led, 20, pace=0.0)
    rows = [iv for iv in unseen_rows(led) if iv["end"] > down_at + 1e-6]
    # the down time continues the slots' capacity_lost row begun while the job ran
    [row] = rows
    assert row["cause"] == "capacity_lost" and row["end"] == job.t
    assert row["replica_seconds"] == pytest.approx(2 * (row["end"] - row["start"]), abs=0.01)
    check_invariant(led)
    check_counted(job, led)
