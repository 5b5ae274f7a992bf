"""The goodput ledger inside a live monitor: real HTTP, real SQLite, a real torchft Lighthouse that
simulated groups join (``SimJob``, tests/support/monitor_sim.py; a simulated group has no trainer,
so the test moves its ranks' ``step``/``commits`` itself).

The sweeps are driven by the test, one per simulated second on the monitor's injected clock, so
the ranks' pace is exact and no timing of this shared machine enters the numbers. Checked:
``GET /v1/goodput`` (job, groups, incidents, intervals; bad parameters), the metrics, the
overview's line, a manual eviction's ``capacity_lost``/``recovery`` tied to its decision id, and
a restarted monitor resuming the ledger from ``--state``."""

from __future__ import annotations

import time

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.config import MonitorConfig, RailsConfig
from monitor.evidence.lighthouse_status import LighthouseReader
from monitor.goodput import CAUSES
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob

TOKEN = "s3cret"
STEPS_PER_SWEEP = 5  # at one sweep per simulated second: a 0.2 s step


class Clock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def job():
    j = SimJob(3)
    yield j
    j.stop()


def start_monitor(tmp_path, job, clock, **kw) -> Monitor:
    cfg = MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
                        targets=job.sim.urls, sd_out=str(tmp_path / "targets.json"), job="sim",
                        lighthouse=job.url, token=TOKEN,
                        rails=RailsConfig(min_replicas=1, cooldown_s=0), **kw)
    mon = Monitor(cfg, clock=clock).start()  # its loop sweeps once, then waits an hour
    wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
    return mon


def drive(mon, job, clock, seconds: int, steps: int = STEPS_PER_SWEEP) -> None:
    """``seconds`` sweeps, one per simulated second; every live group commits ``steps``."""
    for _ in range(seconds):
        clock.t += 1.0
        for g in job.alive:
            for r in job.sim.group(g):
                r.update(step=r.state["step"] + steps, commits=r.state["commits"] + steps,
                         last_step_at=clock.t)
        mon.sweep_once()


def get(mon, path):
    r = requests.get(mon.url + path, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_goodput_api_metrics_overview_and_a_manual_eviction(tmp_path, job):
    clock = Clock()
    mon = start_monitor(tmp_path, job, clock, expected_groups=3)
    try:
        drive(mon, job, clock, 30)
        g = get(mon, "/v1/goodput")
        assert g["expected_groups"] == 3 and g["expected_groups_source"] == "flag"
        assert g["baseline"]["step_seconds"] == pytest.approx(1 / STEPS_PER_SWEEP, rel=0.05)
        j = g["job"]
        assert {c for c, v in j["badput_seconds"].items() if v} == {"startup"}
        # after startup (a pace window, then 10 samples) every replica-second is goodput
        assert j["goodput_seconds"] + j["badput_seconds"]["startup"] == pytest.approx(
            j["expected_seconds"], abs=0.01)
        assert j["goodput_seconds"] >= 3 * 15 and j["pending_seconds"] == 0
        assert [x["replica_group"] for x in g["groups"]] == [0, 1, 2]
        assert g["incidents"] == [] and g["error"] is None

        text = requests.get(mon.url + "/metrics", timeout=10).text
        assert 'lightkeeper_monitor_expected_replica_groups{job="sim"} 3.0' in text
        for cause in CAUSES:
            assert f'lightkeeper_monitor_badput_seconds_total{{cause="{cause}",job="sim"}}' \
                in text
        assert 'lightkeeper_monitor_replica_group_goodput_ratio{job="sim",replica_group="2"}' \
            in text

        r = requests.post(mon.url + "/v1/evict", json={"replica_group": 1, "reason": "test"},
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert r.status_code == 200 and r.json()["sent"], r.text
        eviction_id = r.json()["id"]
        # its recovery is settled once the kill is confirmed: the Lighthouse no longer hears it
        reader = LighthouseReader(job.url)
        try:
            wait_until(lambda: (s := reader.read()[0]) is not None
                       and not s.heartbeating(job.replica_ids[1]), 10, interval=0.05,
                       what="the Lighthouse to drop the killed replica")
        finally:
            reader.close()
        drive(mon, job, clock, 3, steps=0)  # the survivors wait for the Lighthouse
        drive(mon, job, clock, 20)
        g = get(mon, "/v1/goodput?incidents=5&intervals=50")
        [inc] = g["incidents"]
        assert inc["kind"] == "manual" and inc["eviction_id"] == eviction_id
        assert inc["replica_group"] == 1 and inc["open"] and inc["rejoined_at"] is None
        assert inc["back_to_pace_at"] is not None and inc["recovery_s"] <= 5
        # the evicted group's rank exits as the kill intends: no dead finding
        assert [f for f in get(mon, "/v1/findings") if f["kind"] == "dead"] == []
        by = inc["cost"]["by_cause"]
        assert by["capacity_lost"] == pytest.approx(23, abs=1.01)
        assert 2 * 2 <= by["recovery"] <= 2 * 5
        tied = [iv for iv in g["intervals"] if iv["cause"] in ("capacity_lost", "recovery")]
        assert tied and all(iv["eviction_id"] == eviction_id and iv["incident"] == inc["id"]
                            for iv in tied)
        assert {iv["replica_group"] for iv in tied if iv["cause"] == "recovery"} == {0, 2}
        g1 = next(x for x in g["groups"] if x["replica_group"] == 1)
        assert g1["badput_seconds"]["capacity_lost"] == pytest.approx(23, abs=1.01)

        # the counters hold what is settled: here all of it (tied to the eviction, or startup)
        text = requests.get(mon.url + "/metrics", timeout=10).text
        for cause in ("capacity_lost", "recovery", "startup"):
            line = next(x for x in text.splitlines() if x.startswith(
                f'lightkeeper_monitor_badput_seconds_total{{cause="{cause}",job="sim"}}'))
            assert float(line.split()[-1]) == pytest.approx(
                g["job"]["badput_seconds"][cause], abs=0.01)
        ratio = next(x for x in text.splitlines()
                     if x.startswith('lightkeeper_monitor_goodput_ratio{job="sim"}'))
        assert float(ratio.split()[-1]) == pytest.approx(g["job"]["goodput_ratio"], abs=1e-3)
        assert all(iv["settled"] for iv in tied)

        page = requests.get(mon.url + "/", timeout=10).text
        assert 'id="goodput-ratio"' in page and "capacity_lost" in page
        assert "manual in group 1" in page

        assert requests.get(mon.url + "/v1/goodput?incidents=x", timeout=10).status_code == 400
        assert get(mon, "/v1/goodput?incidents=0&intervals=0")["incidents"] == []
        before = get(mon, "/v1/goodput")
    finally:
        mon.stop()

    # a restarted monitor (same --state) resumes the ledger: totals, the open incident
    mon = start_monitor(tmp_path, job, clock, expected_groups=3)
    try:
        after = get(mon, "/v1/goodput")
        assert after["job"]["expected_seconds"] >= before["job"]["expected_seconds"]
        assert after["since"] == before["since"]
        assert [i["id"] for i in after["incidents"]] == [inc["id"]]
        drive(mon, job, clock, 5)
        again = get(mon, "/v1/goodput")
        assert again["incidents"][0]["cost"]["by_cause"]["capacity_lost"] > by["capacity_lost"]
        assert again["baseline"]["step_seconds"] == after["baseline"]["step_seconds"]
        assert again["job"]["badput_seconds"]["startup"] == before["job"]["badput_seconds"][
            "startup"]  # no second startup
    finally:
        mon.stop()
