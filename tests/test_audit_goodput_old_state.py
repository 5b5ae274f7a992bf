"""A monitor whose ``--state`` holds an older ledger (a snapshot of another version) starts a fresh
ledger and leaves the old rows as they are (docs/goodput.md, Storage): its incidents neither
overwrite the old ones (same ids) nor, after a later restart, take the old open ones in.

A live monitor (real HTTP, real SQLite) over a real torchft Lighthouse that simulated groups
join (``SimJob``, tests/support/monitor_sim.py: no trainer, the test moves the ranks' steps)."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.config import MonitorConfig, RailsConfig
from monitor.service import Monitor
from monitor.store import Store
from tests.support.monitor_sim import SimJob

TOKEN = "s3cret"


@pytest.fixture
def job():
    j = SimJob(3)
    yield j
    j.stop()


def old_incident(i: int, group: int, at: float) -> dict:
    return {"id": i, "kind": "straggler", "replica_group": group,
            "replica_id": f"replica_group_{group}:old", "ranks": [group], "onset_at": at,
            "onset_source": "first_seen", "detected_at": at, "finding_ids": [i],
            "closed_at": None, "note": "an older monitor's"}


def test_a_fresh_ledger_leaves_an_older_ledgers_incidents_alone(tmp_path, job):
    path = str(tmp_path / "state.sqlite")
    clock = [time.time()]
    old = [old_incident(1, 0, clock[0] - 3600), old_incident(2, 2, clock[0] - 3000)]
    store = Store(path)
    store.save_goodput({"version": 2, "since": clock[0] - 4000}, old, [], at=clock[0] - 2000)
    store.close()
    cfg = MonitorConfig(port=0, interval_s=3600, state_path=path, targets=job.sim.urls,
                        sd_out=str(tmp_path / "targets.json"), job="sim", lighthouse=job.url,
                        token=TOKEN, expected_groups=3,
                        rails=RailsConfig(min_replicas=1, cooldown_s=0))

    def start() -> Monitor:
        mon = Monitor(cfg, clock=lambda: clock[0]).start()  # sweeps once, then waits an hour
        wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
        return mon

    mon = start()
    try:
        job.train_and_sweep(mon, clock, 30)
        r = requests.post(mon.url + "/v1/evict", json={"replica_group": 1, "reason": "test"},
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert r.status_code == 200 and r.json()["sent"], r.text
        job.train_and_sweep(mon, clock, 5)
    finally:
        mon.stop()
    mon = start()  # the state is this ledger's now: resumed, the old rows still not its own
    try:
        job.train_and_sweep(mon, clock, 3)
        g = requests.get(mon.url + "/v1/goodput", timeout=10).json()
        [inc] = g["incidents"]
        assert inc["kind"] == "manual" and inc["replica_group"] == 1 and inc["id"] > 2
        # resumed open: its group never returned (back at pace, it no longer holds the baseline)
        assert inc["open"] and inc["back_to_pace"] == "reached" and g["baseline"]["frozen"] is None
    finally:
        mon.stop()
    db = sqlite3.connect(path)
    rows = dict(db.execute("SELECT id, data FROM goodput_incidents WHERE id <= 2").fetchall())
    db.close()
    assert {i: json.loads(d) for i, d in rows.items()} == {o["id"]: o for o in old}
