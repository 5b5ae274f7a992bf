"""A sent kill is confirmed on ranks the monitor saw gone once the Lighthouse no longer hears
the replica, never in a sweep where it is blind (monitor/act/confirm.py; docs/monitor.md,
Eviction and safety rails).

A monitor swept by hand over a real torchft Lighthouse that simulated groups join (``SimJob``,
tests/support/monitor_sim.py), its clock injected. The Lighthouse's heartbeat timeout is 1 s:
a killed group's heartbeat turns old that long after its kill.
"""

from __future__ import annotations

import time

import pytest

from lightkeeper.processes import wait_until
from monitor.api.app import create_app
from monitor.config import BundleConfig, MonitorConfig, RailsConfig
from monitor.evidence.lighthouse_status import LighthouseReader
from monitor.service import Monitor
from monitor.store import Store
from tests.support.monitor_sim import SimJob

TOKEN = "s3cret"


@pytest.fixture
def job():
    j = SimJob(3, heartbeat_timeout_ms=1000)
    yield j
    j.stop()


def monitor(tmp_path, job: SimJob, skew: list[float], targets=None) -> Monitor:
    return Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "state.sqlite"),
                                 targets=job.sim.urls if targets is None else targets,
                                 job="sim", lighthouse=job.url,
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


def lighthouse_drops(job: SimJob, *replica_ids: str) -> None:
    """Until the Lighthouse's /status no longer hears any of ``replica_ids`` (polled)."""
    reader = LighthouseReader(job.url)

    def dropped() -> bool:
        status, _ = reader.read()
        return status is not None and not any(status.heartbeating(r) for r in replica_ids)

    try:
        wait_until(dropped, 10, interval=0.05, what="the Lighthouse to drop the replica")
    finally:
        reader.close()


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
    ``confirmed`` (left the quorum) at the first sweep that reaches the other ranks again, the
    Lighthouse no longer hearing it."""
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

        lighthouse_drops(job, rid)
        set_modes(job, (0, 2), "ok")
        skew[0] += 1.0
        mon.sweep_once()
        row = eviction(client, rid)
        assert row["status"] == "confirmed" and "left the quorum" in row["detail"], row
        assert "the Lighthouse no longer hears it" in row["detail"], row
    finally:
        mon.stop()


def test_a_confirmed_kill_names_the_lighthouses_quorum_that_dropped_it(tmp_path, job):
    """The detail named the quorum the survivors last reported, which may still hold the killed
    group (the demo's read "quorum_id 6, 3 participants" for a group that had left): once the
    Lighthouse issued a quorum without it, that quorum is the one named."""
    skew = [0.0]
    mon = monitor(tmp_path, job, skew)
    try:
        client = create_app(mon).test_client()

        def known() -> bool:  # a sweep under load may miss a rank's answer: swept again
            mon.sweep_once()
            return all(g["replica_id"] for g in client.get("/v1/cluster").get_json()["groups"])

        wait_until(known, 20, interval=0.05, what="every group's replica id")
        before = job.quorum_id
        rid = job.replica_ids[1]
        evict(client, 1)
        lighthouse_drops(job, rid)
        after = job.requorum()  # the survivors' next quorum, without group 1
        assert after != before
        skew[0] += 1.0
        mon.sweep_once()
        row = eviction(client, rid)
        assert row["status"] == "confirmed", row
        assert f"the Lighthouse's quorum {after}: 2 participants without it" in row["detail"], row
    finally:
        mon.stop()


def test_the_monitors_own_kills_do_not_blind_it_to_their_confirmation(tmp_path, job):
    """Two of three groups killed: most ranks it knows stop answering, because of its kills.
    Those ranks do not count against its reach: both kills are confirmed at the first sweep
    after the Lighthouse stopped hearing them."""
    skew = [0.0]
    mon = monitor(tmp_path, job, skew)
    try:
        client = create_app(mon).test_client()
        mon.sweep_once()
        evict(client, 1)
        evict(client, 2)
        lighthouse_drops(job, job.replica_ids[1], job.replica_ids[2])
        skew[0] += 1.0
        mon.sweep_once()
        assert client.get("/v1/cluster").get_json()["reachable_fraction"] <= 0.5
        for g in (1, 2):
            row = eviction(client, job.replica_ids[g])
            assert row["status"] == "confirmed" and "left the quorum" in row["detail"], row
    finally:
        mon.stop()


def test_a_kill_is_not_confirmed_while_the_lighthouse_still_hears_the_replica(tmp_path, job):
    """The kill answered (sent) but delivered nowhere, and only the killed group's ranks are
    cut off from the monitor (the same name it cannot resolve): the sweep is not blind and no
    rank reports the replica. Before, that kill was ``confirmed`` ("left the quorum") for good
    while the Lighthouse still heard the replica; now it stays ``sent`` and turns
    ``unconfirmed`` after the confirmation window."""
    job.kill = lambda replica_id: False  # the front answers 500; nothing dies, it heartbeats on
    skew = [0.0]
    mon = monitor(tmp_path, job, skew)
    try:
        client = create_app(mon).test_client()
        mon.sweep_once()
        rid = job.replica_ids[1]
        evict(client, 1)
        set_modes(job, (1,), "down")
        skew[0] += 1.0
        mon.sweep_once()
        row = eviction(client, rid)
        assert row["status"] == "sent" and row["confirmed_at"] is None, row

        skew[0] += 5.0  # past confirm_timeout_s
        mon.sweep_once()
        row = eviction(client, rid)
        assert row["status"] == "unconfirmed" and row["confirmed_at"] is None, row
        assert "the Lighthouse still hears it after 5s" in row["detail"], row
        assert "left the quorum" not in row["detail"]
    finally:
        mon.stop()


def only_group_killed(tmp_path, job: SimJob, skew: list[float],
                      rows: dict[str, str]) -> Monitor:
    """A monitor restarted over kills of the only group it knows (group 1's ranks: a shard's
    slice of one group), the previous run's rows ``{replica_id: status}`` (``sending``: it
    stopped before recording the outcome)."""
    store = Store(str(tmp_path / "state.sqlite"))
    for rid, status in rows.items():
        store.add_decision(replica_group=1, replica_id=rid, decision="evict", reason="hang",
                           detail="hang confirmed; kill: sent", status=status,
                           at=time.time() - 1.0)
    store.close()
    return monitor(tmp_path, job, skew, targets=[r.url for r in job.sim.group(1)])


def test_kills_of_the_only_group_known_are_confirmed_by_the_lighthouse(tmp_path, job):
    """No rank is left to judge the monitor's reach by once its only group's targets go: the
    Lighthouse, read, judges alone. The kill sent is confirmed once it no longer hears the
    replica; one the previous run left ``sending``, of an earlier incarnation it never hears,
    at once. Before, every sweep was blind: ``sent`` and ``interrupted`` for good, past the
    confirmation window."""
    skew = [0.0]
    rid, before = job.replica_ids[1], "replica_group_1:before"
    mon = only_group_killed(tmp_path, job, skew, {rid: "sent", before: "sending"})
    try:
        client = create_app(mon).test_client()
        job.kill(rid)  # its ranks go, its heartbeats stop
        mon.sweep_once()
        assert eviction(client, before)["status"] == "confirmed"
        lighthouse_drops(job, rid)
        skew[0] += 10.0  # past confirm_timeout_s
        mon.sweep_once()
        for r in (rid, before):
            row = eviction(client, r)
            assert row["status"] == "confirmed" and row["confirmed_at"] is not None, row
            assert "the Lighthouse no longer hears it" in row["detail"], row
    finally:
        mon.stop()


@pytest.mark.parametrize("status, judged", [("sent", "unconfirmed"), ("sending", "failed")])
def test_a_kill_of_the_only_group_known_the_lighthouse_still_hears_is_not_gone(
        tmp_path, job, status, judged):
    """The only group's ranks out of the monitor's reach, the Lighthouse hearing the replica
    past the confirmation window: the kill did not land (``unconfirmed``; one the previous run
    left ``sending`` is ``failed``, evicted again on fresh evidence only)."""
    skew = [0.0]
    rid = job.replica_ids[1]
    set_modes(job, (1,), "down")  # alive, heartbeating: only the monitor cannot reach it
    mon = only_group_killed(tmp_path, job, skew, {rid: status})
    try:
        client = create_app(mon).test_client()
        mon.sweep_once()
        assert eviction(client, rid)["status"] in ("sent", "interrupted")
        skew[0] += 10.0
        mon.sweep_once()
        row = eviction(client, rid)
        assert row["status"] == judged and row["confirmed_at"] is None, row
        assert "the Lighthouse still hears it after 5s" in row["detail"], row
    finally:
        mon.stop()
