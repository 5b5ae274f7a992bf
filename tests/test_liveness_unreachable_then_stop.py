"""A rank the monitor read, then could not reach (its port filtered) while its group kept
committing (torchft commits only with every rank of the group: it lived), is not a crash when
the group is stopped on purpose later: its Manager's stop notice finds it long down, not down
just before (torchrun stops a crashed worker's peers within seconds). No ``dead`` finding, no
offence against its host, whether it was verified or only read before its Manager existed.

The same live monitor over a real Lighthouse as tests/test_liveness_unverified_crash.py.
"""

from __future__ import annotations

import time

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.config import MonitorConfig, RailsConfig
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob
from tests.test_liveness_unverified_crash import STOPPED, TOKEN


@pytest.mark.parametrize("verified", [True, False])
def test_a_rank_its_group_committed_past_is_not_dead_at_a_planned_stop(tmp_path, verified):
    job = SimJob(2, ranks_per_group=2, heartbeat_timeout_ms=1000, join_timeout_ms=1000)
    for r in job.sim.ranks:
        r.update(job="sim", host=f"host-{r.state['replica_group']}")
    manager, peer = job.sim.group(1)  # group ranks 0 and 1 (global 1 and 3)
    rid = job.replica_ids[1]
    if not verified:  # read once before its Manager existed
        peer.update(replica_id=None, quorum_id=-1, phase="starting", step=0)
    skew = [0.0]
    cfg = MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
                        sd_out=str(tmp_path / "targets.json"), job="sim", lighthouse=job.url,
                        register_token=TOKEN, forget_after_s=600,
                        rails=RailsConfig(min_replicas=1, cooldown_s=0))
    mon = Monitor(cfg, clock=lambda: time.time() + skew[0]).start()

    def sweep() -> None:
        skew[0] += 1.0
        for g in (0, 1):  # both groups train: group 1 commits, so its unreachable peer lives
            for r in job.sim.group(g):
                r.update(step=r.state["step"] + 5, commits=r.state["commits"] + 5,
                         last_step_at=time.time() + skew[0])
        mon.sweep_once()

    def get(path: str):
        return requests.get(mon.url + path, timeout=10).json()

    try:
        wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
        for r in job.sim.ranks:
            res = requests.post(mon.url + "/v1/targets", timeout=10,
                                headers={"Authorization": f"Bearer {TOKEN}"},
                                json={"url": r.url, "job": "sim", "rank": r.state["rank"],
                                      "replica_group": r.state["replica_group"]})
            assert res.status_code == 200, res.text
        sweep()
        sweep()
        verdicts = {r["rank"]: r["verification"]["reason"] for r in get("/v1/ranks")}
        assert verdicts[3] == ("ok" if verified else "no_replica_id"), verdicts
        peer.set_mode("down")  # the monitor cannot reach it; it trains on
        for _ in range(2 * cfg.detectors.dead_sweeps + 4):
            sweep()
        assert get("/v1/findings") == []
        manager.update(**STOPPED)  # a planned stop; the peer's own notice never gets through
        sweep()
        manager.set_mode("down")
        job.alive.discard(1)

        def gone() -> bool:  # a dead finding is counted once the Lighthouse agrees
            sweep()
            st = mon.lighthouse_status
            return st is not None and not st.heartbeating(rid)

        wait_until(gone, 30, interval=0.2, what="the Lighthouse to stop hearing group 1")
        for _ in range(cfg.detectors.dead_sweeps + 2):
            sweep()
        assert [(f["kind"], f["ranks"]) for f in get("/v1/findings")
                if f["kind"] in ("dead", "dead_rank")] == []
        assert get("/v1/hosts")["hosts"] == []
    finally:
        mon.stop()
        job.stop()
