"""A stall held by an evicted group is one stall: the group partitioned off is evicted and its warm
spare restarts with a new replica id at the same group number while torchft still counts the old
one in the quorum the survivors wait in (a real Lighthouse: tests/support/monitor_sim.py)."""

from __future__ import annotations

import uuid

import pytest

from tests.support.monitor_sim import SimJob
from tests.test_audit_false_positives import _wait_cross
from tests.test_monitor_network import CUT_OFF, TOKEN, Clock, Driver, Training, links, monitor


@pytest.fixture
def job():
    j = SimJob(4, ranks_per_group=2, heartbeat_timeout_ms=1000)
    yield j
    j.stop()


def test_a_replacement_with_a_new_id_opens_no_second_stall_while_the_old_one_holds(tmp_path,
                                                                                    job):
    """One job_stall row, explained; the evicted group's network finding ends with its
    incarnation, not as `job_recovered` while the survivors still wait for it."""
    clock = Clock()
    job.sim.probe_token = TOKEN
    d = Driver(monitor(tmp_path, job, clock, rank_exit_token=TOKEN), Training(job), clock)
    job.sim.links = links(job, "h1", CUT_OFF)  # the hosts named by Training
    try:
        d.sweeps(4)
        old, q = job.replica_ids[1], job.quorum_id
        d.train.stall(4.0, d.clock.t)
        d.until(lambda: job.kills, "the partitioned group evicted", steps=0)
        assert job.kills == [old]

        def survivors_wait(secs: float) -> None:
            for g in (0, 2, 3):
                for r in job.sim.group(g):
                    _wait_cross(r, "allreduce", secs, d.clock.t + 1.0)

        survivors_wait(6.0)
        d.sweep(steps=0)  # the evicted group holds the stall: explained
        # its warm spare on another host: a new incarnation of group 1 asking to join, which the
        # Lighthouse hears; the survivors still wait in quorum q, the old id a member of it
        job.replica_ids[1] = new = f"replica_group_1:{uuid.uuid4()}"
        for r in job.sim.group(1):
            r.set_mode("ok")
            _wait_cross(r, "quorum", 0.5, d.clock.t, replica_id=new, quorum_id=q - 1,
                        host="h4", node="node-4", pid=r.state["pid"] + 5000,
                        started_at=d.clock.t - 2)
        job.sim.links = links(job, "h1", CUT_OFF)
        job.alive.add(1)
        survivors_wait(7.0)
        d.until(lambda: d.mon.cluster_json(ranks=False)["groups"][1]["replica_id"] == new,
                "the spare verified (the Lighthouse hears it)", steps=0)
        d.sweeps(2, steps=0)
        assert old in d.mon.lighthouse_status.members  # torchft has not dropped it yet
        rows = d.mon.store.findings()
        assert [f["kind"] for f in rows if f["kind"] == "job_stall"] == ["job_stall"]
        (net,) = [f for f in rows if f["kind"] == "network"]
        assert net["replica_id"] == old and net["resolution"] != "job_recovered"
        assert d.mon.detectors.job_findings() == []
        job.requorum()  # the survivors aborted, the spare joins: torchft dropped the old id
        d.sweeps(2)
        assert old not in d.mon.lighthouse_status.members
        assert not d.mon.detectors.probes_wanted()  # held no more
        assert [f["kind"] for f in d.mon.store.findings() if f["kind"] == "job_stall"] == [
            "job_stall"]
    finally:
        d.mon.stop()
