"""``POST /v1/evict`` answers 200 only when a kill went out (monitor/api/app.py; docs/monitor.md,
Eviction and safety rails).

A monitor swept by hand over a real torchft Lighthouse that simulated groups join (``SimJob``,
tests/support/monitor_sim.py).
"""

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


def monitor(tmp_path, job: SimJob, lighthouse: str | None) -> Monitor:
    return Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "state.sqlite"),
                                 targets=job.sim.urls, job="sim", lighthouse=lighthouse,
                                 token=TOKEN, rails=RailsConfig(min_replicas=1, cooldown_s=0),
                                 bundles=BundleConfig(enabled=False)))


def evict(client, group: int):
    return client.post("/v1/evict", json={"replica_group": group, "reason": "test"},
                       headers={"Authorization": f"Bearer {TOKEN}"})


@pytest.mark.parametrize("lighthouse", ["unreachable", None])
def test_an_eviction_whose_kill_did_not_go_out_is_not_answered_200(tmp_path, job, lighthouse):
    """The Lighthouse's port closed (502), or no ``--lighthouse`` at all (503): the eviction is
    decided and logged ``failed``, the body says ``"sent": false``. Before, the status was 200,
    which a script checking it took for a killed group. A kill that went out is still 200."""
    mon = monitor(tmp_path, job, job.url if lighthouse else None)
    try:
        client = create_app(mon).test_client()
        mon.sweep_once()  # the groups' replica ids, verified while the Lighthouse answers
        if lighthouse:
            job.front_down()
        r = evict(client, 1)
        body = r.get_json()
        assert r.status_code == (502 if lighthouse else 503), r.get_data(as_text=True)
        assert body["decision"] == "evict" and body["sent"] is False, body
        assert body["replica_id"] == job.replica_ids[1]
        (row,) = client.get("/v1/evictions?decision=evict").get_json()
        assert (row["id"], row["status"]) == (body["id"], "failed"), row
        assert job.kills == []
        if lighthouse:
            job.front_up()
            r = evict(client, 1)  # a failed kill is no eviction: sent now, 200
            assert r.status_code == 200 and r.get_json()["sent"] is True, r.get_data(as_text=True)
            assert job.kills == [job.replica_ids[1]]
    finally:
        mon.stop()
