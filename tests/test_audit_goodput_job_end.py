"""A job that ends while an incident is still open: the ledger stops accounting, it does not book
every second after the end as lost capacity (the monitor usually outlives the job).

A live monitor (real HTTP, real SQLite) over a real torchft Lighthouse that simulated groups
join (``SimJob``, tests/support/monitor_sim.py: a simulated group has no trainer, so the test
moves its ranks' ``step``/``commits``; a killed group's ranks stop answering, as a finished or
dead process does). The sweeps are driven by the test on the monitor's injected clock."""

from __future__ import annotations

import time

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.config import MonitorConfig, RailsConfig
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob

TOKEN = "s3cret"


@pytest.fixture
def job():
    j = SimJob(3)
    yield j
    j.stop()


def test_an_ended_job_with_an_open_incident_is_not_accounted(tmp_path, job):
    clock = [time.time()]
    cfg = MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
                        targets=job.sim.urls, sd_out=str(tmp_path / "targets.json"), job="sim",
                        lighthouse=job.url, token=TOKEN, expected_groups=3,
                        rails=RailsConfig(min_replicas=1, cooldown_s=0))
    mon = Monitor(cfg, clock=lambda: clock[0]).start()  # sweeps once, then waits an hour

    def drive(seconds: int, steps: int = 5) -> None:
        job.train_and_sweep(mon, clock, seconds, steps)

    def goodput() -> dict:
        r = requests.get(mon.url + "/v1/goodput?intervals=0", timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    try:
        wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
        drive(30)
        r = requests.post(mon.url + "/v1/evict", json={"replica_group": 1, "reason": "test"},
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert r.status_code == 200 and r.json()["sent"], r.text
        drive(3, steps=0)
        drive(20)  # group 1 never returns: its incident stays open, losing capacity on it
        running = goodput()
        assert [i["open"] for i in running["incidents"]] == [True]
        assert running["job"]["badput_seconds"]["capacity_lost"] > 20

        for g in sorted(job.alive):  # the job ends: no rank answers any more
            job.kill(job.replica_ids[g])
        drive(30, steps=0)
        ended = goodput()
        assert ended["unobserved_seconds"] >= 25
        assert ended["job"]["expected_seconds"] <= running["job"]["expected_seconds"] + 3 * 5
        assert ended["job"]["goodput_ratio"] == pytest.approx(
            running["job"]["goodput_ratio"], abs=0.05)
        text = requests.get(mon.url + "/metrics", timeout=10).text
        ratio = next(x for x in text.splitlines()
                     if x.startswith('lightkeeper_monitor_goodput_ratio{job="sim"}'))
        assert float(ratio.split()[-1]) == pytest.approx(ended["job"]["goodput_ratio"],
                                                         abs=1e-3)
    finally:
        mon.stop()


def metric(mon: Monitor, name: str) -> float:
    text = requests.get(mon.url + "/metrics", timeout=10).text
    return float(next(x for x in text.splitlines() if x.startswith(name + "{")).split()[-1])


def test_a_monitor_restarted_after_the_job_ended_exports_the_ledgers_groups(tmp_path, job):
    """``expected_replica_groups`` says what ``GET /v1/goodput`` says, also when the restarted
    monitor finds the job stopped (no sweep accounted since)."""
    clock = [time.time()]
    cfg = MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
                        targets=job.sim.urls, sd_out=str(tmp_path / "targets.json"), job="sim",
                        lighthouse=job.url, rails=RailsConfig(min_replicas=1, cooldown_s=0))

    def start() -> Monitor:
        mon = Monitor(cfg, clock=lambda: clock[0]).start()
        wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
        return mon

    mon = start()
    try:
        job.train_and_sweep(mon, clock, 20)
        assert metric(mon, "lightkeeper_monitor_expected_replica_groups") == 3
        for r in job.sim.ranks:  # the job finished: its ranks say so
            r.update(phase="stopped")
        job.train_and_sweep(mon, clock, 3, steps=0)
    finally:
        mon.stop()
    mon = start()
    try:
        job.train_and_sweep(mon, clock, 3, steps=0)
        g = requests.get(mon.url + "/v1/goodput", timeout=10).json()
        assert g["expected_groups"] == 3 and g["unobserved_seconds"] >= 3
        assert metric(mon, "lightkeeper_monitor_expected_replica_groups") == 3
        assert metric(mon, "lightkeeper_monitor_goodput_ratio") == pytest.approx(
            g["job"]["goodput_ratio"], abs=1e-3)
    finally:
        mon.stop()


def test_a_monitor_started_for_another_job_on_the_state_starts_its_own_ledger(tmp_path, job,
                                                                              caplog):
    """Job a (3 groups) loses group 1 to a kill, its incident open, and stops; job b (its own
    Lighthouse, 2 groups) gets a monitor on the same --state. Before, job b's ledger carried on
    job a's: 3 groups expected, a's open incident booking capacity lost on b, a's kill b's last
    eviction. Now it is said once and b's ledger starts afresh, numbering after a's incidents."""
    import logging

    clock = [time.time()]

    def start(sim: SimJob, name: str) -> Monitor:
        cfg = MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
                            targets=sim.sim.urls, job=name, lighthouse=sim.url, token=TOKEN,
                            rails=RailsConfig(min_replicas=1, cooldown_s=600))
        mon = Monitor(cfg, clock=lambda: clock[0]).start()
        wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
        return mon

    def evict(mon: Monitor, g: int) -> None:
        r = requests.post(mon.url + "/v1/evict", json={"replica_group": g, "reason": "test"},
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert r.status_code == 200 and r.json()["sent"], r.text

    mon = start(job, "a")
    try:
        job.train_and_sweep(mon, clock, 30)
        evict(mon, 1)
        job.train_and_sweep(mon, clock, 5)
        a = requests.get(mon.url + "/v1/goodput", timeout=10).json()
        assert [(i["id"], i["open"]) for i in a["incidents"]] == [(1, True)]
    finally:
        mon.stop()
    clock[0] += 120
    b = SimJob(2)
    try:
        with caplog.at_level(logging.WARNING, logger="monitor.goodput.account"):
            mon = start(b, "b")
        try:
            b.train_and_sweep(mon, clock, 30)
            g = requests.get(mon.url + "/v1/goodput", timeout=10).json()
            assert g["expected_groups"] == 2 and g["incidents"] == []
            said = [r.getMessage() for r in caplog.records if "job a's" in r.getMessage()]
            assert len(said) == 1, said
            assert g["job"]["badput_seconds"]["capacity_lost"] == 0
            assert "lightkeeper_monitor_last_eviction_timestamp_seconds{" not in \
                requests.get(mon.url + "/metrics", timeout=10).text
            evict(mon, 1)
            b.train_and_sweep(mon, clock, 3)
            g = requests.get(mon.url + "/v1/goodput", timeout=10).json()
            assert [(i["id"], i["replica_group"]) for i in g["incidents"]] == [(2, 1)]
        finally:
            mon.stop()
    finally:
        b.stop()
