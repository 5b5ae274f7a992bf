"""Bad input to the monitor's API is a 400 naming what is wrong, never a 500, and leaves nothing
in the audit log: a manual eviction's replica group out of any index's range, the goodput
ledger's query arguments.

A live monitor (real HTTP, real SQLite) over a real torchft Lighthouse that simulated groups
join (``SimJob``, tests/support/monitor_sim.py)."""

from __future__ import annotations

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.config import MonitorConfig, RailsConfig
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob

TOKEN = "s3cret"


@pytest.fixture
def monitor(tmp_path):
    job = SimJob(2)
    try:
        cfg = MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
                            targets=job.sim.urls, sd_out=str(tmp_path / "targets.json"),
                            job="sim", lighthouse=job.url, token=TOKEN,
                            rails=RailsConfig(min_replicas=1, cooldown_s=0))
        mon = Monitor(cfg).start()
        try:
            wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
            yield mon
        finally:
            mon.stop()
    finally:
        job.stop()


@pytest.mark.parametrize("group", [10**30, 1 << 63, -1, True, 1.0, "1", None])
def test_a_manual_eviction_of_no_possible_group_is_a_400(monitor, group):
    r = requests.post(monitor.url + "/v1/evict", json={"replica_group": group, "reason": "x"},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 400, r.text
    assert "replica_group" in r.json()["error"]
    assert requests.get(monitor.url + "/v1/evictions", timeout=10).json() == []


@pytest.mark.parametrize("query", ["incidents=x", "intervals=1e3", "incidents=", "intervals=0x1"])
def test_a_goodput_query_that_is_no_integer_is_a_400(monitor, query):
    r = requests.get(monitor.url + "/v1/goodput?" + query, timeout=10)
    assert r.status_code == 400 and query.split("=")[0] in r.json()["error"], r.text


@pytest.mark.parametrize("path", ["/v1/goodput?intervals=-1", "/v1/goodput?incidents=-5",
                                  "/v1/findings?limit=0", "/v1/evictions?limit=-1",
                                  "/v1/incidents?limit=-1"])
def test_a_count_below_its_least_is_a_400_not_raised_to_it(monitor, path):
    """``?intervals=-1`` answered 200 as ``intervals=0`` while the 400 for ``x`` said "(0 to
    10000)": a count below the range is refused as one that is no integer."""
    r = requests.get(monitor.url + path, timeout=10)
    name = path.split("?")[1].split("=")[0]
    assert r.status_code == 400 and r.json()["error"].startswith(f"{name} must be"), r.text
    assert requests.get(monitor.url + path.split("=")[0] + "=10", timeout=10).status_code == 200


@pytest.mark.parametrize("path,name", [
    ("/v1/evictions?decision=evicted", "decision"), ("/v1/evictions?decision=EVICT", "decision"),
    ("/v1/findings?open=maybe", "open"), ("/v1/findings?kind=hang", "'kind'"),
    ("/v1/evictions?replica_group=1", "'replica_group'"), ("/v1/goodput?limit=5", "'limit'"),
    ("/v1/incidents?decision=evict", "'decision'")])
def test_a_misspelt_filter_is_a_400_not_every_row(monitor, path, name):
    """``?decision=evicted`` answered 200 ``[]`` (read as "no evictions") and ``?kind=hang``
    every finding (read as "all of them hangs"): a value or a parameter the route does not know
    is refused, naming it."""
    r = requests.get(monitor.url + path, timeout=10)
    assert r.status_code == 400 and name in r.json()["error"], r.text
    for ok in ("/v1/evictions?decision=evict", "/v1/evictions?decision=hold&limit=3",
               "/v1/findings?open=TRUE", "/v1/findings?open=0", "/v1/incidents?limit=2"):
        assert requests.get(monitor.url + ok, timeout=10).status_code == 200, ok
