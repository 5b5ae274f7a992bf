"""Kills whose outcome a restart or the confirmation window left open (monitor/act/confirm.py,
monitor/store.py; docs/monitor.md, Eviction and safety rails).

A monitor swept by hand over a real torchft Lighthouse that simulated groups join (``SimJob``,
tests/support/monitor_sim.py) and a real SQLite state file. What a SIGKILLed monitor leaves is
written with ``Store`` as the monitor itself writes it.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from monitor.api.app import create_app
from monitor.config import BundleConfig, DetectorConfig, MonitorConfig, RailsConfig
from monitor.service import Monitor
from monitor.store import Store
from tests.support.monitor_sim import SimJob

TOKEN = "s3cret"


def monitor(tmp_path, job: SimJob, clock, **kw) -> Monitor:
    return Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "state.sqlite"),
                                 targets=job.sim.urls, job="sim", lighthouse=job.url,
                                 token=TOKEN, rails=RailsConfig(min_replicas=1, cooldown_s=0),
                                 bundles=BundleConfig(enabled=False), **kw), clock=clock)


def evictions(mon: Monitor) -> dict[str, dict]:
    """replica id -> its newest eviction row, as ``GET /v1/evictions`` shows it."""
    rows = create_app(mon).test_client().get("/v1/evictions").get_json()
    return {r["replica_id"]: r for r in reversed(rows)}


@pytest.fixture
def job():
    j = SimJob(4, ranks_per_group=2)
    yield j
    j.stop()


def test_an_interrupted_kill_that_reached_the_manager_is_sent_and_its_orphans_told(tmp_path,
                                                                                    job):
    """The Lighthouse's kill reaches only group rank 0 (the Manager); a bare group rank 1 lives
    on. A kill the previous run left ``sending`` whose Manager is gone and which the Lighthouse
    no longer hears landed: ``sent``, its orphan told to exit. Before, the orphan still
    reporting the replica id made it ``failed`` (a false audit row, the orphan never told, the
    replica evicted again). A replica whose rank 0 still answers, or which the Lighthouse still
    hears, was never reached: ``failed`` as before."""
    rid1, rid2, rid3 = (job.replica_ids[g] for g in (1, 2, 3))
    store = Store(str(tmp_path / "state.sqlite"))
    for g in (1, 2):
        store.add_decision(replica_group=g, replica_id=job.replica_ids[g], decision="evict",
                           reason="hang", detail="hang confirmed", status="sending",
                           at=time.time() - 30)
    store.close()
    for g in (1, 3):  # the Manager of group 1 killed, group 3's unreachable (see below)
        job.sim.group(g)[0].set_mode("down")
    job.alive.discard(1)
    mon = monitor(tmp_path, job, time.time, rank_exit_token="exit-tok")
    read = mon.lighthouse_reader.read

    def without_group_1():  # its heartbeats stopped (its last quorum still lists it)
        status, error = read()
        if status is not None:
            status = dataclasses.replace(status, heartbeats={
                k: v for k, v in status.heartbeats.items() if k != rid1})
        return status, error

    mon.lighthouse_reader.read = without_group_1
    try:
        mon.sweep_once()
        rows = evictions(mon)
        orphan = job.sim.group(1)[1]
        assert rows[rid1]["status"] == "sent", rows[rid1]
        assert "told rank(s)" in rows[rid1]["detail"] and orphan.url in rows[rid1]["detail"]
        assert rows[rid2]["status"] == "failed", rows[rid2]  # its rank 0 answers

        # without a Lighthouse reading the kill is judged by the group's rank 0 alone: group
        # 3's is down, yet the Lighthouse still hears it (sweep_once would say failed)
        mon.store.add_decision(replica_group=3, replica_id=rid3, decision="evict",
                               reason="hang", detail="hang confirmed", status="interrupted",
                               at=time.time() - 30)
        mon.enforcer.confirm_evictions(mon.view, mon.evidence, time.time())
        assert evictions(mon)[rid3]["status"] == "sent"
        mon.sweep_once()  # a sent kill: no second verdict of the interrupted kind
        assert evictions(mon)[rid3]["status"] == "sent"
    finally:
        mon.stop()


def test_an_unconfirmed_kill_leaves_its_replica_to_the_dead_detector(tmp_path):
    """A kill the Lighthouse took that never landed turns ``unconfirmed``: the replica lives
    and was told nothing. When it then really dies, ``dead`` is reported. Before, its replica
    id stayed in the set the detectors leave alone (resolved ``evicted``, never reported)."""
    job = SimJob(3, heartbeat_timeout_ms=500)
    for r in job.sim.ranks:  # a host per group: an offence would name one
        r.update(host=f"host-{r.state['replica_group']}")
    skew = [0.0]
    job.kill = lambda replica_id: False  # the front's kill lands nowhere
    mon = monitor(tmp_path, job, lambda: time.time() + skew[0], confirm_timeout_s=1.0,
                  detectors=DetectorConfig(dead_sweeps=1))
    try:
        client = create_app(mon).test_client()
        mon.sweep_once()
        r = client.post("/v1/evict", json={"replica_group": 1, "reason": "test"},
                        headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.get_json()["sent"] is True, r.get_data(as_text=True)
        # the answer's reason is the audit row's, and the operator's why is in its detail
        (row,) = client.get("/v1/evictions").get_json()
        assert r.get_json()["reason"] == row["reason"] == "manual"
        assert "(given: test)" in row["detail"]
        skew[0] += 2.0  # past confirm_timeout_s, the group still answering
        mon.sweep_once()
        rid = job.replica_ids[1]
        assert evictions(mon)[rid]["status"] == "unconfirmed"
        job.alive.discard(1)
        job.sim.group(1)[0].set_mode("down")  # now it dies for real
        for _ in range(3):
            skew[0] += 1.0
            mon.sweep_once()
        dead = [f for f in client.get("/v1/findings").get_json()
                if f["kind"] == "dead" and f["replica_group"] == 1]
        assert dead and dead[0]["open"], dead
        # its end may be the monitor's own kill (a Manager gone, a bare rank up): once the
        # Lighthouse agrees it is gone, still no host's fault
        deadline = time.monotonic() + 10
        while mon.lighthouse_status is None or mon.lighthouse_status.heartbeating(rid):
            assert time.monotonic() < deadline, "the Lighthouse still hears the dead group"
            time.sleep(0.1)
            skew[0] += 0.2
            mon.sweep_once()
        mon.sweep_once()
        hosts = client.get("/v1/hosts").get_json()
        assert hosts["hosts"] == [] and hosts["decisions"] == [], hosts
    finally:
        mon.stop()
        job.stop()
