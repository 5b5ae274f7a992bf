"""A manual eviction (``POST /v1/evict``: a decision with no finding id) of a group that already
has an open incident is that incident's eviction, not a second ``manual`` incident: one fault,
one incident, its detect -> evict time and its whole cost (docs/goodput.md, "Incidents")."""

from __future__ import annotations

import pytest

from tests.test_goodput import healthy_ledger


def _held_straggler(job, led):
    """A straggler in group 1, confirmed and held by the rails (no eviction) for 20 s."""
    onset = job.t
    job.groups[1]["struck"] = {"slow_compute": onset + 0.1}
    job.run(led, 6, pace=0.4)
    job.finding("straggler", 1, first_seen=onset + 0.1, confirmed_at=job.t, fid=11)
    job.run(led, 20, pace=0.4)
    return onset


def test_a_manual_eviction_of_a_group_with_an_open_incident_evicts_that_incident():
    job, led = healthy_ledger(groups=3, seconds=40)
    onset = _held_straggler(job, led)
    evicted_at = job.t
    job.evict(1, at=evicted_at, did=5, fid=None, source="manual")  # as evict_manual sends it
    job.evictions[-1]["finding"] = {"kind": "manual", "reason": "slow"}
    job.run(led, 3, pace=0.0)
    job.findings.clear()
    job.run(led, 20, pace=1.0)
    job.restart(1, "b")
    job.run(led, 20, pace=1.0)
    out = led.to_json()
    [inc] = out["incidents"]
    assert inc["kind"] == "straggler" and inc["replica_group"] == 1
    assert inc["eviction_id"] == 5 and inc["finding_ids"] == [11]
    assert inc["evict_s"] == pytest.approx(evicted_at - (onset + 0.1), abs=0.01)
    cost = inc["cost"]["by_cause"]
    assert cost["straggler_drag"] > 0 and cost["capacity_lost"] > 0 and cost["recovery"] > 0
    # every second of badput the job lost is this incident's
    assert sum(cost.values()) == pytest.approx(sum(out["job"]["badput_seconds"].values()) -
                                               out["job"]["badput_seconds"]["startup"], abs=0.01)


def test_a_manual_eviction_of_another_incarnation_or_group_opens_its_own_incident():
    """Only the incarnation the open incident is about: a kill of another group (or of the same
    group's next incarnation) is a fault of its own."""
    job, led = healthy_ledger(groups=3, seconds=40)
    _held_straggler(job, led)
    job.evict(2, at=job.t, did=6, fid=None, source="manual")
    job.run(led, 3)
    job.evictions.append({**job.evictions[-1], "id": 7, "replica_group": 1, "at": job.t,
                          "replica_id": "replica_group_1:other"})
    job.run(led, 3)
    by_id = {i["eviction_id"]: i for i in led.to_json()["incidents"]}
    assert by_id[6]["kind"] == "manual" and by_id[6]["replica_group"] == 2
    assert by_id[7]["kind"] == "manual" and by_id[7]["replica_group"] == 1
    straggler = by_id[None]
    assert straggler["kind"] == "straggler" and straggler["evict_s"] is None
