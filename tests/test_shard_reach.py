"""A shard's reach leaves out the groups gone, by the single monitor's rule (monitor/shard.py,
Enforcer.blind_to_kills; docs/scaling.md): a kill of its slice blinds it to no later one, and a
dead group of its slice does not blind it to that group's own eviction.

Real etcd (tests/test_monitor_shard.py), a real torchft Lighthouse the simulated groups join
(``SimJob``: a kill takes its group down as an exiting Manager would), monitors of shards and a
leader in this process, swept and ticked by hand.
"""

from __future__ import annotations

import time

import pytest

from lightkeeper.processes import wait_until
from monitor.config import DetectorConfig, MonitorConfig, RailsConfig, ShardConfig
from monitor.lease import Etcd
from monitor.service import Monitor
from monitor.shard import Leader, shard_of
from tests.support.monitor_sim import SimJob
from tests.test_monitor_shard import running_etcd
from tests.test_shard_decide import _open_mismatch
from tests.test_shard_rails import PREFIX, ROOT


@pytest.fixture
def etcd_url(tmp_path):
    with running_etcd(tmp_path) as url:
        yield url


def _monitor(tmp_path, job: SimJob, etcd_url: str, index: int | None, clock=None,
             rails: RailsConfig | None = None, dead_sweeps: int = 10) -> Monitor:
    """Shard ``index`` of 2 (None: a leader candidate without a slice) on the real etcd and
    Lighthouse, the default rails unless ``rails``."""
    return Monitor(MonitorConfig(
        port=0, state_path=str(tmp_path / f"m{index}.sqlite"), targets=job.sim.urls, job="sim",
        lighthouse=job.url, lighthouse_heartbeat_timeout_ms=1000,
        detectors=DetectorConfig(dead_sweeps=dead_sweeps), rails=rails or RailsConfig(),
        shard=ShardConfig(shards=2, index=index, etcd=etcd_url, etcd_prefix=PREFIX,
                          lease_ttl_s=5, lead=index is None)), clock=clock)


def _tick(leader: Leader) -> None:
    """One tick of Leader.run, on this thread."""
    assert leader.election.campaign()
    leader.lead_once()


@pytest.mark.parametrize("where", ["other_slice", "same_slice"])
def test_a_kill_of_a_slice_blinds_no_shard_to_the_next_fault(tmp_path, etcd_url, where):
    """2 shards x 2 groups at the default rails (--min-reachable 0.5, --min-replicas 2; the
    leader's clock moved past --cooldown). Group 0 (shard 0) mismatches and is killed: its ranks
    stop answering. Shard 0 then reaches 1 of the 2 groups' ranks it knows, but the killed one
    counts against no reach (a single monitor over the job reaches 3 of 4): its report is not
    blind, and a fault of group 1 (shard 1's) or of group 2 (shard 0's own other group) is
    evicted too."""
    assert [shard_of(g, 2) for g in range(4)] == [0, 1, 0, 1]
    job = SimJob(4, heartbeat_timeout_ms=1000)
    skew = [0.0]
    etcd = Etcd(etcd_url)
    shards = [_monitor(tmp_path, job, etcd_url, i) for i in (0, 1)]
    lead = _monitor(tmp_path, job, etcd_url, None, clock=lambda: time.time() + skew[0])
    leader = Leader(lead.shard.cfg, lead, ROOT)
    rid = job.replica_ids

    def sweep() -> None:
        for m in shards:
            m.sweep_once()

    def report(i: int) -> dict:
        return etcd.get(f"{ROOT}shards/{i}").json()

    try:
        wait_until(lambda: sweep() or all(m.view.evidence().groups.keys() == {i, i + 2}
                                          for i, m in enumerate(shards)), 20,
                   what="each shard verifying its 2 groups")
        _open_mismatch(shards[0], 0, rid[0])
        sweep()
        _tick(leader)
        assert job.kills == [rid[0]]
        wait_until(lambda: sweep() or not any(r.reachable for r in shards[0].view.groups[0]
                                              .ranks), 20, what="the killed group going down")
        sweep()
        assert report(0)["blind"] is None and report(1)["blind"] is None
        g = 1 if where == "other_slice" else 2
        _open_mismatch(shards[shard_of(g, 2)], g, rid[g])
        sweep()
        skew[0] += 61.0  # past the leader's --cooldown 60
        _tick(leader)
        assert leader.blind is None
        assert job.kills == [rid[0], rid[g]]
    finally:
        leader.election.resign()
        leader.lighthouse.close()
        leader.reader.close()
        leader.etcd.close()
        for m in (*shards, lead):
            m.stop()
        etcd.close()
        job.stop()


@pytest.mark.parametrize("sharded", [False, True])
def test_a_dead_group_is_evicted_by_its_shard_as_by_a_single_monitor_of_as_many(
        tmp_path, etcd_url, sharded):
    """--evict-on dead, --min-replicas 1, --cooldown 0, the default --min-reachable 0.5: group 0
    dies whole (its rank down, its heartbeats stopped). A single monitor of 2 groups and shard 0
    of 2 over 4 groups (its slice 2 groups) both reach 1 of the 2 groups they know, but the dead
    one, which the Lighthouse no longer hears, counts against no reach: it is evicted."""
    job = SimJob(4 if sharded else 2, heartbeat_timeout_ms=1000)
    rails = RailsConfig(min_replicas=1, cooldown_s=0, evict_kinds=("dead",))
    rid = job.replica_ids
    etcd = Etcd(etcd_url)
    mon = lead = leader = other = None
    try:
        if sharded:
            mon = _monitor(tmp_path, job, etcd_url, 0, rails=rails, dead_sweeps=2)
            lead = _monitor(tmp_path, job, etcd_url, None, rails=rails)
            leader = Leader(lead.shard.cfg, lead, ROOT)
            other = _monitor(tmp_path, job, etcd_url, 1)  # reports: the leader sees every slice
            want = {0, 2}
        else:
            mon = Monitor(MonitorConfig(
                port=0, state_path=str(tmp_path / "m.sqlite"), targets=job.sim.urls, job="sim",
                lighthouse=job.url, lighthouse_heartbeat_timeout_ms=1000,
                detectors=DetectorConfig(dead_sweeps=2), rails=rails))
            want = {0, 1}
        wait_until(lambda: mon.sweep_once() and mon.view.evidence().groups.keys() == want, 20,
                   what="the groups verified")
        job.sim.group(0)[0].set_mode("down")
        job.alive.discard(0)

        def evicted() -> bool:
            for m in (mon, other):
                if m is not None:
                    m.sweep_once()
            if leader is not None:
                _tick(leader)
            return bool(job.kills)

        wait_until(evicted, 20, what="the dead group evicted")
        # (held as monitor_blind in a sweep the Lighthouse still heard its last heartbeat)
        assert job.kills == [rid[0]]
    finally:
        if leader is not None:
            leader.election.resign()
            leader.lighthouse.close()
            leader.reader.close()
            leader.etcd.close()
        for m in (mon, lead, other):
            if m is not None:
                m.stop()
        etcd.close()
        job.stop()
