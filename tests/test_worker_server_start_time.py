"""A rank's start time on /metrics: the heals recording rule (dashboards/prometheus/rules.yml)
counts a heals series first seen after it from 0, matching the two series by their labels."""

from __future__ import annotations

import time

import requests
from prometheus_client.parser import text_string_to_metric_families

from worker_server import WorkerServer
from worker_server.state import RankIdentity, RankState


def test_start_time_gauge_beside_the_heals_counter_with_its_labels():
    before = time.time()
    state = RankState(RankIdentity(job="unit", replica_group=1, group_rank=1, group_world_size=2,
                                   lighthouse="http://127.0.0.1:1"))
    srv = WorkerServer(state)
    srv.serve()
    try:
        state.healed(5)  # before the first scrape, as a restarted rank does
        text = requests.get(srv.url + "/metrics", timeout=5).text
        started_at = requests.get(srv.url + "/v1/state", timeout=5).json()["started_at"]
    finally:
        srv.stop()
    samples = {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples}
    start = samples["lightkeeper_worker_start_time_seconds"]
    heals = samples["lightkeeper_heals_total"]
    assert heals.value == 1
    assert start.labels == heals.labels == {"job": "unit", "replica_group": "1", "rank": "3",
                                            "group_rank": "1"}
    assert start.value == started_at and before <= start.value <= time.time()
