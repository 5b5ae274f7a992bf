"""A monitor that runs for weeks over ranks that restart often: what churn leaves behind must
not grow for ever (docs/quarantine.md, The ledger; docs/monitor.md, Not done / known limits).

A live monitor (real HTTP, real SQLite, an injected clock that the test moves on) over a real
torchft Lighthouse that simulated groups join (``SimJob``, tests/support/monitor_sim.py: no
trainer; the test moves the ranks' steps, takes a rank down and restarts its group on a new host
with a new replica id, new ports, as a scheduler would after an eviction).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.config import MonitorConfig, QuarantineConfig, RailsConfig
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob, SimRank, rank_state

TOKEN = "reg"


@pytest.fixture
def job():
    j = SimJob(3, ranks_per_group=2, heartbeat_timeout_ms=1000, join_timeout_ms=1000)
    for r in j.sim.ranks:
        r.update(job="sim", host=f"first-{r.state['replica_group']}")
    yield j
    j.stop()


class Churn:
    """The monitor on an injected clock (wall time plus a skew the test adds) and the job's
    ranks registered with it over HTTP, as WorkerServers register."""

    def __init__(self, job: SimJob, mon: Monitor, skew: list[float]) -> None:
        self.job, self.mon, self.skew = job, mon, skew

    def register(self, ranks: list[SimRank]) -> None:
        for r in ranks:
            res = requests.post(self.mon.url + "/v1/targets", timeout=10,
                                headers={"Authorization": f"Bearer {TOKEN}"},
                                json={"url": r.url, "job": "sim", "rank": r.state["rank"],
                                      "replica_group": r.state["replica_group"]})
            assert res.status_code == 200, res.text

    def sweep(self, n: int, train: bool = True) -> None:
        for _ in range(n):
            self.skew[0] += 1.0
            for g in self.job.alive if train else ():
                for r in self.job.sim.group(g):
                    r.update(step=r.state["step"] + 5, commits=r.state["commits"] + 5,
                             last_step_at=time.time() + self.skew[0])
            self.mon.sweep_once()

    def lose_rank_and_restart(self, g: int, host: str) -> None:
        """Group ``g``'s second rank dies (its group stops stepping): ``dead_rank``, the group
        evicted through the Lighthouse; then the group comes back on ``host``."""
        job = self.job
        kills = len(job.kills)
        job.sim.group(g)[1].set_mode("down")
        for _ in range(10):
            self.sweep(1, train=False)
            if len(job.kills) > kills:
                break
        assert len(job.kills) > kills, "the dead rank's group was not evicted"
        old = job.sim.group(g)
        for r in old:
            job.sim.ranks.remove(r)
        job.replica_ids[g] = f"replica_group_{g}:{uuid.uuid4()}"
        new: list[SimRank] = []

        async def boot() -> None:
            for gr, was in enumerate(old):  # the same global ranks, on a new host
                st = rank_state(was.state["rank"], g, participants=3)
                st.update(group_rank=gr, group_world_size=2, host=host, job="sim",
                          replica_id=job.replica_ids[g])
                rank = SimRank(job.sim, st)
                await rank.listen()
                new.append(rank)

        asyncio.run_coroutine_threadsafe(boot(), job.sim.loop).result(timeout=30)
        job.sim.ranks.extend(new)
        job.alive.add(g)
        job.requorum()
        self.register(new)
        self.sweep(2)


def host_series(metrics: str) -> list[str]:
    return [line for line in metrics.splitlines()
            if line.startswith(("lightkeeper_monitor_host_quarantine_state{",
                                "lightkeeper_monitor_host_offences{"))]


def test_hosts_left_behind_by_restarts_leave_the_ledger_and_its_series(tmp_path, job):
    """Every restart lands on a new host and the old one never comes back. Before, every host
    that ever offended stayed in the ledger for good (and a released one as ``released``):
    ``GET /v1/hosts`` and the per-sweep ledger work grew with every host the job ever ran on,
    the quarantine cap's fraction counted them all, and each released host kept its series.
    A host whose release action failed (an exec hook that exits 1 on first-2's release) stays
    shown."""
    skew = [0.0]
    hook = ("/bin/sh -c 'test \"$LIGHTKEEPER_EVENT\" != release || "
            "test \"$LIGHTKEEPER_HOST\" != first-2'")
    cfg = MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
                        sd_out=str(tmp_path / "targets.json"), job="sim", lighthouse=job.url,
                        register_token=TOKEN, forget_after_s=3,
                        rails=RailsConfig(min_replicas=1, cooldown_s=0),
                        quarantine=QuarantineConfig(window_s=60, ttl_s=30, max_quarantined=3,
                                                    actions=(f"exec:{hook}",)))
    mon = Monitor(cfg, clock=lambda: time.time() + skew[0]).start()  # sweeps once, then waits
    try:
        wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
        churn = Churn(job, mon, skew)
        churn.register(job.sim.ranks)
        churn.sweep(3)
        for i, g in enumerate((0, 1, 2)):
            churn.lose_rank_and_restart(g, f"new-{i}")
        hosts = requests.get(mon.url + "/v1/hosts", timeout=10).json()
        assert hosts["quarantined"] == ["first-0", "first-1", "first-2"]
        assert [h["host"] for h in hosts["hosts"]] == hosts["quarantined"]
        churn.sweep(35)  # past the quarantine's TTL: released
        hosts = requests.get(mon.url + "/v1/hosts", timeout=10).json()
        assert [h["state"] for h in hosts["hosts"]] == ["released"] * 3
        churn.sweep(65)  # past the window since the release: nothing counts any more
        hosts = requests.get(mon.url + "/v1/hosts", timeout=10).json()
        assert [(h["host"], h["state"], h["last_action"]["op"]) for h in hosts["hosts"]] == \
            [("first-2", "ok", "release")], hosts["hosts"]
        assert hosts["hosts"][0]["last_action"]["status"] in ("failed", "retrying")
        metrics = requests.get(mon.url + "/metrics", timeout=10).text
        assert host_series(metrics) == []
        assert 'lightkeeper_monitor_hosts{job="sim",state="released"} 0.0' in metrics
    finally:
        mon.stop()


def test_the_audit_log_keeps_its_newest_rows_and_every_one_still_needed(tmp_path, job,
                                                                       monkeypatch):
    """Every incident adds rows to the state file (a finding, its decisions, host offences and
    decisions, a goodput incident) and none ever left it: on the Kubernetes volume (1 GiB, half
    for bundles) a long job's file filled the disk, and a kill that cannot be recorded is not
    sent. Driven with a bound of 2 rows a table (``AUDIT_KEPT``) instead of 20,000."""
    import sqlite3

    import monitor.store
    monkeypatch.setattr(monitor.store, "AUDIT_KEPT", 2, raising=False)
    skew = [0.0]
    state = tmp_path / "state.sqlite"
    cfg = MonitorConfig(port=0, interval_s=3600, state_path=str(state), job="sim",
                        sd_out=str(tmp_path / "targets.json"), lighthouse=job.url,
                        register_token=TOKEN, forget_after_s=3,
                        rails=RailsConfig(min_replicas=1, cooldown_s=0))
    mon = Monitor(cfg, clock=lambda: time.time() + skew[0]).start()
    try:
        wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
        churn = Churn(job, mon, skew)
        churn.register(job.sim.ranks)
        churn.sweep(3)
        for i, g in enumerate((0, 1, 2, 0)):
            churn.lose_rank_and_restart(g, f"new-{i}")  # the 4th kill after rows were dropped
        newest = requests.get(mon.url + "/v1/findings", timeout=10).json()[0]
        assert (newest["kind"], newest["ranks"]) == ("dead_rank", [3])
        assert requests.get(mon.url + "/v1/evictions", timeout=10).json()[0]["status"] \
            == "confirmed"
    finally:
        mon.stop()
    with sqlite3.connect(state) as db:  # an open finding or a kill not judged yet stays
        rows = {t: db.execute(f"SELECT COUNT(*) FROM {t} WHERE {done}").fetchone()[0]
                for t, done in (("findings", "resolved_at IS NOT NULL"),
                                ("decisions", "status = 'confirmed'"),
                                ("host_offences", "1"), ("host_decisions", "1"))}
    assert rows == {"findings": 2, "decisions": 2, "host_offences": 2, "host_decisions": 2}


def test_a_rank_back_at_an_earlier_orphans_address_is_told_at_the_grace(tmp_path, job):
    """A group restarted on the same host reuses its ports (a fixed LIGHTKEEPER_WORKER_PORT), so
    a later eviction's orphan can have the URL of an earlier eviction's. The monitor remembered
    when it told a rank by URL alone, for good: the later orphan was not told until 5 s after
    the earlier one had been (8 s after its kill, not the 3 s grace), and the memory of every
    orphan ever told only grew."""
    skew = [0.0]
    cfg = MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
                        sd_out=str(tmp_path / "targets.json"), job="sim", lighthouse=job.url,
                        register_token=TOKEN, token="admin", rank_exit_token="exit",
                        forget_after_s=30, rails=RailsConfig(min_replicas=1, cooldown_s=0))
    mon = Monitor(cfg, clock=lambda: time.time() + skew[0]).start()
    try:
        wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
        churn = Churn(job, mon, skew)
        churn.register(job.sim.ranks)
        churn.sweep(3)
        orphan = job.sim.group(0)[1]
        port = orphan.port
        for incarnation in range(2):
            kills = len(job.kills)
            r = requests.post(mon.url + "/v1/evict", timeout=10, json={"replica_group": 0},
                              headers={"Authorization": "Bearer admin"})
            assert r.json()["decision"] == "evict", r.text
            assert len(job.kills) == kills + 1
            orphan.set_mode("ok")  # the kill reached group rank 0 only: group rank 1 lives on
            churn.sweep(4)  # past the 3 s grace
            told = requests.get(mon.url + "/v1/evictions?decision=evict", timeout=10).json()[0]
            assert "told rank(s)" in told["detail"] and orphan.url in told["detail"], \
                (incarnation, told["detail"])
            orphan.set_mode("down")  # it exits; its group restarts on the same ports
            churn.sweep(2)
            job.replica_ids[0] = f"replica_group_0:{uuid.uuid4()}"
            for rank in job.sim.group(0):
                rank.update(replica_id=job.replica_ids[0])
                rank.set_mode("ok")
            assert orphan.port == port
            job.alive.add(0)
            job.requorum()
            churn.sweep(2)
    finally:
        mon.stop()
