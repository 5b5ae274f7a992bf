"""A rank the monitor read, then could not reach (its port filtered) while its group kept
committing (torchft commits only with every rank of the group: it lived), is not a crash when
the group is stopped on purpose later: its Manager's stop notice finds it long down, not down
just before (torchrun stops a crashed worker's peers within seconds). No ``dead`` finding, no
offence against its host, whether it was verified or only read before its Manager existed.
But a rank that crashes is found however its group got there: one that missed a poll long
before (it answered again), one killed while its Manager healed (a heal moves the step, not
the commits).

The same live monitor over a real Lighthouse as tests/test_liveness_unverified_crash.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.config import MonitorConfig, RailsConfig
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob
from tests.test_liveness_unverified_crash import STOPPED, TOKEN, register


@pytest.fixture
def job():
    j = SimJob(2, ranks_per_group=2, heartbeat_timeout_ms=1000, join_timeout_ms=1000)
    for r in j.sim.ranks:
        r.update(job="sim", host=f"host-{r.state['replica_group']}")
    yield j
    j.stop()


def live(tmp_path, job: SimJob, training: set[int], **rails) -> tuple[Monitor, Callable]:
    """A monitor with the job's ranks registered; its ``sweep()`` moves the clock a second and
    has the ``training`` groups commit 5 steps first."""
    skew = [0.0]
    cfg = MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
                        sd_out=str(tmp_path / "targets.json"), job="sim", lighthouse=job.url,
                        register_token=TOKEN, forget_after_s=600,
                        rails=RailsConfig(min_replicas=1, cooldown_s=0, **rails))
    mon = Monitor(cfg, clock=lambda: time.time() + skew[0]).start()

    def sweep() -> None:
        skew[0] += 1.0
        for g in training:
            for r in job.sim.group(g):
                r.update(step=r.state["step"] + 5, commits=r.state["commits"] + 5,
                         last_step_at=time.time() + skew[0])
        mon.sweep_once()

    try:
        wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
        register(mon, job.sim.ranks)
    except BaseException:
        mon.stop()
        raise
    return mon, sweep


def get(mon: Monitor, path: str):
    return requests.get(mon.url + path, timeout=10).json()


def dead(mon: Monitor) -> list:
    return [(f["kind"], f["ranks"]) for f in get(mon, "/v1/findings")
            if f["kind"] in ("dead", "dead_rank")]


def stop_group_1(job: SimJob, mon: Monitor, sweep: Callable) -> None:
    """Group 1's Manager says it stopped, then goes; swept until the Lighthouse agrees and
    ``--dead-sweeps`` more."""
    manager = job.sim.group(1)[0]
    manager.update(**STOPPED)
    sweep()
    manager.set_mode("down")
    job.alive.discard(1)

    def gone() -> bool:  # a dead finding is counted once the Lighthouse agrees
        sweep()
        st = mon.lighthouse_status
        return st is not None and not st.heartbeating(job.replica_ids[1])

    wait_until(gone, 30, interval=0.2, what="the Lighthouse to stop hearing group 1")
    for _ in range(mon.cfg.detectors.dead_sweeps + 2):
        sweep()


def blip(peer, sweep: Callable) -> None:
    """One poll of ``peer`` fails (a timeout under load); it trains on, answering again."""
    peer.set_mode("down")
    sweep()
    peer.set_mode("ok")
    for _ in range(5):
        sweep()


@pytest.mark.parametrize("verified", [True, False])
def test_a_rank_its_group_committed_past_is_not_dead_at_a_planned_stop(tmp_path, job, verified):
    manager, peer = job.sim.group(1)  # group ranks 0 and 1 (global 1 and 3)
    if not verified:  # read once before its Manager existed
        peer.update(replica_id=None, quorum_id=-1, phase="starting", step=0)
    mon, sweep = live(tmp_path, job, {0, 1})  # group 1 commits, so its unreachable peer lives
    try:
        sweep()
        sweep()
        verdicts = {r["rank"]: r["verification"]["reason"] for r in get(mon, "/v1/ranks")}
        assert verdicts[3] == ("ok" if verified else "no_replica_id"), verdicts
        peer.set_mode("down")  # the monitor cannot reach it; it trains on
        for _ in range(2 * mon.cfg.detectors.dead_sweeps + 4):
            sweep()
        assert get(mon, "/v1/findings") == []
        stop_group_1(job, mon, sweep)  # a planned stop; the peer's own notice never gets through
        assert dead(mon) == []
        assert get(mon, "/v1/hosts")["hosts"] == []
    finally:
        mon.stop()


@pytest.mark.parametrize("before", ["blip", "heal"])
def test_a_crash_torchrun_stops_the_group_after_is_dead(tmp_path, job, before):
    """``blip``: the crashed rank missed a poll long before; ``heal``: its Manager healed (its
    step jumped to the quorum's) between the crash and torchrun's SIGTERM."""
    manager, peer = job.sim.group(1)
    training = {0, 1}
    mon, sweep = live(tmp_path, job, training)
    try:
        sweep()
        sweep()
        if before == "blip":
            blip(peer, sweep)
            assert get(mon, "/v1/findings") == []
        training.discard(1)  # rank 3 crashes: group 1 commits nothing more
        peer.set_mode("down")
        sweep()
        if before == "heal":
            manager.update(step=manager.state["step"] + 40, heals=1)
        stop_group_1(job, mon, sweep)
        assert dead(mon) == [("dead", [3])]
        assert [h["host"] for h in get(mon, "/v1/hosts")["hosts"]] == ["host-1"]
    finally:
        mon.stop()


@pytest.mark.parametrize("before", ["blip", "heal"])
def test_a_crash_with_the_manager_up_is_dead_rank(tmp_path, job, before):
    """The same crash with no launcher to stop the group: its Manager heartbeats on."""
    manager, peer = job.sim.group(1)
    training = {0, 1}
    mon, sweep = live(tmp_path, job, training, dry_run=True)
    try:
        sweep()
        sweep()
        if before == "blip":
            blip(peer, sweep)
        training.discard(1)
        peer.set_mode("down")
        sweep()
        if before == "heal":
            manager.update(step=manager.state["step"] + 40, heals=1)
        for _ in range(40):  # the group is seen held on the monitor's clock, a second a sweep
            sweep()
            if dead(mon):
                break
        assert dead(mon) == [("dead_rank", [3])]
    finally:
        mon.stop()


def test_a_restart_names_every_unsaid_rank_recorded_not_counted(tmp_path, job):
    """Rank 3, on its own host, cannot be reached while group 1 commits on (it lived); then
    the group's Manager crashes and torchrun restarts the group at once. Which of its ranks
    really crashed the monitor cannot tell (the lived one may have): the ``dead`` finding names
    every rank that went down unsaid, recorded against each host but counted against none."""
    manager, peer = job.sim.group(1)
    peer.update(host="host-1b")
    mon, sweep = live(tmp_path, job, {0, 1})
    try:
        sweep()
        sweep()
        peer.set_mode("down")
        for _ in range(6):
            sweep()
        assert get(mon, "/v1/findings") == []
        old, job.replica_ids[1] = job.replica_ids[1], f"replica_group_1:{uuid.uuid4()}"
        new, top = job.replica_ids[1], job.sim.group(0)[0].state["step"]
        for r in (manager, peer):  # restarted at their ports; they heal, committing from 0
            r.update(replica_id=new, pid=r.state["pid"] + 7000, started_at=time.time() + 100,
                     step=top, commits=0, heals=1)
        job.requorum()
        for _ in range(8):
            sweep()
        found = [(f["kind"], f["ranks"], f["replica_id"]) for f in get(mon, "/v1/findings")]
        assert found == [("dead", [1, 3], old)]
        hosts = get(mon, "/v1/hosts")
        assert {h["host"]: [(o["ranks"], o["counts"]) for o in h["offences"]]
                for h in hosts["hosts"]} == {"host-1": [([1], False)], "host-1b": [([3], False)]}
        assert hosts["decisions"] == [] and hosts["quarantined"] == []
    finally:
        mon.stop()
