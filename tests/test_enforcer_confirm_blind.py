"""A sent kill is confirmed on ranks the monitor saw gone, never in a sweep where it is blind
(monitor/act/enforcer.py; docs/monitor.md, Eviction and safety rails).

A monitor swept by hand over a real torchft Lighthouse that simulated groups join (``SimJob``,
tests/support/monitor_sim.py), its clock injected.
"""

from __future__ import annotations

import time

import pytest

from monitor.api.app import create_app
from monitor.config import BundleConfig, MonitorConfig, RailsConfig
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob

TOKEN = "s3cret"


@pytest.fixture
def job():
    j = SimJob(3)
    yield j
    j.stop()


def monitor(tmp_path, job: SimJob, skew: list[float]) -> Monitor:
    return Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "state.sqlite"),
                                 targets=job.sim.urls, job="sim", lighthouse=job.url,
                                 token=TOKEN, rails=RailsConfig(min_replicas=1, cooldown_s=0),
                                 bundles=BundleConfig(enabled=False), confirm_timeout_s=5.0),
                   clock=lambda: time.time() + skew[0])


def evict(client, group: int) -> dict:
    r = client.post("/v1/evict", json={"replica_group": group, "reason": "test"},
                    headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.get_json()["sent"] is True, r.get_data(as_text=True)
    return r.get_json()


def eviction(client, rid: str) -> dict:
    return next(d for d in client.get("/v1/evictions?decision=evict").get_json()
                if d["replica_id"] == rid)


def set_modes(job: SimJob, groups, mode: str) -> None:
    for g in groups:
        for r in job.sim.group(g):
            r.set_mode(mode)


def test_a_kill_that_landed_nowhere_is_not_confirmed_by_a_blind_sweep(tmp_path, job):
    """A kill the Lighthouse answered (sent) that reached nobody (say it cannot resolve the
    node's hostname); then the monitor is cut off from every rank. Before, that blind sweep
    marked the kill ``confirmed`` ("left the quorum"), for good: the replica, alive, was taken
    for evicted. Now it stays ``sent`` and, the group answering again, turns ``unconfirmed``
    after the confirmation window."""
    job.kill = lambda replica_id: False  # the front answers 500; nothing dies
    skew = [0.0]
    mon = monitor(tmp_path, job, skew)
    try:
        client = create_app(mon).test_client()
        mon.sweep_once()
        rid = job.replica_ids[1]
        evict(client, 1)
        set_modes(job, range(3), "down")  # the monitor reaches none of the ranks
        skew[0] += 1.0
        mon.sweep_once()
        assert client.get("/v1/cluster").get_json()["reachable_fraction"] == 0.0
        row = eviction(client, rid)
        assert row["status"] == "sent" and row["confirmed_at"] is None, row
        assert "left the quorum" not in row["detail"]

        set_modes(job, range(3), "ok")
        skew[0] += 5.0  # past confirm_timeout_s, the group answering again
        mon.sweep_once()
        row = eviction(client, rid)
        assert row["status"] == "unconfirmed" and "still reporting" in row["detail"], row
    finally:
        mon.stop()


def test_a_kill_that_landed_is_confirmed_at_the_first_sweep_that_sees_again(tmp_path, job):
    """The group really killed while the monitor is blind: ``sent`` through the blind sweep,
    ``confirmed`` (left the quorum) at the first sweep that reaches the other ranks again."""
    skew = [0.0]
    mon = monitor(tmp_path, job, skew)
    try:
        client = create_app(mon).test_client()
        mon.sweep_once()
        rid = job.replica_ids[1]
        evict(client, 1)  # SimJob's front takes group 1 down, as its exiting Manager would
        set_modes(job, (0, 2), "down")
        skew[0] += 1.0
        mon.sweep_once()
        assert eviction(client, rid)["status"] == "sent"

        set_modes(job, (0, 2), "ok")
        skew[0] += 1.0
        mon.sweep_once()
        row = eviction(client, rid)
        assert row["status"] == "confirmed" and "left the quorum" in row["detail"], row
    finally:
        mon.stop()


def test_the_monitors_own_kills_do_not_blind_it_to_their_confirmation(tmp_path, job):
    """Two of three groups killed: most ranks it knows stop answering, because of its kills.
    Those ranks do not count against its reach: both kills are confirmed at the next sweep."""
    skew = [0.0]
    mon = monitor(tmp_path, job, skew)
    try:
        client = create_app(mon).test_client()
        mon.sweep_once()
        evict(client, 1)
        evict(client, 2)
        skew[0] += 1.0
        mon.sweep_once()
        assert client.get("/v1/cluster").get_json()["reachable_fraction"] <= 0.5
        for g in (1, 2):
            row = eviction(client, job.replica_ids[g])
            assert row["status"] == "confirmed" and "left the quorum" in row["detail"], row
    finally:
        mon.stop()
