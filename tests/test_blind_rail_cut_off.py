"""The monitor_blind rail evicts no healthy group the monitor is merely cut off from
(Enforcer.blind_to_kills, docs/monitor.md: Eviction and safety rails), and an open ``dead``
finding of a group whose own ranks answer again, verified or not, is over (Liveness.dead).

A single monitor of 2 simulated groups in a real torchft job (``SimJob``: a real Lighthouse,
a kill recorded in ``job.kills`` and taking the group down), ``--evict-on dead``,
``--min-replicas 1``, ``--cooldown 0``, the default ``--min-reachable 0.5``. The monitor alone
loses group 1 (its ranks answer it nothing; its Manager heartbeats on), swept by hand.
"""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from torchft.coordination import LighthouseClient

from lightkeeper.processes import wait_until
from monitor.config import DetectorConfig, MonitorConfig, RailsConfig
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob


@pytest.fixture
def cut_off(tmp_path, request):
    """(job, monitor) once the monitor has missed group 1 for --dead-sweeps sweeps (ranks per
    group: the parameter, else 1)."""
    job = SimJob(2, ranks_per_group=getattr(request, "param", 1), heartbeat_timeout_ms=1000)
    mon = Monitor(MonitorConfig(
        port=0, state_path=str(tmp_path / "m.sqlite"), targets=job.sim.urls, job="sim",
        lighthouse=job.url, lighthouse_heartbeat_timeout_ms=1000, poll_timeout_s=0.3,
        detectors=DetectorConfig(dead_sweeps=2),
        rails=RailsConfig(min_replicas=1, cooldown_s=0, evict_kinds=("dead",))))
    servers = []
    job.restarted = servers  # Lighthouses a test started, shut down with the job
    try:
        wait_until(lambda: mon.sweep_once() and mon.view.evidence().groups.keys() == {0, 1},
                   20, what="both groups verified")
        for r in job.sim.group(1):
            r.set_mode("silent")
        wait_until(lambda: mon.sweep_once() and all(
            r.failures >= 2 for r in mon.view.groups[1].ranks), 20, what="group 1 missed")
        yield job, mon
    finally:
        mon.stop()
        job.stop()
        for s in servers:
            s.shutdown()


def _restart_lighthouse(job: SimJob):
    """The Lighthouse restarts: group 0's Manager is back in a quorum of the new one first;
    group 1's (healthy) is not yet. Returns a client of the new one."""
    from torchft.coordination import LighthouseServer

    new = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=300,
                           heartbeat_timeout_ms=60_000)  # no heartbeat of this test goes old
    job.restarted.append(new)
    addr = "http://127.0.0.1:" + new.address().rsplit(":", 1)[1]
    client = LighthouseClient(addr=addr, connect_timeout=timedelta(seconds=5))
    rid = job.replica_ids[0]
    client.heartbeat(rid, timeout=timedelta(seconds=5))
    q = client.quorum(replica_id=rid, timeout=timedelta(seconds=10),
                      address="http://127.0.0.1:1/m0", store_address="127.0.0.1:1", step=100,
                      world_size=len(job.sim.group(0)), shrink_only=False)
    job.lighthouse_url = addr  # the front the monitor reads forwards to the new one
    for r in job.sim.group(0):
        r.update(quorum_id=int(q.quorum_id), num_participants=1)
    return client


def _decided(mon: Monitor, g: int) -> list[dict]:
    """The audit log's decisions on group ``g``, after one more sweep."""
    mon.sweep_once()
    return [d for d in mon.store.decisions() if d["replica_group"] == g]


def _open_dead(mon: Monitor, g: int) -> bool:
    mon.sweep_once()
    return any(f["kind"] == "dead" and f["replica_group"] == g
               for f in mon.store.findings(open_only=True))


def test_a_restarted_lighthouse_not_hearing_a_group_yet_evicts_it_not(cut_off):
    """The restarted Lighthouse's first status lacks group 1: ``dead`` is confirmed (nothing
    hears it), but the Lighthouse does not list it as heard and stopped, so its ranks still
    count: the monitor reaches 50 % and holds. Before, any status lacking it counted it gone
    and the healthy group was evicted."""
    job, mon = cut_off
    _restart_lighthouse(job)
    rows = wait_until(lambda: _decided(mon, 1), 20, what="a decision on group 1")
    assert job.kills == []
    assert [(d["decision"], d["reason"]) for d in rows] == [("hold", "monitor_blind")]
    mon.sweep_once()
    # nor is it its host's offence (GET /v1/hosts): the Lighthouse never said it stopped
    assert [h["offences"] for h in mon.enforcer.hosts_json()["hosts"]] in ([], [[]])


