"""``GET /v1/ranks`` (a row per target: what grows with the job) is encoded once per sweep, as
``/v1/cluster`` is: the same bytes and ETag to every poller until the next sweep, ``304`` to an
``If-None-Match`` of them (benchmarks/results/monitor_cluster_cache_10k_ab.json: the cost at
10,000 ranks)."""

from __future__ import annotations

import pytest

from monitor.api.app import create_app
from monitor.config import MonitorConfig
from monitor.service import Monitor
from tests.support.clock import ManualClock
from tests.support.monitor_sim import SimRanks


def test_ranks_are_encoded_once_per_sweep_with_an_etag(tmp_path):
    """Before: rebuilt and encoded on every request, with no ETag."""
    sim = SimRanks.start(4, groups=2)
    clock = ManualClock(1000.0)
    mon = Monitor(MonitorConfig(port=0, targets=[r.url for r in sim.ranks],
                                state_path=str(tmp_path / "m.db")), clock=clock)
    try:
        client = create_app(mon).test_client()
        assert client.get("/v1/ranks").get_json() == []  # before the first sweep
        mon.sweep_once()
        first = client.get("/v1/ranks")
        clock.advance(2.0)
        again = client.get("/v1/ranks")
        assert [r["url"] for r in first.get_json()] == [r.url for r in sim.ranks]
        assert again.get_data() == first.get_data()  # times in phase as of the first request
        assert again.headers["ETag"] == first.headers["ETag"]
        unchanged = client.get("/v1/ranks", headers={"If-None-Match": first.headers["ETag"]})
        assert unchanged.status_code == 304 and unchanged.get_data() == b""

        sim.ranks[0].update(step=101)
        mon.sweep_once()
        later = client.get("/v1/ranks", headers={"If-None-Match": first.headers["ETag"]})
        assert later.status_code == 200 and later.get_json()[0]["step"] == 101
        assert later.get_json()[1]["phase_for_s"] - first.get_json()[1]["phase_for_s"] \
            == pytest.approx(2.0)
    finally:
        mon.stop()
        sim.stop()
