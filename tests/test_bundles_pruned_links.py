"""An eviction whose incident bundle was pruned (``--bundle-total-bytes``, ``--bundle-keep``)
keeps its row, names the bundle as pruned and links nothing that would answer 404
(monitor/api/views.py ``decisions_json``; docs/monitor.md, Incident bundles).

A monitor swept by hand over a real torchft Lighthouse that simulated groups join (``SimJob``,
tests/support/monitor_sim.py)."""

from __future__ import annotations

import pytest

from monitor.api.app import create_app
from monitor.config import BundleConfig, MonitorConfig, RailsConfig
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob

TOKEN = "s3cret"


@pytest.fixture
def job():
    j = SimJob(3)
    yield j
    j.stop()


def test_a_pruned_bundle_is_said_pruned_and_never_linked(tmp_path, job):
    # one bundle on disk at a time: each write prunes the one before
    mon = Monitor(MonitorConfig(
        port=0, state_path=str(tmp_path / "state.sqlite"), targets=job.sim.urls, job="sim",
        lighthouse=job.url, token=TOKEN, rails=RailsConfig(min_replicas=1, cooldown_s=0),
        bundles=BundleConfig(timeout_s=1.0, max_bytes=1, total_bytes=1)))
    try:
        client = create_app(mon).test_client()
        mon.sweep_once()
        got = {}
        for g in (1, 2):
            r = client.post("/v1/evict", json={"replica_group": g, "reason": "test"},
                            headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200, r.get_data(as_text=True)
            got[g] = r.get_json()["bundle"]
        old, new = got[1], got[2]
        assert [b["id"] for b in client.get("/v1/incidents").get_json()["bundles"]] == [new]
        assert client.get(f"/v1/incidents/{old}/bundle").status_code == 404
        rows = {d["replica_group"]: d for d in
                client.get("/v1/evictions?decision=evict").get_json()}
        assert (rows[1]["bundle"], rows[1]["bundle_pruned"]) == (old, True), rows[1]
        assert (rows[2]["bundle"], rows[2]["bundle_pruned"]) == (new, False), rows[2]
        page = client.get("/").get_data(as_text=True)
        assert f"{old} (pruned)" in page and f"/v1/incidents/{old}/bundle" not in page
        assert f'href="/v1/incidents/{new}/bundle"' in page
    finally:
        mon.stop()