def test_a_group_restarted_behind_the_cut_is_not_evicted_by_its_old_id(cut_off):
    """Group 1 restarts behind the monitor's cut under a new replica id: the Lighthouse lists
    the old one as stopped and hears the new one, which no rank the monitor reaches reports
    (it may be the lost group's new incarnation): the old id counts, 50 %, held."""
    job, mon = cut_off
    old = job.replica_ids[1]
    job.replica_ids[1] = f"replica_group_1:{uuid.uuid4()}"  # heartbeats go on under it
    job.requorum()
    rows = wait_until(lambda: _decided(mon, 1), 20, what="a decision on group 1")
    assert job.kills == []
    assert [(d["decision"], d["reason"], d["replica_id"]) for d in rows] == [
        ("hold", "monitor_blind", old)]


def test_a_dead_finding_ends_when_its_ranks_answer_unverified(cut_off):
    """After the restart the ``dead`` of group 1 is open and held. The cut heals: group 1's
    rank answers with its replica id, but at the old Lighthouse's quorum, so it is not
    verified (the rail does not count it). Its finding is over, not evicted: before, the rail
    saw 100 % and the healthy group was killed (every rank told to exit, the kill finding it
    out of the new quorum)."""
    job, mon = cut_off
    client = _restart_lighthouse(job)
    wait_until(lambda: _open_dead(mon, 1), 20, what="group 1's dead confirmed")
    client.heartbeat(job.replica_ids[1], timeout=timedelta(seconds=5))  # its Manager back
    for r in job.sim.group(1):
        r.set_mode("ok")
    wait_until(lambda: mon.sweep_once() and mon.view.groups[1].reachable, 20,
               what="group 1 answering")
    assert 1 not in mon.view.evidence().groups  # not verified
    mon.sweep_once()
    assert job.kills == []
    assert not [d for d in mon.store.decisions() if d["decision"] == "evict"]
    dead = [f for f in mon.store.findings() if f["kind"] == "dead"]
    assert [(f["replica_group"], f["resolution"]) for f in dead] == [(1, "reachable")]


@pytest.mark.parametrize("cut_off", [2], indirect=True)
def test_a_dead_finding_ends_when_its_managers_rank_answers_unverified(cut_off):
    """As above with two ranks a group, the cut healing for group 1's rank 0 (its Manager's)
    only: the group stays in the evidence by its silent verified rank, so the rail reads 2 of
    3 ranks; the finding is over, not evicted (before: evicted, every rank told to exit)."""
    job, mon = cut_off
    client = _restart_lighthouse(job)
    wait_until(lambda: _open_dead(mon, 1), 20, what="group 1's dead confirmed")
    client.heartbeat(job.replica_ids[1], timeout=timedelta(seconds=5))  # its Manager back
    job.sim.group(1)[0].set_mode("ok")
    wait_until(lambda: mon.sweep_once() and len(mon.view.groups[1].reachable) == 1, 20,
               what="group 1's rank 0 answering")
    mon.sweep_once()
    assert job.kills == []
    dead = [f for f in mon.store.findings() if f["kind"] == "dead"]
    assert [(f["replica_group"], f["resolution"]) for f in dead] == [(1, "reachable")]


def test_a_spares_heartbeat_holds_no_dead_groups_eviction(tmp_path):
    """Group 1 dies (its ranks silent, its Manager's heartbeats stop) while a torchft spare
    heartbeats under its own id, which no rank reports: not group 1's new incarnation (another
    replica id before its uuid), so the group counts gone and is evicted (before: held blind
    as long as the spare lived)."""
    job = SimJob(2, heartbeat_timeout_ms=1000)
    mon = Monitor(MonitorConfig(
        port=0, state_path=str(tmp_path / "m.sqlite"), targets=job.sim.urls, job="sim",
        lighthouse=job.url, lighthouse_heartbeat_timeout_ms=1000, poll_timeout_s=0.3,
        detectors=DetectorConfig(dead_sweeps=2),
        rails=RailsConfig(min_replicas=1, cooldown_s=0, evict_kinds=("dead",))))
    stop = threading.Event()

    def spare() -> None:
        c = LighthouseClient(addr=job.grpc_addr, connect_timeout=timedelta(seconds=5))
        sid = f"spare_0:{uuid.uuid4()}"
        while not stop.is_set():
            c.heartbeat(sid, timeout=timedelta(seconds=1))
            stop.wait(0.2)

    t = threading.Thread(target=spare, daemon=True)
    try:
        wait_until(lambda: mon.sweep_once() and mon.view.evidence().groups.keys() == {0, 1},
                   20, what="both groups verified")
        t.start()
        for r in job.sim.group(1):
            r.set_mode("silent")
        job.alive.discard(1)  # its Manager is gone: heartbeats stop
        wait_until(lambda: mon.sweep_once() and job.kills, 20, what="group 1 evicted")
        assert job.kills == [job.replica_ids[1]]
    finally:
        stop.set()
        t.join(timeout=5)
        mon.stop()
        job.stop()
