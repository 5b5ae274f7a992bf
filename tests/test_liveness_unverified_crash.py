"""A rank that crashes in its first second under its torchft Manager, before the monitor ever
verified it (read without its replica id), then torchrun's agent SIGTERMs its peers, which say
they stopped (docs/worker_server.md, Stopping): the crash is still found ``dead`` and held
against its host; a planned stop of the whole group at that moment is not, nor a "crash" whose
unverified claims do not fit the group (a slot outside it, a host none of its ranks is on).

A live monitor (real HTTP, real SQLite, an injected clock) over a real torchft Lighthouse that
simulated groups join (``SimJob``, tests/support/monitor_sim.py), the ranks registered with it
over HTTP as WorkerServers register (so a rank that said it stopped is forgotten at once).
"""

from __future__ import annotations

import time

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.config import MonitorConfig, RailsConfig
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob

TOKEN = "reg"
STOPPED = {"finished": True, "stopped_by": "SIGTERM", "phase": "stopped"}


def register(mon: Monitor, ranks, **target) -> None:
    """Register ``ranks`` with the monitor as their WorkerServers do (``target``: one more row)."""
    rows = [{"url": r.url, "job": "sim", "rank": r.state["rank"],
             "replica_group": r.state["replica_group"]} for r in ranks]
    for body in rows + ([{"job": "sim", **target}] if target else []):
        res = requests.post(mon.url + "/v1/targets", timeout=10,
                            headers={"Authorization": f"Bearer {TOKEN}"}, json=body)
        assert res.status_code == 200, res.text


@pytest.fixture
def job():
    j = SimJob(2, ranks_per_group=2, heartbeat_timeout_ms=1000, join_timeout_ms=1000)
    for r in j.sim.ranks:
        r.update(job="sim", host=f"host-{r.state['replica_group']}")  # a node a group
    yield j
    j.stop()


@pytest.mark.parametrize("stop,listed", [("crash", False), ("crash", True), ("planned", False),
                                         ("slot", False), ("host", False), ("ghost", False)])
def test_a_rank_crashed_before_it_was_verified_is_dead_when_its_peer_says_it_stopped(
        tmp_path, job, stop, listed):
    """``listed``: static targets (the stopped peer stays in sight), else registered ranks."""
    manager, peer = job.sim.group(1)  # group ranks 0 (its Manager) and 1: global 1 and 3
    rid = job.replica_ids[1]
    for r in (manager, peer):  # before their Manager's replica id was read
        r.update(replica_id=None, quorum_id=-1, phase="starting", step=0)
    if stop == "slot":  # a stranger's claims: group rank 7 of a group of 2
        manager.update(group_rank=7)
    elif stop == "host":  # or a host of another group's, to be quarantined
        manager.update(host="host-0")
    skew = [0.0]
    cfg = MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
                        sd_out=str(tmp_path / "targets.json"), job="sim", lighthouse=job.url,
                        register_token=TOKEN, forget_after_s=600,
                        targets=job.sim.urls if listed else [],
                        rails=RailsConfig(min_replicas=1, cooldown_s=0))
    mon = Monitor(cfg, clock=lambda: time.time() + skew[0]).start()  # sweeps once, then waits

    def sweep() -> None:
        skew[0] += 1.0
        for r in job.sim.group(0):
            r.update(step=r.state["step"] + 5, commits=r.state["commits"] + 5,
                     last_step_at=time.time() + skew[0])
        mon.sweep_once()

    def get(path: str):
        return requests.get(mon.url + path, timeout=10).json()

    try:
        wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
        register(mon, [] if listed else job.sim.ranks)
        if stop == "ghost":  # and a rank of group 1 that never answered a poll: no state
            register(mon, [], url="http://127.0.0.1:1", rank=5, replica_group=1)
        sweep()
        sweep()
        verdicts = {r["rank"]: r["verification"]["reason"] for r in get("/v1/ranks")
                    if r["rank"] != 5}
        assert verdicts == {0: "ok", 1: "no_replica_id", 2: "ok", 3: "no_replica_id"}

        # its first heal fails (the Manager's rank exits at once), torchrun SIGTERMs the peer
        # (already in the quorum: read with the replica id); a planned stop: both SIGTERMed
        job.alive.discard(1)  # the Manager's heartbeats end with it
        peer.update(replica_id=rid, quorum_id=job.quorum_id, **STOPPED)
        if stop != "planned":
            manager.set_mode("down")
        else:
            manager.update(**STOPPED)
        sweep()  # the stop read
        manager.set_mode("down")
        peer.set_mode("down")
        if stop not in ("crash", "ghost"):
            for _ in range(6):
                sweep()
            assert get("/v1/findings") == []
            assert get("/v1/hosts")["hosts"] == []
            return

        def offence() -> list:
            sweep()
            return get("/v1/hosts")["hosts"]

        # counted once the Lighthouse no longer hears the replica (its heartbeat timeout)
        hosts = wait_until(offence, 30, interval=0.2, what="the crash held against its host")
        assert [(h["host"], [(o["kind"], o["ranks"]) for o in h["offences"]])
                for h in hosts] == [("host-1", [("dead", [1])])], hosts
        [f] = get("/v1/findings")
        assert (f["kind"], f["replica_group"], f["replica_id"], f["ranks"], f["open"]) == \
            ("dead", 1, rid, [1], True), f
        assert [(c["url"], c["host"]) for c in f["evidence"]["culprits"]] == \
            [(manager.url, "host-1")]
    finally:
        mon.stop()


def test_a_crashed_rank_whose_peer_said_it_stopped_is_dead_of_a_group_of_its_size(tmp_path, job):
    """A verified group's rank 1 crashes, torchrun SIGTERMs its Manager's rank, which says it
    stopped and is forgotten: the ``dead`` finding still counts the group at its size."""
    manager, peer = job.sim.group(1)
    cfg = MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
                        job="sim", lighthouse=job.url, register_token=TOKEN, forget_after_s=600,
                        rails=RailsConfig(min_replicas=1, cooldown_s=0))
    mon = Monitor(cfg).start()
    try:
        wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
        register(mon, job.sim.ranks)
        mon.sweep_once()
        job.alive.discard(1)
        peer.set_mode("down")
        manager.update(**STOPPED)
        mon.sweep_once()  # the stop read: forgotten once it no longer answers
        manager.set_mode("down")

        def dead():
            mon.sweep_once()
            return [f for f in requests.get(mon.url + "/v1/findings", timeout=10).json()
                    if f["kind"] == "dead"]
        [f] = wait_until(dead, 30, interval=0.2, what="the crash found dead")
        assert f["ranks"] == [3], f
        assert f["evidence"]["summary"].startswith("1 of the group's 2 rank(s)"), f
    finally:
        mon.stop()
